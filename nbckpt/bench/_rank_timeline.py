"""Every rank's events on one clock, for the report's swimlanes (``rank_timeline`` in the JSON).

Under torchrun each rank's comparison keeps its own events (``Comparison.timeline``) on its own
event clock (``time.perf_counter_ns``). After the comparison, and outside every timed region,
:func:`gather_rank_timeline` moves them onto the wall clock (``time.time_ns``, which the ranks
and hosts share as well as their clocks agree) and gathers them to rank 0, which writes them as
``rank_timeline``: one row per event and rank (``rank``, ``strategy``, ``repeat``, ``kind``,
``step``, ``start_ns``, ``end_ns``, ``bytes``; times in wall-clock ns). A ``persist``'s
``bytes`` are what this rank wrote of that checkpoint (its files, as the job's ``ranks[].bytes``
count them), not the state's that the engines' events give: a replicated state is written once
over all ranks, so the report's rate over time adds up to the bytes written. Kept apart from
the job's figures (``._job``): they need none of it, and a report without events still draws those.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch.distributed as dist

__all__ = ["gather_rank_timeline", "wall_events"]


#: A checkpoint in one lane: its strategy, repeat and step.
CheckpointKey = tuple[str, int, int]


def wall_events(
    timeline: pd.DataFrame, rank: int, offset_ns: int, written: Mapping[CheckpointKey, int] | None = None
) -> list[dict[str, Any]]:
    """``timeline``'s rows (``Comparison.timeline``) as ``rank_timeline`` rows of ``rank``, their
    event-clock times moved by ``offset_ns`` onto the wall clock; the persists of each checkpoint
    in ``written`` carry the bytes this rank wrote of it (:func:`_as_written`)."""
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
    return _as_written(rows, written or {})


def _as_written(rows: list[dict[str, Any]], written: Mapping[CheckpointKey, int]) -> list[dict[str, Any]]:
    """``rows`` with the persists of each checkpoint in ``written`` sharing its bytes in
    proportion to the bytes each recorded (evenly where they recorded none), whole bytes that add
    up to it exactly; the persists of a checkpoint not in it keep theirs."""
    persists: dict[CheckpointKey, list[dict[str, Any]]] = {}
    for row in rows:
        key = (row["strategy"], row["repeat"], row["step"])
        if row["kind"] == "persist" and key in written:
            persists.setdefault(key, []).append(row)
    for key, group in persists.items():
        weights = [row["bytes"] for row in group] if any(row["bytes"] for row in group) else [1] * len(group)
        total, done, given = sum(weights), 0, 0
        for row, weight in zip(group, weights, strict=True):
            done += weight
            # Each share is the rounded-down running total less what was given: no byte lost.
            share = written[key] * done // total - given
            row["bytes"], given = share, given + share
    return rows


def _whole(value: Any) -> int | None:
    """An int, None for what is missing (None, NaN: pandas' mark in a numeric column)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value)


def gather_rank_timeline(
    group: Any, timeline: pd.DataFrame, written: Mapping[CheckpointKey, int] | None = None
) -> list[dict[str, Any]]:
    """Every rank's events on the wall clock, in rank order, on rank 0 (``[]`` elsewhere), each
    rank's persists carrying what it ``written`` (:func:`wall_events`): a collective on
    ``group``, which every rank must call at the same point."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    offset_ns = time.time_ns() - time.perf_counter_ns()  # the event clock on the wall clock
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(wall_events(timeline, rank, offset_ns, written), gathered, dst=0, group=group)
    return [row for rows in gathered for row in rows] if gathered is not None else []
