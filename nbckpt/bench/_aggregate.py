"""The results table of a comparison: each strategy's runs paired with the baseline's, cycle by
cycle, into the overhead, drag and floor checks of :data:`RESULT_COLUMNS` (the method is
:mod:`._stats`'s; the columns are described in :mod:`._comparison`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ._measure import Floors
from ._result import Cycle, ExperimentResult, pooled_metrics
from ._stats import Clustered, clustered_mean

__all__ = ["RESULT_COLUMNS", "aggregate", "cycle_pairs", "floor_check"]

RESULT_COLUMNS = [
    "strategy", "repeats", "partial", "steps", "checkpoints", "mean_step_s", "overhead_pct",
    "overhead_ci_pct", "overhead_by_repeat_pct", "overhead_basis", "overhead_method",
    "stall_mean_s", "stall_p95_s", "save_stall_s", "wait_s", "drag_s", "drag_ci_s",
    "cpu_per_checkpoint_s", "persist_s", "write_gbs", "peak_host_mb", "peak_device_mb",
    "reduction_vs_torch_save", "reduction_vs_dcp_sync", "stall_vs_copy_floor",
    "write_vs_floor_pct", "floor_check",
]


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
    return Cycle(steps=first.steps + second.steps, loop_s=first.loop_s + second.loop_s,
                 stall_s=first.stall_s + second.stall_s,
                 checkpoints=first.checkpoints + second.checkpoints)


def _percent(log_ratio: float) -> float:
    return 100.0 * math.expm1(log_ratio) if math.isfinite(log_ratio) else math.nan


def _basis(estimate: Clustered, stopped: bool) -> str:
    """What a row rests on: ``3 repeats, 12 cycles``, ``1 repeat, 4 cycles (widened)``."""
    if estimate.cycles == 0:
        return "no cycle pairs"
    text = (f"{estimate.repeats} repeat{'s' if estimate.repeats != 1 else ''}, "
            f"{estimate.cycles} cycle{'s' if estimate.cycles != 1 else ''}")
    if estimate.basis == "one repeat":
        text += " (widened)"
    return text + (", stopped" if stopped else "")


def _paired(name: str, pairs: list[tuple[ExperimentResult, ExperimentResult]]) -> dict[str, Any]:
    """Overhead, drag (each with its interval) and CPU per checkpoint from (run, baseline run)
    pairs, one pair per repeat, their cycles paired (:mod:`._stats`)."""
    nan = math.nan
    unmeasured = {"overhead_pct": nan, "overhead_ci_pct": [nan, nan], "overhead_by_repeat_pct": [],
                  "drag_s": nan, "drag_ci_s": [nan, nan], "cpu_per_checkpoint_s": nan}
    if name == "none":
        return {**unmeasured, "overhead_pct": 0.0, "overhead_ci_pct": [0.0, 0.0],
                "overhead_basis": "baseline", "overhead_method": "baseline"}
    ratios: list[list[float]] = []
    drags: list[list[float]] = []
    cpus: list[float] = []
    for run, base in pairs:
        cycles = cycle_pairs(run, base)
        ratios.append([math.log(ours.loop_s / theirs.loop_s) for ours, theirs in cycles
                       if ours.loop_s > 0 and theirs.loop_s > 0])
        drags.append([(ours.loop_s - theirs.loop_s - ours.stall_s) / ours.checkpoints
                      for ours, theirs in cycles if ours.checkpoints])
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
        row = {"strategy": name, "repeats": len(used), "partial": not complete,
               **pooled_metrics(used), **_paired(name, pairs)}
        row["stall_vs_copy_floor"] = (row["save_stall_s"] / floors.copy_s
                                      if row["save_stall_s"] > 0 and floors.copy_s > 0 else math.nan)
        row["write_vs_floor_pct"] = row["write_gbs"] / floors.write_gbs * 100
        row["floor_check"] = floor_check(row, floors, covers_copy=runs[0].stall_covers_copy)
        rows.append(row)
    frame = pd.DataFrame(rows)
    by_name = {str(row["strategy"]): row for row in rows if not row["partial"]}

    def stall_of(name: str) -> float:
        row = by_name.get(name)
        return float(row["stall_mean_s"]) if row is not None else math.nan

    for column, reference in (("reduction_vs_torch_save", "torch-save"),
                              ("reduction_vs_dcp_sync", "dcp-sync")):
        theirs = stall_of(reference)
        frame[column] = [theirs / stall if stall > 0 else math.nan for stall in frame["stall_mean_s"]]
    return frame[RESULT_COLUMNS]
