"""Run checkpoint strategies side by side on one workload and measure what each costs.

    >>> from nbckpt import experiment, workloads
    >>> cmp = experiment.compare(workloads.gpt("tiny"), ["torch-save", "nbckpt-async"],
    ...                          "data/checkpoints/bench", steps=20, every=5, repeats=3)
    >>> print(cmp.table())  # overhead with its 95 % interval, stalls, floors, the machine's load
    >>> cmp.results         # one row per strategy; cmp.runs: one per run; cmp.timeline: events

How it measures, on a machine that other work shares
----------------------------------------------------
- **Interleaved repeats.** Every repeat runs every strategy's steps once, in an order rotated
  by one place per repeat (:func:`run_order`). Within a repeat the strategies take turns every
  checkpoint cycle (``interleave="cycle"``): all of them are open, and each trains ``every``
  steps (starting with the checkpoint due) before the next one does, the order rotated by one
  place per cycle. Other work on a shared machine comes in bursts of seconds; taking turns
  every few seconds spreads a burst over all strategies instead of letting it fall on one
  whole run. Each strategy's clock only runs during its own turns, and a turn ends by waiting
  for the strategy's background write, counted as the wait its next save would have had (one
  save in flight). ``interleave="run"`` runs each strategy's steps in one go instead.
- **A baseline in every repeat.** The ``none`` strategy (no checkpoints) runs in every repeat;
  ``compare`` adds it when it is missing (``baseline=False`` leaves it out, and overhead with it).
- **One definition of overhead** (:data:`OVERHEAD_DEFINITION`, printed under every table):
  in each repeat, ``overhead = 100 * (loop time / loop time of that repeat's none run - 1)``,
  where the loop time is the wall time of the same training steps on the same batches, save
  stalls and steps slowed by background writes included, the final wait for the last
  checkpoint excluded. ``overhead_pct`` is the mean over repeats.
- **A 95 % interval** (``overhead_ci_pct``): the t-interval of the paired per-repeat overheads
  (``n - 1`` degrees of freedom, :func:`t_interval`). With a single usable repeat there is no
  spread between repeats to use, so the interval is a percentile bootstrap over the steps of
  that repeat (:func:`bootstrap_overhead`, seeded); ``overhead_method`` says which. The
  bootstrap sees step-to-step noise only, not drift between runs: use 3 or more repeats.
  An interval that contains 0 is reported as "no measurable difference", not as a number.
- **The machine's load** (:class:`LoadMonitor`): load average, CPU steal (from ``/proc/stat``
  via psutil) and the CPU that other processes used, per run and over the whole comparison;
  a warning is printed and stored when it is high (:meth:`Load.warning`).
- **Partial runs.** A run ended by ``stop`` is marked ``stopped``; a strategy whose every run
  was stopped is a ``partial`` row, with no overhead, left out of conclusions.
- **Floors** (:func:`measure_floors`): a copy of the same bytes into preallocated memory, and
  the raw fsync'd write of the same bytes into the same directory measured exactly as
  ``nbckpt probe`` measures (:func:`nbckpt.bench.measure_write`), at 1 and 2 streams.

Metrics (``Comparison.results`` columns, :data:`RESULT_COLUMNS`):

- ``repeats``: runs pooled into the row; ``partial``: every run of it was stopped.
- ``steps`` / ``checkpoints``: per run.
- ``mean_step_s``: loop time divided by steps (stalls included), over the pooled runs.
- ``overhead_pct``, ``overhead_ci_pct`` (``[lo, hi]``), ``overhead_method``: see above.
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

From the shell (the default strategies, :data:`DEFAULT_STRATEGIES`, on the tiny preset)::

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json bench.json
    nbckpt bench --dir /mnt/flashblade/ckpt --preset small --strategies none,torch-save,nbckpt-async

``nbckpt bench`` (options: :func:`add_arguments`) prints the table and writes JSON with this
schema (``"schema": "nbckpt.bench/2"``; missing numbers are ``null``)::

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
      "results": [{"strategy": ..., "repeats": ..., "partial": ..., "steps": ...,
                   "checkpoints": ..., "mean_step_s": ..., "overhead_pct": ...,
                   "overhead_ci_pct": [lo, hi], "overhead_method": ..., "stall_mean_s": ...,
                   "stall_p95_s": ..., "drag_s": ..., "cpu_per_checkpoint_s": ...,
                   "persist_s": ..., "write_gbs": ..., "peak_host_mb": ..., "peak_device_mb": ...,
                   "reduction_vs_torch_save": ..., "reduction_vs_dcp_sync": ...,
                   "stall_vs_copy_floor": ..., "write_vs_floor_pct": ...}, ...],
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
import platform
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import psutil
import torch

from .._errors import ConfigError
from .._util import MIB, check_count, format_bytes, is_url, writable_directory
from ..engine import Event, Timeline, now_ns
from . import _probe as storage
from ._strategies import Strategy, get_strategy
from ._workloads import Workload

__all__ = [
    "CONFIDENCE",
    "DEFAULT_REPEATS",
    "DEFAULT_STRATEGIES",
    "OVERHEAD_DEFINITION",
    "RESULT_COLUMNS",
    "SCHEMA",
    "TIMELINE_COLUMNS",
    "Comparison",
    "ExperimentResult",
    "Floors",
    "Load",
    "LoadMonitor",
    "Progress",
    "bootstrap_overhead",
    "check_run_args",
    "compare",
    "environment",
    "format_results",
    "interval_text",
    "measurable",
    "measure_floors",
    "overhead_text",
    "run_experiment",
    "run_order",
    "t_interval",
    "t_quantile",
]

SCHEMA = "nbckpt.bench/2"
#: Confidence of every interval nbckpt reports.
CONFIDENCE = 0.95
#: Repeats ``compare`` and ``nbckpt bench`` run unless told otherwise: the fewest that give a
#: t-interval with a usable width, and one place in the rotation per strategy of a 3-way run.
DEFAULT_REPEATS = 3
#: What ``nbckpt bench`` runs without ``--strategies``: every built-in strategy except
#: ``dcp-async-process`` (DCP's process executor with default staging), which
#: ``dcp-async-stager`` runs in its best configuration.
DEFAULT_STRATEGIES = [
    "none", "torch-save", "dcp-sync", "dcp-async", "dcp-async-stager", "nbckpt-sync",
    "nbckpt-async", "nbckpt-async-overlap",
]
#: The one definition of overhead: printed under every table nbckpt shows.
OVERHEAD_DEFINITION = (
    "Overhead: how much longer the training loop took than the `none` run of the same repeat, "
    "100 x (loop time / baseline loop time - 1), over the same steps and batches; save stalls "
    "(waits for an earlier write included) and steps slowed by background writes count, the "
    "final wait for the last checkpoint does not. Shown: the mean over repeats with its 95 % "
    "t-interval across repeats (one repeat: a bootstrap over steps, blind to drift between "
    "runs). An interval that contains 0 reads 'no measurable difference'."
)
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
# Floors are measured on at most this many bytes and scaled: rates are flat well below it.
FLOOR_SAMPLE_BYTES = 1 << 30
#: Stream counts of the write floor: what torch.save and DCP use (one file) and what nbckpt's
#: default two writer threads use.
FLOOR_STREAMS = (1, 2)
#: Untimed training steps before the first run, so that no run pays for first-touch allocation.
WARMUP_STEPS = 2
BOOTSTRAP_RESAMPLES = 2000
_MEMORY_SAMPLE_S = 0.01
# "High" load: other processes kept a quarter of the cores busy, or the hypervisor took 5 %.
_HIGH_OTHER_SHARE = 0.25
_HIGH_STEAL_PCT = 5.0

EventCallback = Callable[[Event], None]
Progress = Callable[[str], None]


# -- statistics ------------------------------------------------------------------------------------

# Two-sided 95 % quantiles of Student's t for 1 to 30 degrees of freedom.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)
_Z975 = 1.959964


def t_quantile(df: int) -> float:
    """The 97.5 % quantile of Student's t with ``df`` degrees of freedom (a 95 % interval).

    Tabulated up to 30; beyond, the Cornish-Fisher expansion, within 1e-3 of the exact value.
    """
    check_count(df, "degrees of freedom")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, lo, hi)``: the mean of ``values`` and its 95 % t-interval (NaNs below 2 values)."""
    data = np.asarray([float(v) for v in values], dtype=float)
    if data.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(data.mean())
    if data.size < 2:
        return mean, math.nan, math.nan
    half = t_quantile(int(data.size) - 1) * float(data.std(ddof=1)) / math.sqrt(data.size)
    return mean, mean - half, mean + half


def bootstrap_overhead(
    strategy_steps: Sequence[float],
    baseline_steps: Sequence[float],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float, float]:
    """``(overhead, lo, hi)`` in % from the per-step times of one run and of its baseline.

    The point is ``100 * (mean(strategy) / mean(baseline) - 1)``; the interval is the 2.5th and
    97.5th percentile of that ratio over ``resamples`` resamplings (with replacement, each run's
    steps separately, seeded so that the same numbers give the same interval).
    """
    ours = np.asarray([float(v) for v in strategy_steps], dtype=float)
    theirs = np.asarray([float(v) for v in baseline_steps], dtype=float)
    if ours.size == 0 or theirs.size == 0 or not theirs.mean() > 0:
        return math.nan, math.nan, math.nan
    point = 100.0 * (float(ours.mean()) / float(theirs.mean()) - 1.0)
    rng = np.random.default_rng(seed)
    ours_means = ours[rng.integers(0, ours.size, (resamples, ours.size))].mean(axis=1)
    theirs_means = theirs[rng.integers(0, theirs.size, (resamples, theirs.size))].mean(axis=1)
    ratios = 100.0 * (ours_means / theirs_means - 1.0)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return point, float(lo), float(hi)


def measurable(interval: Sequence[float] | None) -> bool:
    """True when a 95 % interval excludes 0: the difference it bounds was measured."""
    if interval is None or len(interval) != 2:
        return False
    lo, hi = (float(v) for v in interval)
    return math.isfinite(lo) and math.isfinite(hi) and (lo > 0 or hi < 0)


def interval_text(interval: Sequence[float] | None, unit: str = "%") -> str:
    """``[-3.1, +4.2] %`` style, or ``-`` where there is no interval."""
    if interval is None or len(interval) != 2:
        return "-"
    lo, hi = (float(v) for v in interval)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "-"
    return f"[{lo:+.1f}, {hi:+.1f}] {unit}".rstrip()


def overhead_text(row: Any) -> str:
    """A results row's overhead in words: ``+12.3 %``, ``no measurable difference``, ``baseline``,
    ``partial (left out)`` or ``-`` (no baseline measured)."""
    get = row.get if hasattr(row, "get") else lambda key, default=None: getattr(row, key, default)
    if bool(get("partial", False)):
        return "partial (left out)"
    if str(get("strategy", "")) == "none":
        return "baseline"
    pct = get("overhead_pct", math.nan)
    if pct is None or not math.isfinite(float(pct)):
        return "-"
    interval = get("overhead_ci_pct", None)
    if not measurable(interval):
        return "no measurable difference"
    return f"{float(pct):+.1f} %"


# -- the machine's load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What else the machine did over an interval (one run, the floors, a whole comparison)."""

    cpus: int
    wall_s: float
    own_cpu_s: float
    """CPU seconds of this process and its child processes (DCP's checkpoint process, say)."""
    other_cpu_cores: float
    """Cores that other processes kept busy, on average: machine-wide busy time minus ours."""
    steal_pct: float
    """Share of CPU time the hypervisor gave to other guests (``steal`` in /proc/stat)."""
    loadavg_1m_start: float
    loadavg_1m: float
    """The 1-minute load average at the end; it counts this process's own threads too."""

    @property
    def own_cores(self) -> float:
        return self.own_cpu_s / self.wall_s if self.wall_s > 0 else math.nan

    def warning(self) -> str | None:
        """One line when the load was high enough to widen the intervals, else None."""
        reasons = []
        if self.other_cpu_cores >= _HIGH_OTHER_SHARE * self.cpus:
            reasons.append(f"other processes kept {self.other_cpu_cores:.1f} of {self.cpus} cores busy")
        if self.steal_pct >= _HIGH_STEAL_PCT:
            reasons.append(f"the hypervisor stole {self.steal_pct:.0f} % of the CPU time")
        others_queued = self.loadavg_1m - (self.own_cores if math.isfinite(self.own_cores) else 0.0)
        if others_queued > self.cpus:
            reasons.append(f"the 1-minute load average was {self.loadavg_1m:.1f} on {self.cpus} cores")
        if not reasons:
            return None
        return (f"the machine was busy while this ran ({'; '.join(reasons)}): expect wide "
                "intervals, and repeat when it is quieter")

    def describe(self) -> str:
        return (f"other processes used {self.other_cpu_cores:.2f} of {self.cpus} cores on average, "
                f"CPU steal {self.steal_pct:.1f} %, 1-minute load average "
                f"{self.loadavg_1m_start:.2f} -> {self.loadavg_1m:.2f} (this process used "
                f"{self.own_cores:.2f} cores)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "high": self.warning() is not None}


class LoadMonitor:
    """Counts machine-wide and own CPU time between its creation and :meth:`stop`."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._begin = self._snapshot()

    def _own_cpu_s(self) -> float:
        times = self._process.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in self._process.children(recursive=True):
            try:
                child_times = child.cpu_times()
            except psutil.Error:  # it ended between the listing and the read
                continue
            total += child_times.user + child_times.system
        return float(total)

    def _snapshot(self) -> tuple[float, Any, float, float]:
        return time.perf_counter(), psutil.cpu_times(), self._own_cpu_s(), _loadavg()

    def stop(self) -> Load:
        """The load since this monitor was created."""
        begin_t, begin_cpu, begin_own, begin_load = self._begin
        end_t, end_cpu, end_own, end_load = self._snapshot()
        cpus = psutil.cpu_count() or 1

        def delta(name: str) -> float:
            return float(getattr(end_cpu, name, 0.0)) - float(getattr(begin_cpu, name, 0.0))

        # guest time is already inside user time in /proc/stat; iowait counts as idle.
        busy = sum(delta(name) for name in ("user", "nice", "system", "irq", "softirq"))
        total = busy + sum(delta(name) for name in ("idle", "iowait", "steal"))
        wall = end_t - begin_t
        own = end_own - begin_own
        return Load(
            cpus=cpus,
            wall_s=wall,
            own_cpu_s=own,
            other_cpu_cores=max(busy - own, 0.0) / wall if wall > 0 else math.nan,
            steal_pct=100.0 * delta("steal") / total if total > 0 else 0.0,
            loadavg_1m_start=begin_load,
            loadavg_1m=end_load,
        )


def _loadavg() -> float:
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return math.nan


# -- floors ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floors:
    """What the hardware allows for ``bytes``: a copy into preallocated memory, and a raw write
    made durable (files fsync'd, objects uploaded) measured like ``nbckpt probe``."""

    bytes: int
    copy_s: float
    copy_gbs: float
    write_gbs: float
    """The best stream count's rate: the fastest round of :func:`nbckpt.bench.measure_write`."""
    write_s: float = math.nan
    sample_bytes: int = 0
    write_streams: int = 1
    write_gbs_by_streams: dict[str, float] = field(default_factory=dict)
    write_gbs_rounds: tuple[float, ...] = ()
    """Every round of the best stream count: how much the write rate varied here."""
    repeats: int = 1

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["write_gbs_rounds"] = list(self.write_gbs_rounds)
        return body

    def describe(self) -> str:
        text = (f"floors for {format_bytes(self.bytes)}: copy {self.copy_s:.4f} s "
                f"({self.copy_gbs:.1f} GB/s); raw durable write {self.write_gbs:.2f} GB/s "
                f"({self.write_s:.3f} s) with {self.write_streams} stream(s)")
        if self.write_gbs_rounds:
            text += (f", best of {len(self.write_gbs_rounds)} rounds "
                     f"({min(self.write_gbs_rounds):.2f}-{max(self.write_gbs_rounds):.2f} GB/s)")
        if len(self.write_gbs_by_streams) > 1:
            text += "; by streams: " + ", ".join(
                f"{k} -> {v:.2f} GB/s" for k, v in self.write_gbs_by_streams.items())
        if self.sample_bytes and self.sample_bytes < self.bytes:
            text += f"; measured on {format_bytes(self.sample_bytes)} and scaled"
        return text


def _copy_floor(nbytes: int, device: str) -> float:
    """Best of three copies of ``nbytes`` into a preallocated host buffer (pinned on CUDA)."""
    cuda = device == "cuda"
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target.copy_(source)  # touches every page once, as reused staging buffers are
    best = math.inf
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        target.copy_(source, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - begin)
    return best


def measure_floors(
    nbytes: int,
    directory: str,
    device: str = "cpu",
    storage_options: dict[str, Any] | None = None,
    *,
    streams: Sequence[int] = FLOOR_STREAMS,
    repeats: int = storage.DEFAULT_REPEATS,
) -> Floors:
    """Measure the copy floor and the raw fsync'd write rate of ``directory`` for ``nbytes``.

    The write is :func:`nbckpt.bench.measure_write`, the probe's own method, at each of
    ``streams``; the fastest stream count is the floor. Up to :data:`FLOOR_SAMPLE_BYTES` are
    really copied and written; larger sizes are scaled linearly from that sample.
    """
    if nbytes <= 0:
        raise ConfigError(f"floors need a positive number of bytes, not {nbytes}")
    sample = min(nbytes, FLOOR_SAMPLE_BYTES)
    scale = nbytes / sample
    copy_s = _copy_floor(sample, device) * scale
    runs = storage.measure_write(directory, sample, streams, repeats, dict(storage_options or {}))
    best = max(runs, key=lambda run: run.write_gbs)
    rate = best.write_gbs
    return Floors(
        bytes=nbytes,
        copy_s=copy_s,
        copy_gbs=nbytes / copy_s / 1e9,
        write_gbs=rate,
        write_s=nbytes / (rate * 1e9),
        sample_bytes=sample,
        write_streams=best.streams,
        write_gbs_by_streams={str(run.streams): run.write_gbs for run in runs},
        write_gbs_rounds=tuple(best.bytes / s / 1e9 for s in best.write_rounds_s if s > 0),
        repeats=repeats,
    )


# -- one run -----------------------------------------------------------------------------------


class _MemorySampler:
    """RSS of this process, sampled on a background thread: its peak since the last reset."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.peak = self.rss()
        self._thread = threading.Thread(target=self._run, name="nbckpt-memory", daemon=True)

    def rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(_MEMORY_SAMPLE_S):
            self.peak = max(self.peak, self.rss())

    def reset(self) -> int:
        """Start a new peak at the current RSS, which it returns."""
        now = self.rss()
        self.peak = now
        return now

    def __enter__(self) -> _MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class ExperimentResult:
    """One strategy's run: its events and the metrics derived from them."""

    strategy: str
    workload: str
    device: str
    steps: int
    every: int
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

    def _durations(self, kind: str) -> dict[int, float]:
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
    def mean_step_s(self) -> float:
        steps = self.steps_run
        return self.wall_s / steps if steps else math.nan

    @property
    def checkpoints(self) -> int:
        return len(self._durations("stall"))

    def step_costs(self) -> list[float]:
        """Each step's share of the loop: its own time plus the save (and backpressure) stall
        of the checkpoint taken after it."""
        costs = {e.step: e.duration_s for e in self.events if e.kind == "step" and e.step is not None}
        for event in self.events:
            if event.kind == "stall" and event.detail.get("part") in ("save", "wait") \
                    and event.step in costs:
                costs[event.step] += event.duration_s
        return [costs[step] for step in sorted(costs)]

    def metrics(self) -> dict[str, Any]:
        """Metrics of this run (the comparison adds those relative to other runs)."""
        load = self.load
        return {
            "strategy": self.strategy,
            **_pooled([self]),
            "wall_s": self.wall_s,
            "bytes": self.bytes,
            "cpu_s": load.own_cpu_s if load else math.nan,
            "other_cpu_cores": load.other_cpu_cores if load else math.nan,
            "steal_pct": load.steal_pct if load else math.nan,
            "loadavg_1m": load.loadavg_1m if load else math.nan,
            "engine_cpu_s": self.engine_cpu_s,
            "stopped": self.stopped,
        }

    def timeline_frame(self) -> pd.DataFrame:
        return self.timeline.to_pandas()


def check_run_args(steps: int, every: int) -> None:
    """ConfigError unless ``steps`` and ``every`` make a run that saves at least once."""
    check_count(steps, "steps")
    check_count(every, "every")
    if every > steps:
        raise ConfigError(f"every ({every}) must not exceed steps ({steps}): nothing would be saved")


def _resolve_device(workload: Workload, device: str | None) -> str:
    if device is not None and device != workload.device:
        raise ConfigError(f"device {device!r} differs from the workload's device {workload.device!r}")
    return workload.device


def _combine(loads: Sequence[Load]) -> Load | None:
    """One load record for several stretches of time (a lane's chunks)."""
    if not loads:
        return None
    wall = sum(load.wall_s for load in loads)
    if wall <= 0:
        return loads[-1]
    return Load(
        cpus=loads[0].cpus,
        wall_s=wall,
        own_cpu_s=sum(load.own_cpu_s for load in loads),
        other_cpu_cores=sum(load.other_cpu_cores * load.wall_s for load in loads) / wall,
        steal_pct=sum(load.steal_pct * load.wall_s for load in loads) / wall,
        loadavg_1m_start=loads[0].loadavg_1m_start,
        loadavg_1m=loads[-1].loadavg_1m,
    )


class _Lane:
    """One strategy's run, trained in chunks of one checkpoint cycle.

    In a repeat of several strategies the chunks of all strategies alternate (see
    :func:`compare`); the lane's clock only runs during its own chunks, so its loop time,
    load record and timeline read as if it had trained alone. Each chunk starts with the
    checkpoint due before it (its copy or write then overlaps the chunk's steps, as in a
    training loop) and, when another strategy comes next, ends by waiting for the strategy's
    background work: that wait is what the next save would have waited for, and counts.
    """

    def __init__(self, name: str, strategy: Strategy, workload: Workload, steps: int, every: int,
                 device: str, on_event: EventCallback | None, progress: Progress | None,
                 repeat: int) -> None:
        self.name, self.strategy, self.workload = name, strategy, workload
        self.steps, self.every, self.device, self.repeat = steps, every, device, repeat
        self.on_event, self.progress = on_event, progress
        self.timeline = Timeline(label=name)
        self.timeline.add_listener(self._listen)
        self.recorded: list[Event] = []
        self.active = False  # events count during the lane's chunks only (warm-up excluded)
        self.origin_ns: int | None = None
        self.shift_ns = 0  # time other lanes ran, cut out of this lane's clock
        self.paused_ns = 0
        self.loop_ns = 0
        self.pending: list[int] = []  # the last checkpoint whose copy may still be running
        self.loads: list[Load] = []
        self.monitor: LoadMonitor | None = None
        self.steps_done = 0
        self.stopped = False
        self.held_rss = 0  # what opening and the warm-up save left resident
        self.rss_at_resume = 0
        self.peak_above = 0  # the most RSS rose above its level at the start of a chunk
        self.peak_device = 0
        self.engine_cpu_s: float | None = None
        self.finished = False  # every chunk ran, the final checkpoint included

    def _listen(self, event: Event) -> None:
        if not self.active:
            return
        moved = replace(event, start_ns=event.start_ns - self.shift_ns, end_ns=event.end_ns - self.shift_ns)
        self.recorded.append(moved)
        if self.on_event is not None:
            self.on_event(moved)

    def open(self, directory: str, warmup: bool, memory: _MemorySampler) -> None:
        before = memory.rss()
        self.strategy.open(directory, self.timeline)
        if warmup and self.strategy.writes_checkpoints:
            self.strategy.save(self.workload.state(), 0)
            self.strategy.before_step()
            self.strategy.finish()
        self.held_rss = max(memory.rss() - before, 0)

    def resume(self, memory: _MemorySampler) -> None:
        if self.active:  # alone, a lane's chunks run back to back
            return
        now = now_ns()
        if self.origin_ns is None:
            self.origin_ns = now
        else:
            self.shift_ns += now - self.paused_ns
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.rss_at_resume = memory.reset()
        self.monitor = LoadMonitor()
        self.active = True

    def _before_update(self) -> None:
        begin = now_ns()
        self.strategy.before_step()
        if self.strategy.blocks_before_step and self.pending:
            self.timeline.record("stall", begin, step=self.pending.pop(), part="before_step")

    def chunk(self, first: int, last: int, stop: threading.Event | None) -> bool:
        """Save the checkpoint due after step ``first - 1``, then train ``first..last``;
        False when ``stop`` ended it early."""
        begin = now_ns()
        try:
            due = first - 1
            if self.strategy.writes_checkpoints and due > 0 and due % self.every == 0:
                self.workload.step = due
                started = now_ns()
                self.strategy.save(self.workload.state(), due)
                stall = self.timeline.record("stall", started, step=due, nbytes=self.workload.nbytes,
                                             part="save")
                self.pending[:] = [due]
                if self.progress is not None:
                    self.progress(f"[{self.name}] step {due}/{self.steps}: checkpoint stalled "
                                  f"{stall.duration_s:.3f} s")
                if stop is not None and stop.is_set() and due < self.steps:
                    self.stopped = True
                    return False
            for step in range(first, last + 1):
                self.workload.step = step - 1  # every lane trains on the same batches
                started = now_ns()
                self.workload.train_step(self._before_update)
                self.timeline.record("step", started, step=step)
                self.steps_done += 1
                if stop is not None and stop.is_set() and step < self.steps:
                    self.stopped = True
                    return False
            return True
        finally:
            self.loop_ns += now_ns() - begin

    def settle(self, next_save: int | None) -> None:
        """Wait for the strategy's background work. Before another lane runs, the wait stands
        for the backpressure the next save (``next_save``) would have met, and counts."""
        begin = now_ns()
        self.strategy.finish()
        waited = now_ns() - begin
        if next_save is not None and waited > 100_000:
            self.timeline.record("stall", begin, step=next_save, part="wait")
            self.loop_ns += waited

    def pause(self, memory: _MemorySampler) -> None:
        if not self.active:
            return
        if self.monitor is not None:
            self.loads.append(self.monitor.stop())
        self.peak_above = max(self.peak_above, memory.peak - self.rss_at_resume)
        if self.device == "cuda":
            self.peak_device = max(self.peak_device, torch.cuda.max_memory_allocated())
        self.active = False
        self.paused_ns = now_ns()

    def result(self, base_rss: int) -> ExperimentResult:
        timeline = Timeline(label=self.name)
        timeline.origin_ns = self.origin_ns or now_ns()
        timeline.extend(self.recorded)
        return ExperimentResult(
            strategy=self.name,
            workload=self.workload.describe(),
            device=self.device,
            steps=self.steps,
            every=self.every,
            bytes=self.workload.nbytes,
            timeline=timeline,
            wall_s=self.loop_ns / 1e9,
            peak_host_mb=(base_rss + self.held_rss + self.peak_above) / MIB,
            peak_device_mb=self.peak_device / MIB if self.device == "cuda" else math.nan,
            stopped=not self.finished,
            events=list(self.recorded),
            load=_combine(self.loads),
            repeat=self.repeat,
            engine_cpu_s=math.nan if self.engine_cpu_s is None else self.engine_cpu_s,
        )


def _run_lanes(
    lanes: list[_Lane],
    directory: str,
    steps: int,
    every: int,
    stop: threading.Event | None,
    *,
    warmup: bool,
) -> list[ExperimentResult]:
    """Open every lane, run their chunks in turn (rotated by one place per cycle), close them.

    With one lane the chunks run back to back: a plain training run. The last cycle holds
    only the final checkpoint, when ``steps`` is a multiple of ``every``.
    """
    cycles = [(first, min(first + every - 1, steps)) for first in range(1, steps + 1, every)]
    if steps % every == 0:
        cycles.append((steps + 1, steps))  # the final checkpoint, no steps after it
    opened: list[_Lane] = []
    with _MemorySampler() as memory:
        base_rss = memory.rss()
        try:
            for lane in lanes:
                opened.append(lane)
                lane.open(directory, warmup, memory)
            alone = len(lanes) == 1
            stopped = False
            for index, (first, last) in enumerate(cycles):
                final = index == len(cycles) - 1
                for lane in lanes[index % len(lanes):] + lanes[: index % len(lanes)]:
                    if stop is not None and stop.is_set() and not alone:
                        stopped = True
                        break
                    lane.resume(memory)
                    completed = lane.chunk(first, last, stop)
                    if not alone or final or not completed:
                        # The next chunk starts with the checkpoint of step `last`, if one is due.
                        due = last if completed and not final and last % every == 0 else None
                        lane.settle(due)
                        lane.pause(memory)
                    lane.finished = completed and final
                    if not completed:
                        stopped = True
                        break
                if stopped:
                    break
            for lane in lanes:
                if lane.active:  # alone and stopped between steps: wait for its saves
                    lane.settle(None)
                    lane.pause(memory)
                lane.engine_cpu_s = lane.strategy.save_cpu_s()
        finally:
            for lane in reversed(opened):
                lane.active = False
                lane.strategy.close()
        return [lane.result(base_rss) for lane in lanes]


def run_experiment(
    workload: Workload,
    strategy: str | Strategy,
    directory: str,
    steps: int,
    every: int,
    device: str | None = None,
    on_event: EventCallback | None = None,
    stop: threading.Event | None = None,
    *,
    warmup: bool = False,
    progress: Progress | None = None,
    storage_options: dict[str, Any] | None = None,
    repeat: int = 0,
) -> ExperimentResult:
    """Train ``steps`` steps, checkpoint every ``every`` with ``strategy``, record everything.

    ``on_event`` gets every event as it is recorded, on the thread that records it.
    Setting ``stop`` ends the run after the current step; saves in flight still commit.
    ``warmup`` makes one unrecorded save first (buffers, caches, spawned helpers).
    Every run starts at the workload's step 0, so every strategy trains on the same batches.
    """
    check_run_args(steps, every)
    device = _resolve_device(workload, device)
    chosen = get_strategy(strategy, **({"storage_options": storage_options} if storage_options else {}))
    workload.build()
    lane = _Lane(chosen.name, chosen, workload, steps, every, device, on_event, progress, repeat)
    return _run_lanes([lane], directory, steps, every, stop, warmup=warmup)[0]


# -- comparisons -------------------------------------------------------------------------------


def run_order(names: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of each repeat: ``names`` rotated by one place per repeat.

    With as many repeats as strategies every strategy runs once in every position, so a drift
    of the machine's speed over the comparison spreads evenly over the strategies.
    """
    check_count(repeats, "repeats")
    items = list(names)
    if not items:
        return [[] for _ in range(repeats)]
    return [items[r % len(items):] + items[: r % len(items)] for r in range(repeats)]


def environment(device: str) -> dict[str, Any]:
    """Where the numbers were measured."""
    from .. import __version__

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nbckpt": __version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor()
        or platform.machine(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return env


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


_FORMATS = {
    "mean_step_s": "{:.4f}", "stall_mean_s": "{:.4f}", "stall_p95_s": "{:.4f}",
    "drag_s": "{:+.4f}", "persist_s": "{:.3f}", "write_gbs": "{:.2f}", "peak_host_mb": "{:.0f}",
    "peak_device_mb": "{:.0f}", "reduction_vs_torch_save": "{:.1f}x",
    "reduction_vs_dcp_sync": "{:.1f}x", "write_vs_floor_pct": "{:.0f} %",
}


def format_results(results: pd.DataFrame, device: str = "cpu") -> pd.DataFrame:
    """``Comparison.results`` as the text every nbckpt table shows: the overhead in words
    (:func:`overhead_text`) beside its interval, numbers rounded, ``-`` where not measured."""
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
            lines.append(f"load during the runs: {Load(**_load_fields(self.load)).describe()}")
        lines.extend(f"warning: {text}" for text in self.warnings)
        return "\n".join(lines)


def _load_fields(load: dict[str, Any]) -> dict[str, Any]:
    names = {f for f in Load.__dataclass_fields__}
    return {key: value for key, value in load.items() if key in names}


def _pooled(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Metrics over the checkpoints of one or more runs of the same strategy."""
    runs = max(len(results), 1)
    step_total = sum(r.steps_run for r in results)
    stalls = [s for r in results for s in r._durations("stall").values()]
    persists = [p for r in results for p in r._durations("persist").values()]
    persist_bytes = sum(e.bytes for r in results for e in r.events if e.kind == "persist")
    wall_s = sum(r.wall_s for r in results)
    return {
        "steps": round(step_total / runs),
        "checkpoints": round(len(stalls) / runs),
        "mean_step_s": wall_s / step_total if step_total else math.nan,
        "stall_mean_s": float(np.mean(stalls)) if stalls else 0.0,
        "stall_p95_s": float(np.percentile(stalls, 95)) if stalls else 0.0,
        "persist_s": float(np.mean(persists)) if persists else math.nan,
        "write_gbs": persist_bytes / sum(persists) / 1e9 if sum(persists) > 0 else math.nan,
        "peak_host_mb": max(r.peak_host_mb for r in results),
        "peak_device_mb": max(r.peak_device_mb for r in results),
    }


def _paired(
    name: str, pairs: list[tuple[ExperimentResult, ExperimentResult]]
) -> dict[str, Any]:
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
        stall_total = sum(run._durations("stall").values())
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


def _aggregate(results: dict[str, list[ExperimentResult]], floors: Floors) -> pd.DataFrame:
    baseline = {run.repeat: run for run in results.get("none", []) if not run.stopped}
    rows = []
    for name, runs in results.items():
        if not runs:
            continue
        complete = [run for run in runs if not run.stopped]
        used = complete or runs
        pairs = [(run, baseline[run.repeat]) for run in complete if run.repeat in baseline]
        rows.append({"strategy": name, "repeats": len(used), "partial": not complete,
                     **_pooled(used), **_paired(name, pairs)})
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


def compare(
    workload: Workload,
    strategies: Sequence[str | Strategy],
    directory: str,
    steps: int = 20,
    every: int = 5,
    device: str | None = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: bool = True,
    on_event: EventCallback | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
    progress: Progress | None = print,
    *,
    storage_options: dict[str, Any] | None = None,
    keep_checkpoints: bool = False,
    baseline: bool = True,
    interleave: str = "cycle",
) -> Comparison:
    """Run every strategy in each of ``repeats`` repeats, interleaved (see the module doc).

    ``interleave="cycle"`` (the default) keeps every strategy of a repeat open and alternates
    them every checkpoint cycle, so a burst of other work on the machine falls on all of them
    alike; ``"run"`` runs each strategy's steps in one go (one strategy open at a time: less
    host memory, and ``cycle`` falls back to it when the staging buffers of every strategy at
    once would not fit).

    Every run trains the same steps on the same batches. ``baseline`` adds the ``none``
    strategy when it is missing (overhead needs it in every repeat). Each run's checkpoints are
    removed after it unless ``keep_checkpoints``. ``on_result(strategy, metrics)`` is called
    after every run; ``stop`` ends the comparison after the current step (the rows that could
    not finish are marked partial). Strategies that write local files only are skipped (with a
    message) for URLs; there each repeat writes under ``<directory>/repeat-<r>/`` and nothing
    is deleted (the bucket's retention is its owner's). ``warmup`` trains :data:`WARMUP_STEPS`
    untimed steps first and makes one unrecorded save per run.
    """
    check_run_args(steps, every)
    check_count(repeats, "repeats")
    if interleave not in ("cycle", "run"):
        raise ConfigError(f"interleave must be 'cycle' or 'run', not {interleave!r}")
    device = _resolve_device(workload, device)
    if not strategies:
        raise ConfigError("give at least one strategy to compare")
    options = {"storage_options": storage_options} if storage_options else {}
    # Strategies given by name start fresh each run; instances given are reopened.
    chosen = [(get_strategy(spec, **options), spec) for spec in strategies]
    names = [instance.name for instance, _ in chosen]
    if len(set(names)) != len(names):
        raise ConfigError(f"each strategy may appear once, got {', '.join(names)}")
    add_baseline = baseline and "none" not in names
    if add_baseline:
        chosen.insert(0, (get_strategy("none"), "none"))
        names.insert(0, "none")
    factories = {instance.name: _factory(spec, options) for instance, spec in chosen}
    say = progress or (lambda _line: None)
    warnings: list[str] = []
    if add_baseline:
        say("added the 'none' baseline: overhead is measured against it in every repeat")
    if is_url(directory):
        for instance, _ in chosen:
            if instance.local_only:
                say(f"skipping {instance.name}: it writes local files only, not to {directory}")
                names.remove(instance.name)
    else:
        directory = str(writable_directory(os.path.abspath(directory), "directory"))

    overall = LoadMonitor()
    say(f"workload {workload.describe()}")
    workload.build()
    floor_monitor = LoadMonitor()
    floors = measure_floors(workload.nbytes, directory, device, storage_options)
    floors_load = floor_monitor.stop()
    say(floors.describe())
    if warmup:
        for _ in range(WARMUP_STEPS):
            workload.train_step()

    order = run_order(names, repeats)
    run_rows: list[dict[str, Any]] = []
    by_strategy: dict[str, list[ExperimentResult]] = {name: [] for name in names}
    frames: list[pd.DataFrame] = []
    mode = _interleaving(interleave, workload, len(names), say)
    for repeat, names_in_order in enumerate(order):
        if stop is not None and stop.is_set():
            break
        say(f"repeat {repeat + 1}/{repeats}: {', '.join(names_in_order)}")
        # Local runs' checkpoints are removed after each run; objects stay in the user's bucket,
        # so each repeat gets a prefix of its own instead of saving the same steps again.
        where = f"{directory.rstrip('/')}/repeat-{repeat}" if is_url(directory) else directory
        groups = [names_in_order] if mode == "cycle" else [[name] for name in names_in_order]
        done: list[tuple[str, Strategy, ExperimentResult]] = []
        for group in groups:
            if stop is not None and stop.is_set():
                break
            lanes = [_Lane(name, factories[name](), workload, steps, every, device, on_event,
                           progress, repeat) for name in group]
            results_of_group = _run_lanes(lanes, where, steps, every, stop, warmup=warmup)
            done.extend((lane.name, lane.strategy, result)
                        for lane, result in zip(lanes, results_of_group, strict=True))
        for name, strategy, result in done:
            position = names_in_order.index(name)
            if not keep_checkpoints and strategy.writes_checkpoints:
                _remove(strategy.path)
            metrics = {**result.metrics(), "repeat": repeat, "position": position}
            run_rows.append(metrics)
            by_strategy[name].append(result)
            frame = result.timeline_frame()
            frame.insert(0, "repeat", repeat)
            frame.insert(0, "strategy", name)
            frames.append(frame)
            say(
                f"[{name}] mean step {metrics['mean_step_s']:.4f} s, stall per checkpoint "
                f"{metrics['stall_mean_s']:.4f} s over {metrics['checkpoints']} checkpoint(s)"
                + (" (stopped: partial)" if result.stopped else "")
            )
            if on_result is not None:
                on_result(name, metrics)

    load = overall.stop()
    for during, text in (("", load.warning()), ("while the floors were measured, ", floors_load.warning())):
        if text is not None:
            warnings.append(during + text)
    if repeats == 1 and baseline:
        warnings.append("a single repeat: the overhead intervals are a bootstrap over steps, "
                        "blind to drift between runs; use 3 or more repeats on a shared machine")
    stopped = sorted({str(row["strategy"]) for row in run_rows if row["stopped"]})
    if stopped:
        warnings.append(f"stopped before the end: {', '.join(stopped)}; partial runs are left "
                        "out of the overhead")
    for text in warnings:
        say(f"warning: {text}")

    runs = pd.DataFrame(run_rows)
    results = (
        _aggregate(by_strategy, floors) if run_rows else pd.DataFrame(columns=RESULT_COLUMNS)
    )
    timeline = (
        pd.concat(frames, ignore_index=True)[TIMELINE_COLUMNS] if frames
        else pd.DataFrame(columns=TIMELINE_COLUMNS)
    )
    return Comparison(
        results=results,
        runs=runs,
        timeline=timeline,
        floors=floors,
        workload=workload.describe(),
        device=device,
        directory=directory,
        environment=environment(device),
        steps=steps,
        every=every,
        repeats=repeats,
        bytes=workload.nbytes,
        order=order,
        interleave=mode,
        load={**load.to_dict(), "floors": floors_load.to_dict()},
        warnings=warnings,
    )


def _interleaving(interleave: str, workload: Workload, strategies: int, say: Progress) -> str:
    """``cycle`` or ``run``: ``cycle`` holds every strategy's buffers at once (up to two copies
    of the state each, nbckpt's staging and DCP's), which must fit in the memory free now."""
    if interleave == "cycle" and strategies > 1:
        needed = 2 * strategies * workload.nbytes
        available = psutil.virtual_memory().available
        if needed > available:
            say(f"interleaving whole runs, not checkpoint cycles: {strategies} strategies open at "
                f"once would hold about {format_bytes(needed)} and {format_bytes(available)} is free")
            return "run"
    return interleave


def _factory(spec: str | Strategy, options: dict[str, Any]) -> Callable[[], Strategy]:
    if isinstance(spec, Strategy):
        return lambda: spec
    return lambda: get_strategy(spec, **options)


def _remove(path: str) -> None:
    if is_url(path):
        return  # object stores: the user's bucket, the user's retention
    shutil.rmtree(path, ignore_errors=True)


