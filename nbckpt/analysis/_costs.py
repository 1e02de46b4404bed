"""Measured checkpoint costs, one row per strategy: what the interval advisor starts from. The
**drag** is loop time lost per checkpoint beyond the stall, while the background write competes
with training for the host (on a GPU node the PyTorch blog on cached save plans reports a
background save of about 436 s before its fixes and 67 s after, Llama3-70B, 1856 H200s).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, TypeAlias

import pandas as pd

from .._errors import ConfigError

__all__ = ["Measured", "measured_drag", "measurements"]

#: ``Comparison.results``, or ``strategy -> (stall_s, persist_s[, drag_s])``.
Measured: TypeAlias = pd.DataFrame | Mapping[str, tuple[float, ...]]


def measured_drag(row: Mapping[Any, Any]) -> float:
    """A result row's drag per checkpoint as the advisor counts it: background work cannot speed
    the steps up, so a drag not measured above 0 (``drag_ci_s`` contains 0: "noise") counts as 0."""
    if "drag_ci_s" in row:  # any sequence: a list from JSON, a tuple, an array from pandas
        ci = row["drag_ci_s"]
        try:
            lo = float(ci[0]) if len(ci) == 2 else math.nan
        except (TypeError, ValueError, IndexError):
            lo = math.nan
        if not lo > 0:
            return 0.0
    drag = pd.to_numeric(row.get("drag_s", 0.0), errors="coerce")
    return 0.0 if pd.isna(drag) else max(float(drag), 0.0)


def measurements(results: Measured) -> pd.DataFrame:
    """Measured costs as columns ``strategy, mode, stall_s, persist_s, lag_s, drag_s``.

    Rows without a checkpoint (``none``) and partial rows are dropped. Without a ``mode`` column a
    strategy is async when its persist time exceeds its stall; the drag is :func:`measured_drag`.
    """
    if not isinstance(results, pd.DataFrame):
        if any(len(values) not in (2, 3) for values in results.values()):
            raise ConfigError("give each strategy (stall_s, persist_s) or (stall_s, persist_s, drag_s)")
        rows = [(name, *map(float, values), 0.0)[:4] for name, values in results.items()]  # drag: 0
        results = pd.DataFrame(rows, columns=["strategy", "stall_s", "persist_s", "drag_s"])
    stall_column = "stall_mean_s" if "stall_mean_s" in results.columns else "stall_s"
    if not {"strategy", stall_column} <= set(results.columns):
        raise ConfigError(
            f"results need columns strategy and stall_mean_s (or stall_s), got "
            f"{', '.join(map(str, results.columns))}"
        )

    def numbers(name: str) -> pd.Series:
        return pd.to_numeric(results.get(name, pd.Series(0.0, index=results.index)), errors="coerce")

    frame = pd.DataFrame(
        {
            "strategy": results["strategy"].astype(str),
            "stall_s": numbers(stall_column),
            "persist_s": numbers("persist_s").fillna(0.0),
        }
    )
    frame["drag_s"] = [measured_drag(row) for row in results.to_dict(orient="records")]
    frame["mode"] = (
        results["mode"].astype(str)
        if "mode" in results.columns
        else (frame["persist_s"] > frame["stall_s"]).map({True: "async", False: "sync"})
    )
    keep = frame["strategy"].ne("none") & frame["stall_s"].notna()
    if "checkpoints" in results.columns:
        keep &= numbers("checkpoints").fillna(0) > 0
    if "partial" in results.columns:
        keep &= ~results["partial"].fillna(False).astype(bool)
    frame = frame[keep].copy()
    if frame.empty:
        raise ConfigError("no strategy with a measured checkpoint stall (only 'none' or empty results)")
    if (frame["stall_s"] < 0).any():
        raise ConfigError("measured stall times must be >= 0 seconds")
    if not frame["mode"].isin(["sync", "async"]).all():
        raise ConfigError(f"mode must be 'sync' or 'async', got {sorted(set(frame['mode']))}")
    frame["lag_s"] = frame["persist_s"].where(frame["mode"] == "async", 0.0)
    return frame[["strategy", "mode", "stall_s", "persist_s", "lag_s", "drag_s"]].reset_index(drop=True)
