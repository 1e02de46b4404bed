"""What a comparison returns: :class:`Comparison`, its tables, and the JSON ``nbckpt bench`` writes.

Metrics (``Comparison.results`` columns, :data:`RESULT_COLUMNS`), per run or per checkpoint:

- ``repeats``: runs pooled into the row; ``partial``: every run of it was stopped.
- ``steps``, ``checkpoints`` (per run); ``mean_step_s``: loop time over steps, stalls included.
- ``overhead_pct``, ``overhead_ci_pct`` (``[lo, hi]``), ``overhead_by_repeat_pct``,
  ``overhead_basis`` (what it rests on: ``3 repeats, 12 cycles``), ``overhead_method``: against
  the ``none`` baseline as :data:`nbckpt.bench.OVERHEAD_METHOD` states; ``drag_s``, ``drag_ci_s``:
  loop time lost beyond the stall per checkpoint (:func:`nbckpt.bench.drag_text`).
- ``stall_mean_s`` / ``stall_p95_s``: the **stall**, the sum of the **save stall**
  (``save_stall_s``) and the **wait for the earlier save** (``wait_s``), as
  :data:`nbckpt.bench.STALL_DEFINITION` states.
- ``cpu_per_checkpoint_s``: CPU seconds this process (and its children) spent per checkpoint
  beyond the baseline's: on a machine whose cores all train, taken from training.
- ``persist_s`` / ``write_gbs``: time to write the data durably, and its rate.
- ``written_mb``: MB (10^6 bytes) each checkpoint put in new files: nbckpt's own count
  (``SaveRecord.bytes_written``, this rank's; less than the state with ``incremental=True``), the
  step's files for torch-save and DCP (every rank's under DCP on many ranks); each ``persist``
  event of the timeline carries its bytes as ``written``.
- ``peak_host_mb``: RSS before any strategy opened, plus what opening this one and its warm-up
  save left resident, plus the most RSS rose during its turns: its peak as if it ran alone.
  ``peak_device_mb`` (CUDA): the peak during its turns.
- ``reduction_vs_torch_save`` / ``reduction_vs_dcp_sync``: that strategy's stall over this one's.
- ``stall_vs_copy_floor``, ``write_vs_floor_pct``: against the floors; ``floor_check``: what is
  faster than a floor (a measurement problem), or empty.

:meth:`Comparison.to_json` writes this schema (missing numbers are ``null``);
:meth:`Comparison.from_json` reads it back::

    {
      "schema": "nbckpt.bench/3",
      "workload": "gpt-tiny: 1.1M parameters, checkpoint 12.8 MB ...",
      "bytes": 12764368,                   # checkpoint size, bytes
      "device": "cpu", "directory": "/abs/path", "steps": 20, "every": 5, "repeats": 3,
      "order": [["none", "torch-save", ...], ["torch-save", ..., "none"], ...],  # per repeat
      "interleave": "cycle",               # or "run": whole runs, when buffers would not fit
      "overhead": {"definition": "...", "method": "...", "confidence": 0.95, "baseline": "none"},
      "environment": {<nbckpt.bench.environment()>},
      "load": {<Load's fields>, "high": false, "floors": {<the same, during the floors>}},
      "warnings": ["..."],                 # high load, a single repeat, stops, floor problems
      "floors": {<Floors' fields>},
      "results": [{"strategy": ..., <the RESULT_COLUMNS above>}, ...],
      "runs": [{"strategy": ..., "repeat": 0, "position": 0, <that run's metrics>, "wall_s": ...,
                "cpu_s": ..., "other_cpu_cores": ..., "steal_pct": ..., "loadavg_1m": ...,
                "cycle_loop_s": [...],     # each completed cycle's loop time, in order
                "stopped": false}, ...],   # one per strategy and repeat, in the order run
      "timeline": [{<TIMELINE_COLUMNS>}, ...]  # every event of every run ("written": a persist's
                                               # bytes in new files, null where not counted)
    }

Under ``torchrun`` (``nbckpt bench`` on many ranks, :mod:`nbckpt.bench._ranks`) rank 0 alone
writes the document: everything above is rank 0's own, and two more keys hold every rank's
figures and the job's (:func:`nbckpt.bench._job.job_summary`; absent in one process)::

      "ranks": [{"rank": 0, "host": "node-a", "strategy": "nbckpt-async",
                 "stall_s": ...,          # mean stall per checkpoint on this rank
                 "persist_s": ...,        # mean persist per checkpoint on this rank
                 "bytes": ...,            # this rank's checkpoint files on disk or objects (every checkpoint
                                          # and repeat): a replicated state is written once in all;
                                          # new bytes only: a file an incremental save shares by
                                          # hard link with an earlier step counts there (each inode
                                          # once; on an object store a shared object is a server-
                                          # side copy, counted at each step)
                 "write_gbs": ...,        # those bytes over this rank's persist time
                 "mean_step_s": ..., "overhead_pct": ..., "checkpoints": 2}, ...],  # rank x strategy
      "job": {
        "world_size": 2, "hosts": {"node-a": [0, 1]},
        "floors": {"concurrent_write_gbs": ...,  # every rank writing its share at once, raw: all
                   # the bytes over the first rank's first byte to the last one's fsync's end
                   # (each prepared first, then released by a barrier), between the strategies'
                   # turns with no rank training (the idle floor); the fastest repeat
                   "concurrent_write_gbs_by_repeat": [...],
                   "concurrent_write_gbs_interval": [mean, lo, hi],  # over repeats (95 %; null
                                                                     # below 2 repeats; in log
                                                                     # space: a geometric mean)
                   "bytes": ..., "ranks": 2,
                   "beside_training": {  # host compute on the CPU only (not --idle-compute):
                       # every rank's share written raw (no copy, no checksum) by as many threads
                       # as nbckpt's writers at their nice, in a lane taking its turns with the
                       # strategies', while every rank trained (._measure.RawWriteBeside)
                       "write_gbs": ...,  # median over its checkpoints, each as a strategy's
                                          # aggregate_persist_gbs (first write start to last fsync)
                       "write_gbs_interval": [mean, lo, hi],  # over its checkpoints (95 %,
                                                              # in log space as the other rates')
                       "writer_threads": 2, "writer_nice": 10,
                       "checkpoints": [{"repeat": 0, "step": 5, "ranks_writing": 2, "bytes": ...,
                                        "aggregate_persist_gbs": ..., "start_spread_s": ...,
                                        "steps_beside": 3}, ...]},  # the fewest training steps
                                        # any rank ran while it wrote (0: the final checkpoint)
                   "by_rank": [{"rank": 0, "host": "node-a",  # each rank's, measured at once:
                                "concurrent_write_gbs": ...,  # its share raw, the fastest repeat
                                "bytes": ...,  # its state, as the one-process "floors"
                                "copy_s": ..., "copy_gbs": ..., "copy_gbs_by_repeat": [...]},
                               ...]},
        "load_by_host": {"node-a": {"ranks": [0, 1], <Load's fields>, "high": false}},  # per
                  # host from its ranks' loads: the busiest load average, the ranks' CPU as
                  # own_cpu_s, other_cpu_cores only what was busy beyond them (_job.host_load)
        "strategies": [{
          "strategy": "nbckpt-async",
          "overhead_pct": ..., "slowest_rank": 1,   # the job goes at its slowest rank
          "stall_s": {"median": ..., "p99": ..., "max": ...},   # over ranks
          "straggler": {"rank": 1, "host": "node-a", "stall_s": ..., "median_s": ...,
                        "over_median_s": ..., "over_median_ratio": ...} or null,
          "time_to_durable_s": ..., "aggregate_write_gbs": ...,  # medians over checkpoints
          "aggregate_persist_gbs": ...,
          "time_to_durable_ci_s": [lo, hi], "aggregate_write_ci_gbs": [lo, hi],  # 95 % over
                  # repeats: a t-interval of the log of each repeat's median (null with one)
          "bytes_per_checkpoint": ...,
          "checkpoints": [{"repeat": 0, "step": 5, "ranks_writing": 2, "bytes": ...,
                           "time_to_durable_s": ...,   # first save's start to last commit, any rank
                           "aggregate_write_gbs": ...,  # all ranks' bytes over that time
                           "aggregate_persist_gbs": ...,  # over the first write's start to the
                                                          # last commit (the copies left out)
                           "first_rank": 0, "last_rank": 1,
                           "start_spread_s": ...,  # last rank's save start - first's
                           "steps_beside": ...}, ...]}, ...],  # as the floor beside training's
        "coordination": {"seconds": ..., "per_step_s": ...,  # the bench's own cost: over its
                         "collectives": 40,             # collectives (barriers, the events'
                         "gather_s": ...},              # gather; outside the lanes' clocks)
                         # the least time any rank spent in each (the last to arrive's), plus
                         # rank 0's gather of the records; per step trained
        "turn_wait": [{"rank": 0, "collectives_s": ...,  # this rank's time in those collectives
                       "seconds": ..., "per_step_s": ...}, ...],  # of which waiting there for
                       # the slowest rank (the job going at its slowest rank, not the bench)
        "kept": [{"rank": 0, "strategy": "nbckpt-async", "repeat": 2, "step": 20,  # --keep only:
                  "digests": {"model.lm_head.weight": "<sha256>", ...}}, ...]},  # the last repeat's
                  # last checkpoint, each tensor this rank holds (its local shard under FSDP2)
      "rank_timeline": [{"rank": 1, "strategy": "nbckpt-async", "repeat": 0, "kind": "persist",
                         "step": 4, "start_ns": ..., "end_ns": ...,  # wall clock (time.time_ns)
                         "bytes": ...}, ...]  # every event of every rank (nbckpt.bench._rank_timeline);
                                              # a persist's: what this rank wrote of that
                                              # checkpoint, as "ranks" counts it (not the state)

``nbckpt bench --ranks 1,2,4`` (:mod:`nbckpt.bench._sweep`) writes one document over every
size, ``nbckpt.bench.scaling/1``: each size's document above under ``runs``, and a ``scaling``
row per size and strategy (schema in :func:`nbckpt.bench._sweep.scaling_document`).

Times are seconds, rates GB/s (1e9 bytes), memory MiB; ``start_s`` counts from the start
of that run (after its warm-up save).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .._errors import ConfigError
from ..engine._internal import write_atomic
from ._job import job_text
from ._load import Load
from ._measure import Floors
from ._result import RESULT_COLUMNS, STALL_DEFINITION, STALL_NAMES
from ._stats import (
    CONFIDENCE,
    OVERHEAD_DEFINITION,
    OVERHEAD_METHOD,
    drag_text,
    interval_text,
    overhead_text,
    per_repeat_text,
)

__all__ = [
    "SCHEMA",
    "SHOWN_COLUMNS",
    "TIMELINE_COLUMNS",
    "Comparison",
    "format_results",
]

SCHEMA = "nbckpt.bench/3"
TIMELINE_COLUMNS = [
    "strategy",
    "repeat",
    "kind",
    "label",
    "step",
    "rank",
    "start_s",
    "end_s",
    "duration_s",
    "bytes",
    "written",
    "thread",
    "pid",
    "start_ns",
    "end_ns",
]


#: Every column the results tables show, as :func:`format_results` names it: one header per
#: quantity, the same in the text table, the Lab, the report and the notebooks.
SHOWN_COLUMNS = {
    "strategy": "strategy",
    "repeats": "repeats",
    "checkpoints": "checkpoints",
    "overhead": "overhead",
    "overhead_95ci": "95 % interval",
    "per_repeat": "per repeat",
    "rests_on": "rests on",
    "mean_step_s": "mean step s",
    "stall_mean_s": f"{STALL_NAMES['stall_mean_s']} s",
    "save_stall_s": f"{STALL_NAMES['save_stall_s']} s",
    "wait_s": f"{STALL_NAMES['wait_s']} s",
    "stall_p95_s": f"{STALL_NAMES['stall_mean_s']} p95 s",
    "drag": "drag per checkpoint",
    "persist_s": "persist s",
    "written_mb": "written MB",
    "write_gbs": "write GB/s",
    "peak_host_mb": "peak host MiB",
    "peak_device_mb": "peak device MiB",
    "reduction_vs_torch_save": "stall reduction vs torch-save",
    "reduction_vs_dcp_sync": "stall reduction vs dcp-sync",
    "write_vs_floor_pct": "write vs floor",
    "floor_check": "floor check",
}
_FORMATS = {
    "mean_step_s": "{:.4f}",
    "stall_mean_s": "{:.4f}",
    "save_stall_s": "{:.4f}",
    "wait_s": "{:.4f}",
    "stall_p95_s": "{:.4f}",
    "persist_s": "{:.3f}",
    "written_mb": "{:.2f}",
    "write_gbs": "{:.2f}",
    "peak_host_mb": "{:.0f}",
    "peak_device_mb": "{:.0f}",
    "reduction_vs_torch_save": "{:.1f}x",
    "reduction_vs_dcp_sync": "{:.1f}x",
    "write_vs_floor_pct": "{:.0f} %",
}
# Columns of RESULT_COLUMNS that hold lists or text (the others are numbers).
_LIST_COLUMNS = ("overhead_ci_pct", "overhead_by_repeat_pct", "drag_ci_s")
_TEXT_COLUMNS = ("strategy", "partial", "overhead_basis", "overhead_method", "floor_check")
# Shown even when empty: a row without an overhead says so.
_ALWAYS = ("strategy", "overhead", "overhead_95ci")


def format_results(results: pd.DataFrame, device: str = "cpu") -> pd.DataFrame:
    """``Comparison.results`` (or rows of run metrics) as the text every nbckpt table shows,
    headed by :data:`SHOWN_COLUMNS`: the overhead always as a number (:func:`overhead_text`)
    beside its interval, each repeat's overhead and what the row rests on, the stall and its
    two parts, the drag (:func:`drag_text`), numbers rounded, ``-`` where not measured."""
    rows = []
    for row in results.to_dict(orient="records"):
        shown: dict[str, Any] = {
            "strategy": row["strategy"],
            "repeats": row.get("repeats", "-"),
            "checkpoints": row.get("checkpoints", "-"),
            "overhead": overhead_text(row),
            "overhead_95ci": (
                "-" if str(row["strategy"]) == "none" else interval_text(row.get("overhead_ci_pct"))
            ),
            "per_repeat": per_repeat_text(row),
            "rests_on": str(row.get("overhead_basis") or "-"),
            "drag": drag_text(row),
            "floor_check": str(row.get("floor_check") or ""),
        }
        for column, fmt in _FORMATS.items():
            if column == "peak_device_mb" and device != "cuda":
                continue
            value = row.get(column)
            finite = value is not None and isinstance(value, (int, float)) and math.isfinite(value)
            shown[column] = fmt.format(value) if finite else "-"
        rows.append({SHOWN_COLUMNS[key]: shown[key] for key in SHOWN_COLUMNS if key in shown})
    frame = pd.DataFrame(
        rows,
        columns=[
            label for key, label in SHOWN_COLUMNS.items() if key != "peak_device_mb" or device == "cuda"
        ],
    )
    # A column nothing was measured for (no dcp-sync run, say) only widens the table.
    always = {SHOWN_COLUMNS[key] for key in _ALWAYS}
    empty = [c for c in frame.columns if c not in always and frame[c].isin(["-", ""]).all()]
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


def _check_schema(schema: Any, source: str) -> None:
    """A one-line :class:`ConfigError` naming ``source`` unless ``schema`` is this version's: a
    bench result of another version is measured again; anything else (what ``nbckpt probe
    --json`` writes) is no bench result at all, and measuring again would not help."""
    if schema == SCHEMA:
        return
    if isinstance(schema, str) and schema.startswith(SCHEMA.partition("/")[0] + "/"):
        raise ConfigError(
            f"{source}: a {schema} bench result, this nbckpt reads {SCHEMA}; "
            "measure again with this version of nbckpt"
        )
    found = "no schema" if schema is None else f"schema {schema!r}"
    raise ConfigError(
        f"{source}: not a bench result ({found}, not {SCHEMA}): give what nbckpt bench --json wrote"
    )


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
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """On many ranks: one row per rank and strategy (see the module's docstring); else empty."""
    job: dict[str, Any] = field(default_factory=dict)
    """On many ranks: the job's figures (see the module's docstring); else empty."""
    rank_timeline: list[dict[str, Any]] = field(default_factory=list)
    """On many ranks: every rank's events on the wall clock (:mod:`._rank_timeline`); else empty."""

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
            "overhead": {
                "definition": OVERHEAD_DEFINITION,
                "method": OVERHEAD_METHOD,
                "confidence": CONFIDENCE,
                "baseline": "none",
            },
            "environment": self.environment,
            "load": _json_value(self.load),
            "warnings": list(self.warnings),
            "floors": _json_value(self.floors.to_dict()),
            "results": _records(self.results),
            "runs": _records(self.runs),
            "timeline": _records(self.timeline),
            **({"ranks": _json_value(self.ranks), "job": _json_value(self.job)} if self.job else {}),
            **({"rank_timeline": _json_value(self.rank_timeline)} if self.rank_timeline else {}),
        }

    @classmethod
    def from_dict(cls, document: dict[str, Any], *, source: str = "the document") -> Comparison:
        """The comparison a :meth:`to_dict` document describes (``nbckpt bench --json``'s file):
        ``null`` numbers become NaN, so its tables read as when it was measured. ``source``
        names it in the error that refuses anything else (:func:`_check_schema`)."""
        _check_schema(document.get("schema"), source)
        results = pd.DataFrame(document.get("results") or [], columns=RESULT_COLUMNS)
        for column in RESULT_COLUMNS:
            if column in _LIST_COLUMNS:
                results[column] = [
                    [math.nan if v is None else float(v) for v in value or []] for value in results[column]
                ]
            elif column not in _TEXT_COLUMNS:
                results[column] = pd.to_numeric(results[column], errors="coerce")
        results["partial"] = results["partial"].astype(bool)
        fields = {
            name: document[name]
            for name in (
                "workload",
                "device",
                "directory",
                "steps",
                "every",
                "repeats",
                "bytes",
                "order",
                "interleave",
                "load",
                "warnings",
                "ranks",
                "job",
                "rank_timeline",
            )
            if name in document
        }
        return cls(
            results=results,
            runs=pd.DataFrame(document.get("runs") or []),
            timeline=pd.DataFrame(document.get("timeline") or [], columns=TIMELINE_COLUMNS),
            floors=Floors.from_dict(document.get("floors") or {}),
            environment=dict(document.get("environment") or {}),
            **fields,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> Comparison:
        """Read a comparison that :meth:`to_json` (or ``nbckpt bench --json``) wrote."""
        try:
            with open(path) as stream:
                document = json.load(stream)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read a comparison from {os.fspath(path)}: {exc}") from None
        if not isinstance(document, dict):
            raise ConfigError(f"{os.fspath(path)} holds no comparison (a JSON object is expected)")
        return cls.from_dict(document, source=os.fspath(path))

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` to ``path`` whole or not at all."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1, allow_nan=False).encode())

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
            STALL_DEFINITION,
            self.floors.describe(),
        ]
        if self.load:
            fields = {key: value for key, value in self.load.items() if key in Load.__dataclass_fields__}
            lines.append(f"load during the runs: {Load(**fields).describe()}")
        if self.job:
            lines.extend(job_text(self.job))
        lines.extend(f"warning: {text}" for text in self.warnings)
        return "\n".join(lines)
