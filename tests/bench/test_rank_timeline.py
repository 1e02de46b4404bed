"""Every rank's events on the wall clock (``nbckpt.bench._rank_timeline``), without processes;
the gather itself runs under real torchrun in tests/notebook/test_report_from.py."""

from __future__ import annotations

import math

import pandas as pd

from nbckpt.bench._comparison import TIMELINE_COLUMNS
from nbckpt.bench._rank_timeline import wall_events


def test_wall_events_move_the_event_clock_and_name_the_rank() -> None:
    timeline = pd.DataFrame(
        [
            {
                "strategy": "nbckpt-async",
                "repeat": 1,
                "kind": "persist",
                "label": "nbckpt-async",
                "step": 4.0,
                "rank": None,
                "start_s": 0.5,
                "end_s": 0.7,
                "duration_s": 0.2,
                "bytes": 1024,
                "thread": "w",
                "pid": 1,
                "start_ns": 1_000,
                "end_ns": 3_000,
            },
            {
                "strategy": "none",
                "repeat": 0,
                "kind": "step",
                "label": "none",
                "step": math.nan,
                "rank": None,
                "start_s": 0.0,
                "end_s": 0.1,
                "duration_s": 0.1,
                "bytes": None,
                "thread": "m",
                "pid": 1,
                "start_ns": 10,
                "end_ns": 20,
            },
        ],
        columns=TIMELINE_COLUMNS,
    )
    rows = wall_events(timeline, rank=3, offset_ns=1_000_000)
    assert rows == [
        {
            "rank": 3,
            "strategy": "nbckpt-async",
            "repeat": 1,
            "kind": "persist",
            "step": 4,
            "start_ns": 1_001_000,
            "end_ns": 1_003_000,
            "bytes": 1024,
        },
        {
            "rank": 3,
            "strategy": "none",
            "repeat": 0,
            "kind": "step",
            "step": None,
            "start_ns": 1_000_010,
            "end_ns": 1_000_020,
            "bytes": 0,
        },
    ]


def test_a_checkpoints_persists_carry_the_bytes_this_rank_wrote_of_it() -> None:
    """The engines' persists give the state's bytes; a rank that wrote part of a replicated state
    (DCP's dedup, nbckpt's) must not count the whole: the report's rate over time adds them up."""
    events = [
        ("nbckpt-async", 0, "persist", 4, 600),  # two writer threads' parts of one checkpoint
        ("nbckpt-async", 0, "persist", 4, 400),
        ("nbckpt-async", 0, "persist", 8, 1000),  # not measured on disk: kept as recorded
        ("dcp-sync", 0, "persist", 4, 0),  # recorded nothing: an even share
        ("dcp-sync", 0, "persist", 4, 0),
        ("nbckpt-async", 0, "stall", 4, 1000),  # no persist: never a write
    ]
    timeline = pd.DataFrame(
        [
            dict(
                zip(("strategy", "repeat", "kind", "step", "bytes"), event, strict=True), start_ns=0, end_ns=1
            )
            for event in events
        ],
        columns=TIMELINE_COLUMNS,
    )
    written = {("nbckpt-async", 0, 4): 501, ("dcp-sync", 0, 4): 7, ("dcp-sync", 1, 4): 99}
    rows = wall_events(timeline, rank=1, offset_ns=0, written=written)
    assert [row["bytes"] for row in rows] == [300, 201, 1000, 3, 4, 1000]
