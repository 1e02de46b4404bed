"""Measured checkpoint costs, one row per strategy: what the interval model and the projection
start from. The **drag** is loop time lost per checkpoint beyond the stall, while the background
write competes with training for the host (on a GPU node the PyTorch blog on cached save plans
reports a background save of about 436 s before its fixes and 67 s after, Llama3-70B, 1856 H200s).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import pandas as pd

from .._errors import ConfigError

__all__ = ["Measured", "measurements"]

#: ``Comparison.results``, or ``strategy -> (stall_s, persist_s[, drag_s])``.
Measured: TypeAlias = pd.DataFrame | Mapping[str, tuple[float, ...]]


def measurements(results: Measured) -> pd.DataFrame:
    """Measured costs as columns ``strategy, mode, stall_s, persist_s, lag_s, drag_s``.

    Rows without a checkpoint (``none``) and partial rows are dropped. Without a ``mode`` column a
    strategy is async when its persist time exceeds its stall. Background work cannot speed the
    steps up, so a drag not measured above 0 (``drag_ci_s`` contains 0: "noise") counts as 0.
    """
    if isinstance(results, pd.DataFrame):
        stall_column = "stall_mean_s" if "stall_mean_s" in results.columns else "stall_s"
        missing = {"strategy", stall_column} - set(results.columns)
        if missing:
            raise ConfigError(
                f"results need columns strategy and stall_mean_s (or stall_s); missing {sorted(missing)}"
            )

        def column(name: str) -> Any:
            return pd.to_numeric(results[name] if name in results.columns else 0.0, errors="coerce")

        frame = pd.DataFrame(
            {
                "strategy": results["strategy"].astype(str),
                "stall_s": pd.to_numeric(results[stall_column], errors="coerce"),
                "persist_s": column("persist_s"),
                "drag_s": column("drag_s"),
            }
        )
        if "drag_ci_s" in results.columns:
            measured = pd.Series([isinstance(ci, (list, tuple)) and len(ci) == 2 and float(ci[0]) > 0
                                  for ci in results["drag_ci_s"]], index=frame.index, dtype=bool)
            frame["drag_s"] = frame["drag_s"].where(measured, 0.0)
        if "mode" in results.columns:
            frame["mode"] = results["mode"].astype(str)
        if "checkpoints" in results.columns:
            frame = frame[pd.to_numeric(results["checkpoints"], errors="coerce").fillna(0) > 0]
        if "partial" in results.columns:
            frame = frame[~results.loc[frame.index, "partial"].fillna(False).astype(bool)]
    else:
        rows = []
        for name, values in results.items():
            numbers = [float(v) for v in values]
            if len(numbers) not in (2, 3):
                raise ConfigError(f"{name}: give (stall_s, persist_s) or (stall_s, persist_s, drag_s)")
            rows.append((name, *numbers[:2], numbers[2] if len(numbers) == 3 else 0.0))
        frame = pd.DataFrame(rows, columns=["strategy", "stall_s", "persist_s", "drag_s"])
    frame = frame[(frame["strategy"] != "none") & frame["stall_s"].notna()].copy()
    if frame.empty:
        raise ConfigError("no strategy with a measured checkpoint stall (only 'none' or empty results)")
    if (frame["stall_s"] < 0).any():
        raise ConfigError("measured stall times must be >= 0 seconds")
    frame["persist_s"] = frame["persist_s"].fillna(0.0)
    frame["drag_s"] = frame["drag_s"].fillna(0.0).clip(lower=0.0)
    if "mode" not in frame.columns:
        frame["mode"] = (frame["persist_s"] > frame["stall_s"]).map({True: "async", False: "sync"})
    elif not frame["mode"].isin(["sync", "async"]).all():
        raise ConfigError(f"mode must be 'sync' or 'async', got {sorted(set(frame['mode']))}")
    frame["lag_s"] = frame["persist_s"].where(frame["mode"] == "async", 0.0)
    columns = ["strategy", "mode", "stall_s", "persist_s", "lag_s", "drag_s"]
    return frame[columns].reset_index(drop=True)

