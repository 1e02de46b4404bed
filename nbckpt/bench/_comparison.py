"""What a comparison returns: :class:`Comparison`, its tables, and the JSON ``nbckpt bench`` writes.

Metrics (``Comparison.results`` columns, :data:`RESULT_COLUMNS`):

- ``repeats``: runs pooled into the row; ``partial``: every run of it was stopped.
- ``steps`` / ``checkpoints``: per run.
- ``mean_step_s``: loop time divided by steps (stalls included), over the pooled runs.
- ``overhead_pct``, ``overhead_ci_pct`` (``[lo, hi]``), ``overhead_method``: the mean over
  repeats of ``100 * (loop time / loop time of that repeat's none run - 1)`` and its 95 %
  interval (:data:`nbckpt.bench.OVERHEAD_DEFINITION`).
- ``stall_mean_s`` / ``stall_p95_s``: per checkpoint, the time the loop was blocked
  (``save`` plus, for overlapped saves, the wait before the next update).
- ``drag_s``: per checkpoint, loop time lost beyond the stall (background work slowing the
  steps), from the paired loop times; around 0 (either sign) is noise.
- ``cpu_per_checkpoint_s``: CPU seconds this process (and its children) spent per checkpoint
  beyond the baseline's, from the first step until the last checkpoint is durable: on a machine
  whose cores all train, they are taken from training.
- ``persist_s`` / ``write_gbs``: per checkpoint, time to write the data durably and its rate.
- ``peak_host_mb``: RSS before any strategy opened, plus what opening this one and its
  warm-up save left resident, plus the most RSS rose during its turns (sampled every 10 ms):
  its peak as if it had run alone. ``peak_device_mb`` (CUDA): the peak during its turns, MiB.
- ``reduction_vs_torch_save`` / ``reduction_vs_dcp_sync``: that strategy's stall over this one's.
- ``stall_vs_copy_floor``: stall over the copy floor; ``write_vs_floor_pct``: write rate as a
  percentage of the raw write floor.

:meth:`Comparison.to_json` writes this schema (``"schema": "nbckpt.bench/2"``; missing numbers
are ``null``)::

    {
      "schema": "nbckpt.bench/2",
      "workload": "gpt-tiny: 1.1M parameters, checkpoint 12.8 MB ...",
      "bytes": 12764368,                   # checkpoint size, bytes
      "device": "cpu", "directory": "/abs/path", "steps": 20, "every": 5, "repeats": 3,
      "order": [["none", "torch-save", ...], ["torch-save", ..., "none"], ...],  # per repeat
      "interleave": "cycle",               # or "run" (see compare)
      "overhead": {"definition": "...", "confidence": 0.95, "baseline": "none"},
      "environment": {"python": ..., "torch": ..., "nbckpt": ..., "platform": ..., "cpus": ...,
                      "torch_threads": ..., "device_name": ..., "time_utc": ...},
      "load": {"cpus": ..., "wall_s": ..., "other_cpu_cores": ..., "steal_pct": ...,
               "loadavg_1m_start": ..., "loadavg_1m": ..., "own_cpu_s": ..., "high": false,
               "floors": {<the same, during the floor measurement>}},
      "warnings": ["..."],                 # e.g. high load, a single repeat, stopped runs
      "floors": {"bytes": ..., "sample_bytes": ..., "copy_s": ..., "copy_gbs": ...,
                 "write_s": ..., "write_gbs": ..., "write_streams": ...,
                 "write_gbs_by_streams": {"1": ..., "2": ...}, "write_gbs_rounds": [...],
                 "repeats": ...},
      "results": [{"strategy": ..., <the RESULT_COLUMNS above>}, ...],
      "runs": [{"strategy": ..., "repeat": 0, "position": 0, <that run's metrics>, "wall_s": ...,
                "cpu_s": ..., "other_cpu_cores": ..., "steal_pct": ..., "loadavg_1m": ...,
                "stopped": false}, ...],   # one per strategy and repeat, in the order run
      "timeline": [{"strategy": ..., "repeat": ..., "kind": ..., "label": ..., "step": ...,
                    "rank": ..., "start_s": ..., "end_s": ..., "duration_s": ..., "bytes": ...,
                    "thread": ..., "pid": ..., "start_ns": ..., "end_ns": ...}, ...]
    }

Times are seconds, rates GB/s (1e9 bytes), memory MiB; ``start_s`` counts from the start
of that run (after its warm-up save). Version 1 had neither intervals nor load, and counted
``steps`` and ``checkpoints`` over all repeats together.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ._floors import Floors
from ._load import Load
from ._result import ExperimentResult, pooled_metrics
from ._stats import (
    CONFIDENCE,
    OVERHEAD_DEFINITION,
    bootstrap_overhead,
    interval_text,
    overhead_text,
    t_interval,
)

__all__ = [
    "RESULT_COLUMNS",
    "SCHEMA",
    "TIMELINE_COLUMNS",
    "Comparison",
    "aggregate",
    "format_results",
]

SCHEMA = "nbckpt.bench/2"
RESULT_COLUMNS = [
    "strategy", "repeats", "partial", "steps", "checkpoints", "mean_step_s", "overhead_pct",
    "overhead_ci_pct", "overhead_method", "stall_mean_s", "stall_p95_s", "drag_s",
    "cpu_per_checkpoint_s", "persist_s", "write_gbs", "peak_host_mb", "peak_device_mb",
    "reduction_vs_torch_save", "reduction_vs_dcp_sync", "stall_vs_copy_floor",
    "write_vs_floor_pct",
]
TIMELINE_COLUMNS = [
    "strategy", "repeat", "kind", "label", "step", "rank", "start_s", "end_s", "duration_s",
    "bytes", "thread", "pid", "start_ns", "end_ns",
]


def _paired(name: str, pairs: list[tuple[ExperimentResult, ExperimentResult]]) -> dict[str, Any]:
    """Overhead, its interval, drag and CPU per checkpoint from (run, baseline run) pairs."""
    nan = math.nan
    if name == "none":
        return {"overhead_pct": 0.0, "overhead_ci_pct": [0.0, 0.0], "overhead_method": "baseline",
                "drag_s": nan, "cpu_per_checkpoint_s": nan}
    if not pairs:
        return {"overhead_pct": nan, "overhead_ci_pct": [nan, nan],
                "overhead_method": "no baseline", "drag_s": nan, "cpu_per_checkpoint_s": nan}
    if len(pairs) >= 2:
        values = [100.0 * (run.mean_step_s / base.mean_step_s - 1.0) for run, base in pairs]
        point, lo, hi = t_interval(values)
        method = f"t over {len(pairs)} repeats"
    else:
        run, base = pairs[0]
        point, lo, hi = bootstrap_overhead(run.step_costs(), base.step_costs())
        method = "bootstrap over steps (1 repeat)"
    drags, cpus = [], []
    for run, base in pairs:
        checkpoints = run.checkpoints
        if not checkpoints:
            continue
        stall_total = sum(run.durations("stall").values())
        extra = (run.mean_step_s - base.mean_step_s) * run.steps_run
        drags.append((extra - stall_total) / checkpoints)
        if run.load is not None and base.load is not None:
            cpus.append((run.load.own_cpu_s - base.load.own_cpu_s) / checkpoints)
    return {
        "overhead_pct": point,
        "overhead_ci_pct": [lo, hi],
        "overhead_method": method,
        "drag_s": float(np.mean(drags)) if drags else nan,
        "cpu_per_checkpoint_s": float(np.mean(cpus)) if cpus else nan,
    }


def aggregate(results: dict[str, list[ExperimentResult]], floors: Floors) -> pd.DataFrame:
    """The results table: one row per strategy, its runs paired with the baseline's by repeat."""
    baseline = {run.repeat: run for run in results.get("none", []) if not run.stopped}
    rows = []
    for name, runs in results.items():
        if not runs:
            continue
        complete = [run for run in runs if not run.stopped]
        used = complete or runs
        pairs = [(run, baseline[run.repeat]) for run in complete if run.repeat in baseline]
        rows.append({"strategy": name, "repeats": len(used), "partial": not complete,
                     **pooled_metrics(used), **_paired(name, pairs)})
    frame = pd.DataFrame(rows)
    by_name = {str(row["strategy"]): row for row in rows if not row["partial"]}

    def stall_of(name: str) -> float:
        row = by_name.get(name)
        return float(row["stall_mean_s"]) if row is not None else math.nan

    for column, reference in (("reduction_vs_torch_save", "torch-save"),
                              ("reduction_vs_dcp_sync", "dcp-sync")):
        theirs = stall_of(reference)
        frame[column] = [theirs / stall if stall > 0 else math.nan for stall in frame["stall_mean_s"]]
    frame["stall_vs_copy_floor"] = [
        stall / floors.copy_s if stall > 0 else math.nan for stall in frame["stall_mean_s"]
    ]
    frame["write_vs_floor_pct"] = frame["write_gbs"] / floors.write_gbs * 100
    return frame[RESULT_COLUMNS]


_FORMATS = {
    "mean_step_s": "{:.4f}", "stall_mean_s": "{:.4f}", "stall_p95_s": "{:.4f}",
    "drag_s": "{:+.4f}", "persist_s": "{:.3f}", "write_gbs": "{:.2f}", "peak_host_mb": "{:.0f}",
    "peak_device_mb": "{:.0f}", "reduction_vs_torch_save": "{:.1f}x",
    "reduction_vs_dcp_sync": "{:.1f}x", "write_vs_floor_pct": "{:.0f} %",
}


def format_results(results: pd.DataFrame, device: str = "cpu") -> pd.DataFrame:
    """``Comparison.results`` as the text every nbckpt table shows: the overhead in words
    (:func:`nbckpt.bench.overhead_text`) beside its interval, numbers rounded, ``-`` where not
    measured."""
    rows = []
    for row in results.to_dict(orient="records"):
        shown: dict[str, Any] = {
            "strategy": row["strategy"],
            "repeats": row.get("repeats", "-"),
            "checkpoints": row.get("checkpoints", "-"),
            "overhead": overhead_text(row),
            "overhead_95ci": "-" if row.get("partial") else interval_text(row.get("overhead_ci_pct")),
        }
        for column, fmt in _FORMATS.items():
            if column == "peak_device_mb" and device != "cuda":
                continue
            value = row.get(column)
            finite = value is not None and isinstance(value, (int, float)) and math.isfinite(value)
            shown[column] = fmt.format(value) if finite else "-"
        rows.append(shown)
    frame = pd.DataFrame(rows)
    # A column nothing was measured for (no dcp-sync run, say) only widens the table.
    empty = [c for c in frame.columns if c in _FORMATS and (frame[c] == "-").all()]
    return frame.drop(columns=empty)


def _json_value(value: Any) -> Any:
    """NaN and infinities become null; numpy scalars become Python numbers; sequences recurse."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_json_value(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_value(item) for key, item in value.items()}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [
        {str(key): _json_value(value) for key, value in row.items()}
        for row in frame.to_dict(orient="records")
    ]


@dataclass
class Comparison:
    """Several strategies measured on the same workload, directory and machine."""

    results: pd.DataFrame
    runs: pd.DataFrame
    timeline: pd.DataFrame
    floors: Floors
    workload: str
    device: str
    directory: str
    environment: dict[str, Any]
    steps: int = 0
    every: int = 0
    repeats: int = 1
    bytes: int = 0
    order: list[list[str]] = field(default_factory=list)
    interleave: str = "cycle"
    """``cycle``: strategies alternated every checkpoint cycle; ``run``: run by run."""
    load: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document described in this module's docstring."""
        return {
            "schema": SCHEMA,
            "workload": self.workload,
            "bytes": self.bytes,
            "device": self.device,
            "directory": self.directory,
            "steps": self.steps,
            "every": self.every,
            "repeats": self.repeats,
            "order": self.order,
            "interleave": self.interleave,
            "overhead": {"definition": OVERHEAD_DEFINITION, "confidence": CONFIDENCE,
                         "baseline": "none"},
            "environment": self.environment,
            "load": _json_value(self.load),
            "warnings": list(self.warnings),
            "floors": _json_value(self.floors.to_dict()),
            "results": _records(self.results),
            "runs": _records(self.runs),
            "timeline": _records(self.timeline),
        }

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` to ``path`` atomically (temporary file, then rename)."""
        path = os.fspath(path)
        temporary = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(temporary, "w") as stream:
                json.dump(self.to_dict(), stream, indent=1, allow_nan=False)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)

    def table(self) -> str:
        """A readable table of the results; the overhead definition, floors and load under it."""
        lines = [
            f"{self.workload}",
            f"{self.steps} steps, checkpoint every {self.every}, {self.repeats} repeat(s), the "
            f"strategies interleaved "
            f"{'every checkpoint cycle' if self.interleave == 'cycle' else 'run by run'}, device "
            f"{self.device}, directory {self.directory}",
            format_results(self.results, self.device).to_string(index=False),
            OVERHEAD_DEFINITION,
            self.floors.describe(),
        ]
        if self.load:
            fields = {key: value for key, value in self.load.items() if key in Load.__dataclass_fields__}
            lines.append(f"load during the runs: {Load(**fields).describe()}")
        lines.extend(f"warning: {text}" for text in self.warnings)
        return "\n".join(lines)
