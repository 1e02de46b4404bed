"""What every figure shares: a strategy's colour, the column check, static or live output."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from .._errors import ConfigError
from ._live_figure import live_figure

__all__ = ["output", "require_columns", "strategy_colour"]

# plotly's D3 colours in the order the built-in strategies register (none, torch-save,
# dcp-sync, dcp-async, dcp-async-stager, nbckpt-sync, nbckpt-async, nbckpt-async-overlap,
# nbckpt-incremental), so each keeps the colour it has always had in nbckpt's figures.
_REGISTRY_PALETTE = (
    "#7f7f7f",
    "#d62728",
    "#ff7f0e",
    "#bcbd22",
    "#e377c2",
    "#9467bd",
    "#2ca02c",
    "#1f77b4",
    "#17becf",
)


def strategy_colour(strategy: str) -> str:
    """The colour a strategy has in every figure: by its place in ``nbckpt.bench.STRATEGIES``,
    past the palette (and for names never registered) a stable pick by name."""
    from ..bench._internal import STRATEGIES

    registered = list(STRATEGIES)
    if strategy in registered and registered.index(strategy) < len(_REGISTRY_PALETTE):
        return _REGISTRY_PALETTE[registered.index(strategy)]
    palette = qualitative.Dark24
    return str(palette[sum(strategy.encode()) % len(palette)])


def output(fig: go.Figure, widget: bool) -> go.Figure:
    """The one place that turns a static figure into a live widget."""
    return live_figure(fig) if widget else fig


def require_columns(df: pd.DataFrame, columns: Iterable[str], figure: str) -> None:
    """ConfigError naming ``figure`` unless ``df`` is a DataFrame with ``columns``."""
    if not isinstance(df, pd.DataFrame):
        hint = " (its .timeline?)" if isinstance(getattr(df, "timeline", None), pd.DataFrame) else ""
        raise ConfigError(f"{figure} needs a pandas DataFrame, got {type(df).__name__}{hint}")
    missing = sorted(set(columns) - set(df.columns))
    if missing:
        got = ", ".join(map(str, df.columns))
        raise ConfigError(f"{figure} needs columns {', '.join(missing)}; got {got}")
