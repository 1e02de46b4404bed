"""Every private plotly name nbckpt reads, in one place (checked with plotly 6 and 7).

Plotly's ``FigureWidget`` offers no public way to: read its widget's JavaScript module (the
class attribute ``_esm``, anywidget's), which :mod:`._live_figure` wraps so that its views leave
no listeners behind; set a widget's plot config (``_config``: ``go.Figure`` takes ``config`` in
``show``, a widget has no ``show``); or read the layout and data a widget last sent to its
views (``_layout_obj._props``, ``_data``), which the wrapper syncs to pages loaded later.
:func:`missing` (tested) names what a plotly release changed.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

import plotly
import plotly.graph_objects as go

__all__ = ["missing", "set_config", "widget_esm", "widget_state"]


def widget_esm() -> str:
    """The JavaScript module of plotly's ``FigureWidget`` (ImportError where anywidget is missing)."""
    return str(go.FigureWidget._esm)


def set_config(figure: go.FigureWidget, **config: Any) -> None:
    """Add ``config`` (plotly.js's plot config, e.g. ``responsive=True``) to ``figure``'s."""
    figure._config = {**figure._config, **config}


def widget_state(figure: go.FigureWidget) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Copies of the layout and the traces' data ``figure`` holds now, as plotly sends them."""
    return deepcopy(figure._layout_obj._props), deepcopy(figure._data)


def missing() -> list[str]:
    """The private names above that this plotly lacks (none: all is well)."""
    figure = go.FigureWidget(go.Figure(go.Scatter(x=[0], y=[0])))
    found = {
        # a str or a file anywidget reads (FileContents): its text is an ES module
        "FigureWidget._esm": "export" in str(getattr(go.FigureWidget, "_esm", "")),
        "FigureWidget._config": isinstance(getattr(figure, "_config", None), dict),
        "FigureWidget._layout_obj._props": isinstance(
            getattr(getattr(figure, "_layout_obj", None), "_props", None), dict
        ),
        "FigureWidget._data": isinstance(getattr(figure, "_data", None), list),
    }
    return [f"plotly {plotly.__version__}: {name}" for name, ok in found.items() if not ok]
