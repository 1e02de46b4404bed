"""The experiment runner and comparisons: events, metrics, floors, stop, JSON."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from nbckpt import Checkpointer, ConfigError, Event
from nbckpt import experiment as ex
from nbckpt import strategies as st
from nbckpt.workloads import SyntheticWorkload

MB = 1 << 20


def small_workload() -> SyntheticWorkload:
    workload = SyntheticWorkload(2 * MB, compute_ms=1.0)
    workload.build()
    return workload


def test_run_records_every_step_stall_and_engine_phase(tmp_path: Any) -> None:
    seen: list[Event] = []
    result = ex.run_experiment(
        small_workload(), "nbckpt-async", str(tmp_path), steps=6, every=3,
        on_event=seen.append, warmup=True,
    )
    events = result.events
    assert [e.step for e in events if e.kind == "step"] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events if e.kind == "stall"] == [3, 6]
    for kind in ("stage", "persist", "fsync", "commit"):
        assert {e.step for e in events if e.kind == kind} == {3, 6}, kind
    assert seen == events  # live, in order, warm-up (step 0) left out
    assert {e.label for e in seen} == {"nbckpt-async"}
    assert "nbckpt-persist" in {e.thread for e in seen}
    metrics = result.metrics()
    assert metrics["steps"] == 6 and metrics["checkpoints"] == 6 // 3
    assert metrics["stall_mean_s"] > 0 and metrics["write_gbs"] > 0
    assert metrics["peak_host_mb"] > 0 and math.isnan(metrics["peak_device_mb"])
    assert not metrics["stopped"]
    with Checkpointer(tmp_path / "nbckpt-async") as ckpt:
        assert ckpt.steps() == [0, 3, 6]
    frame = result.timeline_frame()
    assert len(frame) == len(events)
    assert frame["start_s"].min() >= 0  # relative to the start of the measured run


def test_overlap_counts_the_wait_before_the_next_update_as_stall(tmp_path: Any) -> None:
    result = ex.run_experiment(
        small_workload(), "nbckpt-async-overlap", str(tmp_path), steps=5, every=2
    )
    stalls = [(e.step, e.detail["part"]) for e in result.events if e.kind == "stall"]
    assert stalls == [(2, "save"), (2, "before_step"), (4, "save"), (4, "before_step")]
    assert result.metrics()["checkpoints"] == 2


def test_stop_ends_the_run_after_the_step_and_saves_commit(tmp_path: Any) -> None:
    stop = threading.Event()

    def on_event(event: Event) -> None:
        if event.kind == "stall" and event.step == 2:
            stop.set()

    result = ex.run_experiment(
        small_workload(), "nbckpt-async", str(tmp_path), steps=50, every=1,
        on_event=on_event, stop=stop,
    )
    assert result.stopped
    assert result.metrics()["steps"] == 2
    directory = tmp_path / "nbckpt-async"
    with Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [1, 2]
    assert not [p for p in os.listdir(directory) if p.startswith(".tmp")]


def test_compare_returns_the_agreed_tables(tmp_path: Any) -> None:
    reported: list[tuple[str, dict[str, Any]]] = []
    lines: list[str] = []
    events: list[Event] = []
    comparison = ex.compare(
        small_workload(), ["none", "torch-save", "nbckpt-async"], str(tmp_path),
        steps=4, every=2, repeats=2, on_event=events.append,
        on_result=lambda name, metrics: reported.append((name, metrics)),
        progress=lines.append,
    )
    results = comparison.results
    assert list(results.columns) == ex.RESULT_COLUMNS
    assert list(results["strategy"]) == ["none", "torch-save", "nbckpt-async"]
    rows = results.set_index("strategy")
    assert rows.loc["none", "overhead_pct"] == 0
    assert rows.loc["none", "checkpoints"] == 0 and rows.loc["none", "stall_mean_s"] == 0
    assert list(rows["steps"]) == [8, 8, 8]  # two repeats of four steps
    assert rows.loc["torch-save", "checkpoints"] == rows.loc["nbckpt-async", "checkpoints"] == 4
    assert rows.loc["torch-save", "reduction_vs_torch_save"] == pytest.approx(1.0)
    floors = comparison.floors
    assert floors.bytes == 2 * MB and floors.copy_s > 0 and floors.write_gbs > 0
    assert rows.loc["torch-save", "stall_vs_copy_floor"] == pytest.approx(
        rows.loc["torch-save", "stall_mean_s"] / floors.copy_s
    )
    assert rows.loc["nbckpt-async", "write_vs_floor_pct"] == pytest.approx(
        rows.loc["nbckpt-async", "write_gbs"] / floors.write_gbs * 100
    )
    assert [name for name, _ in reported] == ["none", "torch-save", "nbckpt-async"] * 2
    assert [m["repeat"] for _, m in reported] == [0, 0, 0, 1, 1, 1]
    assert len(comparison.runs) == 6

    timeline = comparison.timeline
    assert list(timeline.columns) == ex.TIMELINE_COLUMNS
    assert set(timeline["strategy"]) == {"none", "torch-save", "nbckpt-async"}
    assert len(timeline) == len(events)
    assert (timeline["label"] == timeline["strategy"]).all()
    stalls = timeline[(timeline["kind"] == "stall") & (timeline["repeat"] == 1)]
    assert list(stalls["strategy"]) == ["torch-save"] * 2 + ["nbckpt-async"] * 2
    assert any("floors for" in line for line in lines)
    # checkpoints of each run are removed; the floor's scratch file too
    assert sorted(os.listdir(tmp_path)) == []

    out = tmp_path / "out.json"
    comparison.to_json(out)
    document = json.loads(out.read_text())
    assert document["schema"] == ex.SCHEMA
    assert set(document) >= {"workload", "bytes", "device", "directory", "environment",
                             "floors", "results", "runs", "timeline"}
    assert list(document["results"][0]) == ex.RESULT_COLUMNS
    assert document["results"][0]["write_gbs"] is None  # NaN becomes null
    assert "nbckpt-async" in comparison.table()


def test_a_user_strategy_instance_can_be_compared(tmp_path: Any) -> None:
    class Recording(st.Strategy):
        name = "recording"
        local_only = False

        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []
            self.opened = 0

        def open(self, directory: str, timeline: Any) -> None:
            super().open(directory, timeline)
            self.opened += 1

        def save(self, state: Mapping[str, Any], step: int) -> None:
            self.steps.append(step)

    mine = Recording()
    comparison = ex.compare(small_workload(), [mine], str(tmp_path), steps=4, every=2,
                            repeats=2, progress=None)
    assert mine.opened == 2 and mine.steps == [0, 2, 4, 0, 2, 4]  # warm-up save is step 0
    assert comparison.results["checkpoints"].tolist() == [4]
    assert math.isnan(comparison.results["overhead_pct"].iloc[0])  # no "none" baseline


def test_floors_leave_nothing_behind(tmp_path: Any) -> None:
    floors = ex.measure_floors(3 * MB, str(tmp_path))
    assert floors.sample_bytes == floors.bytes == 3 * MB
    assert floors.copy_gbs == pytest.approx(3 * MB / floors.copy_s / 1e9)
    assert floors.write_s > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be a positive integer"),
        ({"every": 5, "steps": 4}, r"every \(5\) must not exceed steps \(4\)"),
        ({"repeats": 0}, "repeats must be a positive integer"),
        ({"strategies": ["none", "none"]}, "each strategy may appear once"),
        ({"strategies": ["bogus"]}, "unknown strategy 'bogus'"),
        ({"device": "cuda"}, "differs from the workload's device"),
    ],
)
def test_compare_rejects_bad_arguments_before_running(
    tmp_path: Any, kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"strategies": ["none"], "steps": 4, "every": 2, **kwargs}
    workload = SyntheticWorkload(MB, compute_ms=0)
    with pytest.raises(ConfigError, match=message):
        ex.compare(workload, directory=str(tmp_path / "never"), progress=None, **args)
    assert not (tmp_path / "never").exists()
    assert not workload.built
