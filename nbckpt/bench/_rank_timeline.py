"""Every rank's events on one clock, for the report's swimlanes (``rank_timeline`` in the JSON).

Under torchrun each rank's comparison keeps its own events (``Comparison.timeline``) on its own
event clock (``time.perf_counter_ns``). After the comparison, and outside every timed region,
:func:`gather_rank_timeline` moves them onto the wall clock (``time.time_ns``, which the ranks
and hosts share as well as their clocks agree) and gathers them to rank 0, which writes them as
``rank_timeline``: one row per event and rank (``rank``, ``strategy``, ``repeat``, ``kind``,
``step``, ``start_ns``, ``end_ns``, ``bytes``; times in wall-clock ns). Kept apart from the
job's figures (``._job``): they need none of it, and a report without events still draws those.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pandas as pd
import torch.distributed as dist

__all__ = ["gather_rank_timeline", "wall_events"]


def wall_events(timeline: pd.DataFrame, rank: int, offset_ns: int) -> list[dict[str, Any]]:
    """``timeline``'s rows (``Comparison.timeline``) as ``rank_timeline`` rows of ``rank``, their
    event-clock times moved by ``offset_ns`` onto the wall clock."""
    rows = []
    for event in timeline.to_dict(orient="records"):
        step, nbytes = _whole(event.get("step")), _whole(event.get("bytes"))
        rows.append(
            {
                "rank": rank,
                "strategy": str(event["strategy"]),
                "repeat": int(event["repeat"]),
                "kind": str(event["kind"]),
                "step": step,
                "start_ns": int(event["start_ns"]) + offset_ns,
                "end_ns": int(event["end_ns"]) + offset_ns,
                "bytes": nbytes or 0,
            }
        )
    return rows


def _whole(value: Any) -> int | None:
    """An int, None for what is missing (None, NaN: pandas' mark in a numeric column)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)


def gather_rank_timeline(group: Any, timeline: pd.DataFrame) -> list[dict[str, Any]]:
    """Every rank's events on the wall clock, in rank order, on rank 0 (``[]`` elsewhere): a
    collective on ``group``, which every rank must call at the same point."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    offset_ns = time.time_ns() - time.perf_counter_ns()  # the event clock on the wall clock
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(wall_events(timeline, rank, offset_ns), gathered, dst=0, group=group)
    return [row for rows in gathered for row in rows] if gathered is not None else []
