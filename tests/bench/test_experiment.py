"""The experiment runner and comparisons: events, metrics, intervals, order, load, stop, JSON."""

from __future__ import annotations

import json
import math
import os
import threading
from collections import namedtuple
from collections.abc import Mapping
from typing import Any

import pytest

from nbckpt import Checkpointer, ConfigError, Event, Timeline, bench
from nbckpt.bench import _compare, _comparison, _load, _stats
from nbckpt.bench._workloads import SyntheticWorkload

MB = 1 << 20


def small_workload() -> SyntheticWorkload:
    workload = SyntheticWorkload(2 * MB, compute_ms=1.0)
    workload.build()
    return workload


def test_run_records_every_step_stall_and_engine_phase(tmp_path: Any) -> None:
    seen: list[Event] = []
    result = bench.run_experiment(
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
    assert metrics["cpu_s"] > 0 and metrics["other_cpu_cores"] >= 0  # the run's load record
    with Checkpointer(tmp_path / "nbckpt-async") as ckpt:
        assert ckpt.steps() == [0, 3, 6]
    frame = result.timeline_frame()
    assert len(frame) == len(events)
    assert frame["start_s"].min() >= 0  # relative to the start of the measured run
    # every step's cost is its own time plus the save stall after it; together, the loop
    costs = result.step_costs()
    assert len(costs) == 6 and sum(costs) <= result.wall_s


def test_overlap_counts_the_wait_before_the_next_update_as_stall(tmp_path: Any) -> None:
    result = bench.run_experiment(
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

    result = bench.run_experiment(
        small_workload(), "nbckpt-async", str(tmp_path), steps=50, every=1,
        on_event=on_event, stop=stop,
    )
    assert result.stopped
    assert result.metrics()["steps"] == 2
    directory = tmp_path / "nbckpt-async"
    with Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [1, 2]
    assert not [p for p in os.listdir(directory) if p.startswith(".tmp")]


def test_compare_interleaves_repeats_and_returns_the_agreed_tables(tmp_path: Any) -> None:
    reported: list[tuple[str, dict[str, Any]]] = []
    lines: list[str] = []
    events: list[Event] = []
    comparison = bench.compare(
        small_workload(), ["none", "torch-save", "nbckpt-async"], str(tmp_path),
        steps=4, every=2, repeats=2, on_event=events.append,
        on_result=lambda name, metrics: reported.append((name, metrics)),
        progress=lines.append,
    )
    # every repeat runs every strategy; the second starts one place further on
    assert comparison.order == [["none", "torch-save", "nbckpt-async"],
                                ["torch-save", "nbckpt-async", "none"]]
    assert [name for name, _ in reported] == ["none", "torch-save", "nbckpt-async",
                                              "torch-save", "nbckpt-async", "none"]
    assert [m["repeat"] for _, m in reported] == [0, 0, 0, 1, 1, 1]
    assert [m["position"] for _, m in reported] == [0, 1, 2, 0, 1, 2]
    assert list(comparison.runs["strategy"]) == [name for name, _ in reported]

    results = comparison.results
    assert list(results.columns) == bench.RESULT_COLUMNS
    assert list(results["strategy"]) == ["none", "torch-save", "nbckpt-async"]
    rows = results.set_index("strategy")
    assert rows.loc["none", "overhead_pct"] == 0 and rows.loc["none", "overhead_ci_pct"] == [0.0, 0.0]
    assert rows.loc["none", "checkpoints"] == 0 and rows.loc["none", "stall_mean_s"] == 0
    assert list(rows["steps"]) == [4, 4, 4] and list(rows["repeats"]) == [2, 2, 2]  # per run
    assert rows.loc["torch-save", "checkpoints"] == rows.loc["nbckpt-async", "checkpoints"] == 2
    for name in ("torch-save", "nbckpt-async"):
        lo, hi = rows.loc[name, "overhead_ci_pct"]
        assert lo <= rows.loc[name, "overhead_pct"] <= hi
        assert rows.loc[name, "overhead_method"] == "t over 2 repeats"
        assert not rows.loc[name, "partial"]
    assert rows.loc["torch-save", "reduction_vs_torch_save"] == pytest.approx(1.0)
    assert math.isnan(rows.loc["torch-save", "reduction_vs_dcp_sync"])  # dcp-sync not run
    floors = comparison.floors
    assert floors.bytes == 2 * MB and floors.copy_s > 0 and floors.write_gbs > 0
    assert rows.loc["torch-save", "stall_vs_copy_floor"] == pytest.approx(
        rows.loc["torch-save", "stall_mean_s"] / floors.copy_s
    )
    assert rows.loc["nbckpt-async", "write_vs_floor_pct"] == pytest.approx(
        rows.loc["nbckpt-async", "write_gbs"] / floors.write_gbs * 100
    )

    timeline = comparison.timeline
    assert list(timeline.columns) == bench.TIMELINE_COLUMNS
    assert set(timeline["strategy"]) == {"none", "torch-save", "nbckpt-async"}
    assert len(timeline) == len(events)
    assert (timeline["label"] == timeline["strategy"]).all()
    stalls = timeline[(timeline["kind"] == "stall") & (timeline["repeat"] == 1)]
    # two checkpoints each (a stall may have two parts: the save, and a wait for the last write)
    assert stalls.groupby("strategy")["step"].unique().map(sorted).to_dict() == {
        "nbckpt-async": [2, 4], "torch-save": [2, 4]}
    # within a repeat the strategies take turns every checkpoint cycle (2 steps), the order
    # rotated by one place per cycle: a burst of other work falls on all of them alike
    steps_seen = [e.label for e in events if e.kind == "step"][:12]
    assert steps_seen == ["none"] * 2 + ["torch-save"] * 2 + ["nbckpt-async"] * 2 + \
        ["torch-save"] * 2 + ["nbckpt-async"] * 2 + ["none"] * 2
    assert comparison.interleave == "cycle"
    # each strategy's timeline runs on its own clock: its steps back to back, from 0
    for name in ("none", "torch-save", "nbckpt-async"):
        own = timeline[(timeline["strategy"] == name) & (timeline["repeat"] == 0)
                       & (timeline["kind"] == "step")].sort_values("start_s")
        gaps = own["start_s"].to_numpy()[1:] - own["end_s"].to_numpy()[:-1]
        assert own["start_s"].min() >= 0 and (gaps < 0.5).all(), name
    assert any("floors for" in line for line in lines)
    # checkpoints of each run are removed; the floor's scratch files too
    assert sorted(os.listdir(tmp_path)) == []

    out = tmp_path / "out.json"
    comparison.to_json(out)
    document = json.loads(out.read_text())
    assert document["schema"] == bench.SCHEMA == "nbckpt.bench/2"
    assert set(document) >= {"workload", "bytes", "device", "directory", "environment", "order",
                             "overhead", "load", "warnings", "floors", "results", "runs", "timeline"}
    assert document["overhead"]["definition"] == bench.OVERHEAD_DEFINITION
    assert list(document["results"][0]) == bench.RESULT_COLUMNS
    assert document["results"][0]["write_gbs"] is None  # NaN becomes null
    for row in document["results"]:
        assert len(row["overhead_ci_pct"]) == 2
    assert {"cpus", "other_cpu_cores", "steal_pct", "loadavg_1m", "floors"} <= set(document["load"])
    table = comparison.table()
    assert "nbckpt-async" in table and bench.OVERHEAD_DEFINITION in table and "load during" in table


def test_run_order_rotates_so_every_strategy_takes_every_place() -> None:
    order = _compare.run_order(["a", "b", "c"], 4)
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    for position in range(3):
        assert sorted(run[position] for run in order[:3]) == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="repeats must be a positive integer"):
        _compare.run_order(["a"], 0)


def test_t_interval_against_a_hand_computed_case() -> None:
    # 10, 12, 14: mean 12, sample sd 2, standard error 2 / sqrt(3) = 1.1547,
    # t(0.975, 2 df) = 4.303: 12 -/+ 4.303 * 1.1547 = 12 -/+ 4.9686
    mean, lo, hi = bench.t_interval([10.0, 12.0, 14.0])
    assert mean == pytest.approx(12.0)
    assert (lo, hi) == pytest.approx((7.0314, 16.9686), abs=1e-4)
    assert _stats.t_quantile(2) == 4.303
    assert _stats.t_quantile(40) == pytest.approx(2.0211, abs=1e-3)  # the expansion beyond the table
    assert _stats.t_quantile(30) == pytest.approx(2.042, abs=1e-3)
    single = bench.t_interval([5.0])
    assert single[0] == 5.0 and math.isnan(single[1]) and math.isnan(single[2])


def fake_run(name: str, repeat: int, loop_s: float, steps: int = 10, stalls: int = 0,
             stall_s: float = 0.0, stopped: bool = False) -> bench.ExperimentResult:
    """A run of ``steps`` equal steps taking ``loop_s`` in all, ``stalls`` save stalls inside."""
    step_s = (loop_s - stalls * stall_s) / steps
    clock, ns = 0, 1e9
    events = []
    for step in range(1, steps + 1):
        events.append(Event("step", clock, clock + round(step_s * ns), step=step, label=name))
        clock += round(step_s * ns)
        if step <= stalls:
            events.append(Event("stall", clock, clock + round(stall_s * ns), step=step, label=name,
                                detail={"part": "save"}))
            clock += round(stall_s * ns)
    return bench.ExperimentResult(
        strategy=name, workload="fake", device="cpu", steps=steps, every=1, bytes=MB,
        timeline=Timeline(label=name), wall_s=loop_s, peak_host_mb=1.0, stopped=stopped,
        events=events, repeat=repeat,
    )


FLOORS = bench.Floors(bytes=MB, copy_s=0.001, copy_gbs=1.0, write_gbs=1.0)


def test_overhead_is_paired_per_repeat_with_a_t_interval() -> None:
    # baselines drift (1.0, 1.1, 0.9 s); the strategy is 10 %, 12 % and 14 % slower than the
    # baseline of its own repeat: mean 12 %, interval 7.03 to 16.97 % (the case above)
    baseline = [fake_run("none", r, loop) for r, loop in enumerate((1.0, 1.1, 0.9))]
    slower = [fake_run("slow", r, base.wall_s * factor, stalls=2, stall_s=0.01)
              for r, (base, factor) in enumerate(zip(baseline, (1.10, 1.12, 1.14), strict=True))]
    results = _comparison.aggregate({"none": baseline, "slow": slower}, FLOORS).set_index("strategy")
    row = results.loc["slow"]
    assert row["overhead_pct"] == pytest.approx(12.0)
    assert row["overhead_ci_pct"] == pytest.approx([7.0314, 16.9686], abs=1e-3)
    assert row["overhead_method"] == "t over 3 repeats"
    # drag: the extra loop time per checkpoint beyond the stall: (0.10 s - 0.02 s) / 2 = 0.04 s
    # in repeat 0, (0.132 - 0.02) / 2 = 0.056 s, (0.126 - 0.02) / 2 = 0.053 s: mean 0.04967 s
    assert row["drag_s"] == pytest.approx((0.04 + 0.056 + 0.053) / 3, abs=1e-6)
    assert bench.overhead_text(row.to_dict() | {"strategy": "slow"}) == "+12.0 %"


def test_a_single_repeat_gets_a_bootstrap_over_steps() -> None:
    point, lo, hi = _stats.bootstrap_overhead([0.11] * 10, [0.10] * 10)
    assert (point, lo, hi) == pytest.approx((10.0, 10.0, 10.0))  # no spread, no width
    noisy = [0.10, 0.12, 0.11, 0.13, 0.09, 0.12, 0.10, 0.11]
    first = _stats.bootstrap_overhead(noisy, [0.10] * 8)
    assert first == _stats.bootstrap_overhead(noisy, [0.10] * 8)  # seeded: the same numbers
    assert first[1] < first[0] < first[2]
    results = _comparison.aggregate(
        {"none": [fake_run("none", 0, 1.0)], "x": [fake_run("x", 0, 1.2)]}, FLOORS
    ).set_index("strategy")
    assert results.loc["x", "overhead_method"] == "bootstrap over steps (1 repeat)"
    assert results.loc["x", "overhead_pct"] == pytest.approx(20.0)


def test_an_interval_with_zero_in_it_is_no_measurable_difference() -> None:
    row = {"strategy": "x", "overhead_pct": 1.5, "overhead_ci_pct": [-2.0, 5.0], "partial": False}
    assert bench.overhead_text(row) == "no measurable difference"
    assert bench.overhead_text({**row, "overhead_ci_pct": [0.5, 2.5]}) == "+1.5 %"
    assert bench.overhead_text({**row, "overhead_pct": -3.0, "overhead_ci_pct": [-4.0, -1.0]}) == "-3.0 %"
    assert bench.overhead_text({**row, "partial": True}) == "partial (left out)"
    assert bench.overhead_text({**row, "strategy": "none"}) == "baseline"
    assert not bench.measurable([math.nan, 1.0]) and bench.measurable([0.1, 1.0])
    assert bench.interval_text([-2.0, 5.0]) == "[-2.0, +5.0] %"
    import pandas as pd

    shown = bench.format_results(pd.DataFrame([row]))
    assert shown.loc[0, "overhead"] == "no measurable difference"
    assert shown.loc[0, "overhead_95ci"] == "[-2.0, +5.0] %"


def test_stopped_runs_make_partial_rows_left_out_of_the_overhead(tmp_path: Any) -> None:
    stop = threading.Event()

    def on_event(event: Event) -> None:
        if event.kind == "stall" and event.label == "torch-save":
            stop.set()

    lines: list[str] = []
    # run by run: the baseline ran to the end before torch-save was stopped
    comparison = bench.compare(small_workload(), ["torch-save"], str(tmp_path), steps=6, every=2,
                            repeats=2, on_event=on_event, stop=stop, progress=lines.append,
                            interleave="run")
    assert any("added the 'none' baseline" in line for line in lines)
    assert comparison.order[0] == ["none", "torch-save"]
    rows = comparison.results.set_index("strategy")
    assert not rows.loc["none", "partial"] and rows.loc["none", "repeats"] == 1
    assert rows.loc["torch-save", "partial"]
    assert math.isnan(rows.loc["torch-save", "overhead_pct"])
    assert list(comparison.runs["stopped"]) == [False, True]  # the second repeat never started
    assert any("stopped before the end: torch-save" in text for text in comparison.warnings)
    assert bench.overhead_text(comparison.results.iloc[1].to_dict()) == "partial (left out)"
    assert "partial (left out)" in comparison.table()
    # taking turns every cycle, a stop leaves every strategy of the repeat partial
    stop.clear()
    cycled = bench.compare(small_workload(), ["torch-save"], str(tmp_path), steps=6, every=2,
                        repeats=2, on_event=on_event, stop=stop, progress=None)
    assert cycled.results["partial"].tolist() == [True, True]
    assert cycled.results["overhead_pct"].isna().tolist() == [False, True]  # none: baseline 0
    assert bench.overhead_text(cycled.results.iloc[0].to_dict()) == "partial (left out)"


def test_the_load_record_counts_other_processes_and_steal(monkeypatch: pytest.MonkeyPatch) -> None:
    times = namedtuple("times", "user nice system idle iowait irq softirq steal guest guest_nice")
    monitor = _load.LoadMonitor()
    zero = times(*([0.0] * 10))
    # 2 s on 2 cores: 4 busy CPU seconds (guest time is inside user), 0.2 stolen, 1.5 ours
    end = times(user=3.0, nice=0.0, system=0.5, idle=0.0, iowait=0.0, irq=0.25, softirq=0.25,
                steal=0.2, guest=0.5, guest_nice=0.0)
    monitor._begin = (10.0, zero, 1.0, 0.5)
    monkeypatch.setattr(monitor, "_snapshot", lambda: (12.0, end, 2.5, 1.5))
    monkeypatch.setattr(_load.psutil, "cpu_count", lambda: 2)
    load = monitor.stop()
    assert load.wall_s == 2.0 and load.own_cpu_s == 1.5 and load.own_cores == 0.75
    assert load.other_cpu_cores == pytest.approx((4.0 - 1.5) / 2.0)  # 1.25 cores
    assert load.steal_pct == pytest.approx(100 * 0.2 / 4.2)
    assert (load.loadavg_1m_start, load.loadavg_1m) == (0.5, 1.5)
    warning = load.warning()
    assert warning is not None and "other processes kept 1.2 of 2 cores busy" in warning
    quiet = bench.Load(cpus=2, wall_s=1.0, own_cpu_s=1.0, other_cpu_cores=0.1, steal_pct=0.0,
                    loadavg_1m_start=1.0, loadavg_1m=1.2)
    assert quiet.warning() is None and quiet.to_dict()["high"] is False
    stolen = bench.Load(cpus=2, wall_s=1.0, own_cpu_s=1.0, other_cpu_cores=0.0, steal_pct=12.0,
                     loadavg_1m_start=0.0, loadavg_1m=0.0)
    assert "stole 12 %" in (stolen.warning() or "")


def test_a_user_strategy_instance_can_be_compared(tmp_path: Any) -> None:
    class Recording(bench.Strategy):
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
    comparison = bench.compare(small_workload(), [mine], str(tmp_path), steps=4, every=2,
                            repeats=2, progress=None, baseline=False)
    assert mine.opened == 2 and mine.steps == [0, 2, 4, 0, 2, 4]  # warm-up save is step 0
    assert comparison.results["checkpoints"].tolist() == [2]
    assert math.isnan(comparison.results["overhead_pct"].iloc[0])  # no "none" baseline
    assert comparison.results["overhead_method"].iloc[0] == "no baseline"


def test_floors_measure_like_the_probe_and_leave_nothing_behind(tmp_path: Any) -> None:
    floors = bench.measure_floors(3 * MB, str(tmp_path))
    assert floors.sample_bytes == floors.bytes == 3 * MB
    assert floors.copy_gbs == pytest.approx(3 * MB / floors.copy_s / 1e9)
    assert floors.write_s > 0
    assert set(floors.write_gbs_by_streams) == {"1", "2"}
    assert floors.write_gbs == max(floors.write_gbs_by_streams.values())
    assert floors.write_streams in (1, 2) and len(floors.write_gbs_rounds) == floors.repeats == 2
    assert max(floors.write_gbs_rounds) == pytest.approx(floors.write_gbs)
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
        bench.compare(workload, directory=str(tmp_path / "never"), progress=None, **args)
    assert not (tmp_path / "never").exists()
    assert not workload.built
