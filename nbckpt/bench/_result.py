"""What runs measured: one strategy's run (:class:`ExperimentResult`), and the results table.

Metrics that need no other run (steps, stalls, persist time, write rate, peak memory) are
pooled over one or more runs of a strategy (:func:`pooled_metrics`); :func:`aggregate` pairs
each strategy's runs with the baseline's, cycle by cycle, into the overhead, drag and floor
checks of :data:`RESULT_COLUMNS` (the method is :mod:`._stats`'s; the columns are described in
:mod:`._comparison`).

Three numbers describe what a checkpoint cost the loop directly, and each has one name
(:data:`STALL_NAMES`): the **save stall** (``save()`` itself, and with ``overlap=True`` the
wait for its own copy before the next update), the **wait for the earlier save** (the loop
waited for the previous checkpoint's write before this save could start: backpressure), and
the **stall**, their sum: all the time the loop was blocked for that checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .._util import GB
from ..engine import Event, Timeline
from ._load import Load
from ._measure import Floors
from ._stats import Clustered, clustered_mean

__all__ = [
    "RESULT_COLUMNS",
    "STALL_DEFINITION",
    "STALL_NAMES",
    "Cycle",
    "ExperimentResult",
    "aggregate",
    "cycle_pairs",
    "floor_check",
    "pooled_metrics",
]

RESULT_COLUMNS = [
    "strategy",
    "repeats",
    "partial",
    "steps",
    "checkpoints",
    "mean_step_s",
    "overhead_pct",
    "overhead_ci_pct",
    "overhead_by_repeat_pct",
    "overhead_basis",
    "overhead_method",
    "stall_mean_s",
    "stall_p95_s",
    "save_stall_s",
    "wait_s",
    "drag_s",
    "drag_ci_s",
    "cpu_per_checkpoint_s",
    "persist_s",
    "written_mb",
    "write_gbs",
    "peak_host_mb",
    "peak_device_mb",
    "reduction_vs_torch_save",
    "reduction_vs_dcp_sync",
    "stall_vs_copy_floor",
    "write_vs_floor_pct",
    "floor_check",
]

#: The label of each of the three numbers, used by every table, log line and figure.
STALL_NAMES = {
    "stall_mean_s": "stall",
    "save_stall_s": "save stall",
    "wait_s": "wait for the earlier save",
}
#: The three numbers in one line, printed under every table that shows them.
STALL_DEFINITION = (
    "Per checkpoint: save stall = the time save() blocked the loop (with overlap=True, plus the wait "
    "for its own copy before the next update); wait for the earlier save = the time the loop waited "
    "for the previous checkpoint's write first; stall = the two together, all the time the loop "
    "was blocked (the wait for the last write at the end of a run counts in the overhead, not "
    "here). Drag = loop time lost beyond the stall, against the baseline's same cycle."
)


@dataclass(frozen=True)
class Cycle:
    """One checkpoint cycle of a run, as the runner timed it: the checkpoint due at its start
    (if any), its training steps, and (strategies taking turns) the wait for that checkpoint's
    write before the next strategy's turn."""

    steps: int
    loop_s: float
    """Loop time of the cycle: what overhead compares with the baseline's same cycle."""
    stall_s: float
    """Time the loop was blocked by checkpointing within the cycle (save stalls and waits)."""
    checkpoints: int
    """Checkpoints saved in the cycle (0 or 1)."""


@dataclass
class ExperimentResult:
    """One strategy's run: its events and the metrics derived from them."""

    strategy: str
    bytes: int
    timeline: Timeline
    """Events of the measured run (warm-up excluded); ``origin_ns`` is the run's start."""
    wall_s: float
    """The training loop's time (the loop time overhead compares)."""
    peak_host_mb: float
    peak_device_mb: float = math.nan
    stopped: bool = False
    events: list[Event] = field(default_factory=list)
    load: Load | None = None
    repeat: int = 0
    engine_cpu_s: float = math.nan
    """CPU seconds the strategy's own threads reported for its saves (NaN: not reported)."""
    cycles: list[Cycle] = field(default_factory=list)
    """Every cycle the run completed, in order (a cycle cut short by a stop is left out)."""
    stall_covers_copy: bool = True
    """The strategy's save stall includes copying every byte once (see :class:`Strategy`)."""

    def durations(self, kind: str) -> dict[int, float]:
        """Total duration of ``kind`` events per checkpoint step."""
        totals: dict[int, float] = {}
        for event in self.events:
            if event.kind == kind and event.step is not None:
                totals[event.step] = totals.get(event.step, 0.0) + event.duration_s
        return totals

    @property
    def steps_run(self) -> int:
        return sum(1 for e in self.events if e.kind == "step")

    @property
    def checkpoints(self) -> int:
        return len(self.stall_parts())

    def stall_parts(self) -> dict[int, tuple[float, float]]:
        """``{step: (save stall, wait for the earlier save)}`` of every checkpoint saved.

        The runner times each save (``part="save"``, plus ``"before_step"`` for overlapped
        copies) and, strategies taking turns, the wait before the next one (``"wait"``). A
        strategy's own ``wait`` events inside a save's stall (backpressure in ``save()``) are
        moved from the save stall to the wait, so the two always add up to the stall. The wait
        for the last write at the end of a run (``"final"``) is no checkpoint's: it counts in
        the loop time (and overhead), not here.
        """
        saves: dict[int, float] = {}
        waits: dict[int, float] = {}
        windows: list[tuple[int, int, int]] = []
        for event in self.events:
            if event.kind != "stall" or event.step is None or event.detail.get("part") == "final":
                continue  # the wait for the last write at the end belongs to no next save
            if event.detail.get("part") == "wait":
                waits[event.step] = waits.get(event.step, 0.0) + event.duration_s
                continue
            saves[event.step] = saves.get(event.step, 0.0) + event.duration_s
            if event.detail.get("part", "save") == "save":
                windows.append((event.start_ns, event.end_ns, event.step))
        for event in self.events:
            if event.kind != "wait":
                continue
            for start, end, step in windows:
                if start <= event.start_ns and event.end_ns <= end:
                    moved = min(event.duration_s, saves[step])
                    saves[step] -= moved
                    waits[step] = waits.get(step, 0.0) + moved
                    break
        return {step: (saves[step], waits.get(step, 0.0)) for step in sorted(saves)}

    def metrics(self) -> dict[str, Any]:
        """Metrics of this run (the comparison adds those relative to other runs)."""
        load = self.load
        return {
            "strategy": self.strategy,
            **pooled_metrics([self]),
            "wall_s": self.wall_s,
            "bytes": self.bytes,
            "cpu_s": load.own_cpu_s if load else math.nan,
            "other_cpu_cores": load.other_cpu_cores if load else math.nan,
            "steal_pct": load.steal_pct if load else math.nan,
            "loadavg_1m": load.loadavg_1m if load else math.nan,
            "engine_cpu_s": self.engine_cpu_s,
            "cycle_loop_s": [cycle.loop_s for cycle in self.cycles],
            "stopped": self.stopped,
        }

    def timeline_frame(self) -> pd.DataFrame:
        """One row per event; ``written``: a ``persist``'s bytes put in new files (NaN where the
        strategy does not count them, and for the other kinds)."""
        frame = self.timeline.to_pandas()  # the run is over: its events no longer change
        frame["written"] = [float(e.detail.get("written", math.nan)) for e in self.timeline.events]
        return frame


def pooled_metrics(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Metrics over the checkpoints of one or more runs of the same strategy."""
    runs = max(len(results), 1)
    step_total = sum(r.steps_run for r in results)
    parts = [part for r in results for part in r.stall_parts().values()]
    stalls = [save + wait for save, wait in parts]
    persists = [p for r in results for p in r.durations("persist").values()]
    persist_bytes = sum(e.bytes for r in results for e in r.events if e.kind == "persist")
    # Bytes put in new files, where the strategy counts them (an incremental save skips some).
    written = [
        e.detail["written"]
        for r in results
        for e in r.events
        if e.kind == "persist" and "written" in e.detail
    ]
    wall_s = sum(r.wall_s for r in results)
    return {
        "steps": round(step_total / runs),
        "checkpoints": round(len(parts) / runs),
        "mean_step_s": wall_s / step_total if step_total else math.nan,
        "stall_mean_s": float(np.mean(stalls)) if stalls else 0.0,
        "stall_p95_s": float(np.percentile(stalls, 95)) if stalls else 0.0,
        "save_stall_s": float(np.mean([save for save, _ in parts])) if parts else 0.0,
        "wait_s": float(np.mean([wait for _, wait in parts])) if parts else 0.0,
        "persist_s": float(np.mean(persists)) if persists else math.nan,
        "written_mb": float(np.mean(written)) / 1e6 if written else math.nan,  # decimal, as GB/s
        "write_gbs": persist_bytes / sum(persists) / GB if sum(persists) > 0 else math.nan,
        "peak_host_mb": max(r.peak_host_mb for r in results),
        "peak_device_mb": max(r.peak_device_mb for r in results),
    }


def cycle_pairs(run: ExperimentResult, base: ExperimentResult) -> list[tuple[Cycle, Cycle]]:
    """The cycles ``run`` and its baseline ``base`` both completed, paired; the final cycle (the
    last checkpoint, no steps) joined with the first (no checkpoint), so no baseline cycle is
    empty (:mod:`._stats`)."""
    pairs = list(zip(run.cycles, base.cycles, strict=False))  # a stop leaves a shorter prefix
    if len(pairs) >= 2 and pairs[-1][0].steps == 0 and pairs[-1][1].steps == 0:
        (ours, theirs), (our_last, their_last) = pairs[0], pairs[-1]
        pairs = [(_joined(ours, our_last), _joined(theirs, their_last)), *pairs[1:-1]]
    return pairs


def _joined(first: Cycle, second: Cycle) -> Cycle:
    return Cycle(
        steps=first.steps + second.steps,
        loop_s=first.loop_s + second.loop_s,
        stall_s=first.stall_s + second.stall_s,
        checkpoints=first.checkpoints + second.checkpoints,
    )


def _percent(log_ratio: float) -> float:
    return 100.0 * math.expm1(log_ratio) if math.isfinite(log_ratio) else math.nan


def _basis(estimate: Clustered, stopped: bool) -> str:
    """What a row rests on: ``3 repeats, 12 cycles``, ``1 repeat, 4 cycles (widened)``."""
    if estimate.cycles == 0:
        return "no cycle pairs"
    text = (
        f"{estimate.repeats} repeat{'s' if estimate.repeats != 1 else ''}, "
        f"{estimate.cycles} cycle{'s' if estimate.cycles != 1 else ''}"
    )
    if estimate.basis == "one repeat":
        text += " (widened)"
    return text + (", stopped" if stopped else "")


def _paired(name: str, pairs: list[tuple[ExperimentResult, ExperimentResult]]) -> dict[str, Any]:
    """Overhead, drag (each with its interval) and CPU per checkpoint from (run, baseline run)
    pairs, one pair per repeat, their cycles paired (:mod:`._stats`)."""
    nan = math.nan
    unmeasured = {
        "overhead_pct": nan,
        "overhead_ci_pct": [nan, nan],
        "overhead_by_repeat_pct": [],
        "drag_s": nan,
        "drag_ci_s": [nan, nan],
        "cpu_per_checkpoint_s": nan,
    }
    if name == "none":
        return {
            **unmeasured,
            "overhead_pct": 0.0,
            "overhead_ci_pct": [0.0, 0.0],
            "overhead_basis": "baseline",
            "overhead_method": "baseline",
        }
    ratios: list[list[float]] = []
    drags: list[list[float]] = []
    cpus: list[float] = []
    for run, base in pairs:
        cycles = cycle_pairs(run, base)
        ratios.append(
            [
                math.log(ours.loop_s / theirs.loop_s)
                for ours, theirs in cycles
                if ours.loop_s > 0 and theirs.loop_s > 0
            ]
        )
        drags.append(
            [
                (ours.loop_s - theirs.loop_s - ours.stall_s) / ours.checkpoints
                for ours, theirs in cycles
                if ours.checkpoints
            ]
        )
        if run.checkpoints and run.load is not None and base.load is not None and not run.stopped:
            cpus.append((run.load.own_cpu_s - base.load.own_cpu_s) / run.checkpoints)
    overhead = clustered_mean(ratios, log_ratios=True)
    drag = clustered_mean(drags, one_repeat_spread=0.0)  # seconds: the cycles' own spread
    if overhead.cycles == 0:
        method = "no baseline" if not pairs else "no cycle pairs"
        return {**unmeasured, "overhead_basis": method, "overhead_method": method}
    stopped = any(run.stopped or base.stopped for run, base in pairs)
    return {
        "overhead_pct": _percent(overhead.mean),
        "overhead_ci_pct": [_percent(overhead.lo), _percent(overhead.hi)],
        "overhead_by_repeat_pct": [_percent(m) for m in overhead.repeat_means],
        "overhead_basis": _basis(overhead, stopped),
        "overhead_method": overhead.method,
        "drag_s": drag.mean,
        "drag_ci_s": [drag.lo, drag.hi],
        "cpu_per_checkpoint_s": float(np.mean(cpus)) if cpus else nan,
    }


def floor_check(row: dict[str, Any], floors: Floors, *, covers_copy: bool) -> str:
    """What in a row is faster than the hardware allows, which is a measurement problem (the
    floor and the run saw different moments of a shared machine, or a cache), or ``""``."""
    problems = []
    save = float(row.get("save_stall_s", math.nan))
    if covers_copy and int(row.get("checkpoints", 0)) > 0 and 0 < save < floors.copy_s:
        problems.append(f"save stall {save / floors.copy_s:.2f}x the copy floor")
    write = float(row.get("write_gbs", math.nan))
    if math.isfinite(write) and floors.write_gbs > 0 and write > floors.write_gbs:
        problems.append(f"write rate {100 * write / floors.write_gbs:.0f} % of the write floor")
    if not problems:
        return ""
    return "below the floor, a measurement problem: " + "; ".join(problems)


def aggregate(results: dict[str, list[ExperimentResult]], floors: Floors) -> pd.DataFrame:
    """The results table: one row per strategy, its runs paired with the baseline's by repeat
    and their cycles paired (:mod:`._stats`)."""
    baseline = {run.repeat: run for run in results.get("none", [])}
    rows = []
    for name, runs in results.items():
        if not runs:
            continue
        complete = [run for run in runs if not run.stopped]
        used = complete or runs
        pairs = [(run, baseline[run.repeat]) for run in runs if run.repeat in baseline]
        row = {
            "strategy": name,
            "repeats": len(used),
            "partial": not complete,
            **pooled_metrics(used),
            **_paired(name, pairs),
        }
        row["stall_vs_copy_floor"] = (
            row["save_stall_s"] / floors.copy_s if row["save_stall_s"] > 0 and floors.copy_s > 0 else math.nan
        )
        row["write_vs_floor_pct"] = row["write_gbs"] / floors.write_gbs * 100
        row["floor_check"] = floor_check(row, floors, covers_copy=runs[0].stall_covers_copy)
        rows.append(row)
    frame = pd.DataFrame(rows)
    by_name = {str(row["strategy"]): row for row in rows if not row["partial"]}

    def stall_of(name: str) -> float:
        row = by_name.get(name)
        return float(row["stall_mean_s"]) if row is not None else math.nan

    for column, reference in (
        ("reduction_vs_torch_save", "torch-save"),
        ("reduction_vs_dcp_sync", "dcp-sync"),
    ):
        theirs = stall_of(reference)
        frame[column] = [theirs / stall if stall > 0 else math.nan for stall in frame["stall_mean_s"]]
    return frame[RESULT_COLUMNS]
