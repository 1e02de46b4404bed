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
