"""Run checkpoint strategies side by side on one workload and measure what each costs.

    >>> from nbckpt import experiment, workloads
    >>> cmp = experiment.compare(workloads.gpt("tiny"), ["none", "torch-save", "nbckpt-async"],
    ...                          "data/checkpoints/bench", steps=20, every=5)
    >>> cmp.results        # one row per strategy; cmp.timeline: every event; cmp.floors

Metrics (``Comparison.results`` columns):

- ``mean_step_s``: wall time of the training loop divided by its steps (stalls included).
- ``overhead_pct``: how much longer a typical step is than the ``none`` baseline's, where a
  typical step is the median step time (so background work slowing training counts) plus the
  save stalls spread over all steps; a median, because on a shared machine a few steps slowed
  by other processes can swamp a mean over a short run.
- ``stall_mean_s`` / ``stall_p95_s``: per checkpoint, the time the loop was blocked
  (``save`` plus, for overlapped saves, the wait before the next update).
- ``persist_s`` / ``write_gbs``: per checkpoint, time to write the data durably and its rate.
- ``peak_host_mb`` (RSS high-water, sampled every 10 ms) and ``peak_device_mb`` (CUDA), MiB.
- ``reduction_vs_torch_save``: torch-save's stall divided by this strategy's.
- ``stall_vs_copy_floor``: stall over the copy floor (same bytes into preallocated memory,
  device-to-host into pinned memory on CUDA); ``write_vs_floor_pct``: write rate as a
  percentage of the raw fsync'd write rate of the same directory.

From the shell (all 8 strategies on the tiny preset, about 30 s on 2 CPU cores)::

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json bench.json
    nbckpt bench --dir /mnt/flashblade/ckpt --preset small --strategies torch-save,nbckpt-async

``nbckpt bench`` (see :func:`add_arguments`) prints the table and writes JSON with this schema
(``"schema": "nbckpt.bench/1"``; missing numbers are ``null``)::

    {
      "schema": "nbckpt.bench/1",
      "workload": "gpt-tiny: 1.1M parameters, checkpoint 12.8 MB ...",
      "bytes": 12764368,                   # checkpoint size, bytes
      "device": "cpu", "directory": "/abs/path", "steps": 20, "every": 5, "repeats": 1,
      "environment": {"python": ..., "torch": ..., "nbckpt": ..., "platform": ..., "cpus": ...,
                      "torch_threads": ..., "device_name": ..., "time_utc": ...},
      "floors": {"bytes": ..., "sample_bytes": ..., "copy_s": ..., "copy_gbs": ...,
                 "write_s": ..., "write_gbs": ...},
      "results": [{"strategy": ..., "steps": ..., "checkpoints": ..., "mean_step_s": ...,
                   "stall_mean_s": ..., "stall_p95_s": ..., "overhead_pct": ..., "persist_s": ...,
                   "write_gbs": ..., "peak_host_mb": ..., "peak_device_mb": ...,
                   "reduction_vs_torch_save": ..., "stall_vs_copy_floor": ...,
                   "write_vs_floor_pct": ...}, ...],       # one per strategy
      "runs": [{"strategy": ..., "repeat": 0, <the same metrics for one run>,
                "wall_s": ..., "stopped": false}, ...],   # one per strategy and repeat
      "timeline": [{"strategy": ..., "repeat": ..., "kind": ..., "label": ..., "step": ...,
                    "rank": ..., "start_s": ..., "end_s": ..., "duration_s": ..., "bytes": ...,
                    "thread": ..., "pid": ..., "start_ns": ..., "end_ns": ...}, ...]
    }

Times are seconds, rates GB/s (1e9 bytes), memory MiB; ``start_s`` counts from the start
of that strategy's run (after its warm-up save).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import psutil
import torch

from ._dcp import is_url
from ._errors import ConfigError
from ._timeline import Event, Timeline, now_ns
from .strategies import STRATEGIES, Strategy, get_strategy
from .workloads import MIB, Workload, format_bytes, make_workload

SCHEMA = "nbckpt.bench/1"
RESULT_COLUMNS = [
    "strategy", "steps", "checkpoints", "mean_step_s", "stall_mean_s", "stall_p95_s",
    "overhead_pct", "persist_s", "write_gbs", "peak_host_mb", "peak_device_mb",
    "reduction_vs_torch_save", "stall_vs_copy_floor", "write_vs_floor_pct",
]
TIMELINE_COLUMNS = [
    "strategy", "repeat", "kind", "label", "step", "rank", "start_s", "end_s", "duration_s",
    "bytes", "thread", "pid", "start_ns", "end_ns",
]
# Floors are measured on at most this many bytes and scaled: rates are flat well below it.
FLOOR_SAMPLE_BYTES = 1 << 30
_WRITE_CHUNK = 8 * MIB
_MEMORY_SAMPLE_S = 0.01

EventCallback = Callable[[Event], None]
Progress = Callable[[str], None]


# -- floors ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floors:
    """What the hardware allows for ``bytes``: a copy into preallocated memory, a raw write."""

    bytes: int
    copy_s: float
    copy_gbs: float
    write_gbs: float
    write_s: float = math.nan
    sample_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"floors for {format_bytes(self.bytes)}: copy {self.copy_s:.4f} s "
            f"({self.copy_gbs:.1f} GB/s), fsync'd write {self.write_gbs:.2f} GB/s "
            f"({self.write_s:.3f} s)"
        )


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


def _write_floor(nbytes: int, directory: str, storage_options: dict[str, Any]) -> float:
    """Seconds to write ``nbytes`` in big chunks and make them durable; the file is removed."""
    chunk = os.urandom(min(_WRITE_CHUNK, nbytes))
    name = f".nbckpt-floor-{uuid.uuid4().hex[:8]}"
    if is_url(directory):
        from fsspec.core import url_to_fs

        fs, root = url_to_fs(directory, **storage_options)
        path = f"{root.rstrip('/')}/{name}"
        begin = time.perf_counter()
        try:
            with fs.open(path, "wb") as stream:
                for offset in range(0, nbytes, len(chunk)):
                    stream.write(chunk[: nbytes - offset])
            return time.perf_counter() - begin
        finally:
            if fs.exists(path):
                fs.rm_file(path)
    path = os.path.join(directory, name)
    begin = time.perf_counter()
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
    try:
        view = memoryview(chunk)
        for offset in range(0, nbytes, len(chunk)):
            part = view[: nbytes - offset]
            while part:
                part = part[os.write(fd, part):]
        os.fsync(fd)
        return time.perf_counter() - begin
    finally:
        os.close(fd)
        os.unlink(path)


def measure_floors(
    nbytes: int,
    directory: str,
    device: str = "cpu",
    storage_options: dict[str, Any] | None = None,
) -> Floors:
    """Measure the copy floor and the raw fsync'd write rate of ``directory`` for ``nbytes``.

    Up to :data:`FLOOR_SAMPLE_BYTES` are really copied and written; larger sizes are
    scaled linearly from that sample.
    """
    if nbytes <= 0:
        raise ConfigError(f"floors need a positive number of bytes, not {nbytes}")
    sample = min(nbytes, FLOOR_SAMPLE_BYTES)
    scale = nbytes / sample
    copy_s = _copy_floor(sample, device) * scale
    write_s = _write_floor(sample, directory, dict(storage_options or {})) * scale
    return Floors(
        bytes=nbytes,
        copy_s=copy_s,
        copy_gbs=nbytes / copy_s / 1e9,
        write_gbs=nbytes / write_s / 1e9,
        write_s=write_s,
        sample_bytes=sample,
    )


# -- one run -----------------------------------------------------------------------------------


class _MemorySampler:
    """Peak RSS of this process, sampled on a background thread while a run lasts."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, name="nbckpt-memory", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(_MEMORY_SAMPLE_S):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> _MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


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
    peak_host_mb: float
    peak_device_mb: float = math.nan
    stopped: bool = False
    events: list[Event] = field(default_factory=list)

    def _durations(self, kind: str) -> dict[int, float]:
        """Total duration of ``kind`` events per checkpoint step."""
        totals: dict[int, float] = {}
        for event in self.events:
            if event.kind == kind and event.step is not None:
                totals[event.step] = totals.get(event.step, 0.0) + event.duration_s
        return totals

    def metrics(self) -> dict[str, Any]:
        """Metrics of this run (the comparison adds those relative to other runs)."""
        return {
            "strategy": self.strategy,
            **_pooled([self]),
            "wall_s": self.wall_s,
            "bytes": self.bytes,
            "stopped": self.stopped,
        }

    def timeline_frame(self) -> pd.DataFrame:
        return self.timeline.to_pandas()


def _check_run_args(steps: int, every: int) -> None:
    for name, value in (("steps", steps), ("every", every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, not {value!r}")
    if every > steps:
        raise ConfigError(f"every ({every}) must not exceed steps ({steps}): nothing would be saved")


def _resolve_device(workload: Workload, device: str | None) -> str:
    if device is not None and device != workload.device:
        raise ConfigError(f"device {device!r} differs from the workload's device {workload.device!r}")
    return workload.device


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
) -> ExperimentResult:
    """Train ``steps`` steps, checkpoint every ``every`` with ``strategy``, record everything.

    ``on_event`` gets every event as it is recorded, on the thread that records it.
    Setting ``stop`` ends the run after the current step; saves in flight still commit.
    ``warmup`` makes one unrecorded save first (buffers, caches, spawned helpers).
    """
    _check_run_args(steps, every)
    device = _resolve_device(workload, device)
    chosen = get_strategy(strategy, **({"storage_options": storage_options} if storage_options else {}))
    workload.build()
    timeline = Timeline(label=chosen.name)
    recorded: list[Event] = []
    gate = threading.Event()  # closed during warm-up, so its events stay out

    def listen(event: Event) -> None:
        if gate.is_set():
            recorded.append(event)
            if on_event is not None:
                on_event(event)

    timeline.add_listener(listen)
    chosen.open(directory, timeline)
    try:
        if warmup and chosen.writes_checkpoints:
            chosen.save(workload.state(), 0)
            chosen.finish()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timeline.origin_ns = now_ns()
        gate.set()
        with _MemorySampler() as memory:
            wall_s, stopped = _train(workload, chosen, timeline, steps, every, stop, progress)
            chosen.finish()
    finally:
        chosen.close()
    gate.clear()
    result_timeline = Timeline(label=chosen.name)
    result_timeline.origin_ns = timeline.origin_ns
    result_timeline.extend(recorded)
    return ExperimentResult(
        strategy=chosen.name,
        workload=workload.describe(),
        device=device,
        steps=steps,
        every=every,
        bytes=workload.nbytes,
        timeline=result_timeline,
        wall_s=wall_s,
        peak_host_mb=memory.peak / MIB,
        peak_device_mb=torch.cuda.max_memory_allocated() / MIB if device == "cuda" else math.nan,
        stopped=stopped,
        events=recorded,
    )


def _train(
    workload: Workload,
    strategy: Strategy,
    timeline: Timeline,
    steps: int,
    every: int,
    stop: threading.Event | None,
    progress: Progress | None,
) -> tuple[float, bool]:
    """The training loop; returns its wall time and whether ``stop`` ended it early."""
    pending: list[int] = []  # the last checkpoint whose copy may still be running

    def before_update() -> None:
        begin = now_ns()
        strategy.before_step()
        if strategy.blocks_before_step and pending:
            timeline.record("stall", begin, step=pending.pop(), part="before_step")

    origin = now_ns()
    stopped = False
    for step in range(1, steps + 1):
        begin = now_ns()
        workload.train_step(before_update)
        timeline.record("step", begin, step=step)
        if strategy.writes_checkpoints and step % every == 0:
            begin = now_ns()
            strategy.save(workload.state(), step)
            stall = timeline.record("stall", begin, step=step, nbytes=workload.nbytes, part="save")
            pending[:] = [step]
            if progress is not None:
                progress(
                    f"[{strategy.name}] step {step}/{steps}: checkpoint stalled "
                    f"{stall.duration_s:.3f} s"
                )
        if stop is not None and stop.is_set():
            stopped = step < steps
            break
    wall_s = (now_ns() - origin) / 1e9
    return wall_s, stopped


# -- comparisons -------------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    """Where the numbers were measured."""
    from . import __version__

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
    """NaN and infinities become null; numpy scalars become Python numbers."""
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
            "environment": self.environment,
            "floors": {k: _json_value(v) for k, v in self.floors.to_dict().items()},
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
        """A readable table of the results, floors underneath."""
        shown = self.results.copy()
        formats = {
            "mean_step_s": "{:.4f}", "stall_mean_s": "{:.4f}", "stall_p95_s": "{:.4f}",
            "overhead_pct": "{:+.1f}", "persist_s": "{:.3f}", "write_gbs": "{:.2f}",
            "peak_host_mb": "{:.0f}", "peak_device_mb": "{:.0f}",
            "reduction_vs_torch_save": "{:.1f}x", "stall_vs_copy_floor": "{:.1f}x",
            "write_vs_floor_pct": "{:.0f}",
        }
        for column, fmt in formats.items():
            shown[column] = [
                "-" if value is None or not math.isfinite(value) else fmt.format(value)
                for value in shown[column]
            ]
        if self.device != "cuda":
            shown = shown.drop(columns=["peak_device_mb"])
        lines = [
            f"{self.workload}",
            f"{self.steps} steps, checkpoint every {self.every}, {self.repeats} repeat(s), "
            f"device {self.device}, directory {self.directory}",
            shown.to_string(index=False),
            self.floors.describe(),
        ]
        return "\n".join(lines)


def _pooled(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Metrics over the checkpoints of one or more runs of the same strategy."""
    steps = sum(1 for r in results for e in r.events if e.kind == "step")
    step_s = [e.duration_s for r in results for e in r.events if e.kind == "step"]
    save_stall_s = sum(
        e.duration_s for r in results for e in r.events
        if e.kind == "stall" and e.detail.get("part") == "save"
    )
    stalls = [s for r in results for s in r._durations("stall").values()]
    persists = [p for r in results for p in r._durations("persist").values()]
    persist_bytes = sum(e.bytes for r in results for e in r.events if e.kind == "persist")
    wall_s = sum(r.wall_s for r in results)
    return {
        "steps": steps,
        "checkpoints": len(stalls),
        "mean_step_s": wall_s / steps if steps else math.nan,
        # A typical step plus its share of the save stalls: robust to the odd step that another
        # process on a shared machine slowed down, which can swamp a mean over a short run.
        "typical_step_s": float(np.median(step_s)) + save_stall_s / steps if steps else math.nan,
        "stall_mean_s": float(np.mean(stalls)) if stalls else 0.0,
        "stall_p95_s": float(np.percentile(stalls, 95)) if stalls else 0.0,
        "persist_s": float(np.mean(persists)) if persists else math.nan,
        "write_gbs": persist_bytes / sum(persists) / 1e9 if sum(persists) > 0 else math.nan,
        "peak_host_mb": max(r.peak_host_mb for r in results),
        "peak_device_mb": max(r.peak_device_mb for r in results),
    }


def _aggregate(
    results: dict[str, list[ExperimentResult]], floors: Floors
) -> pd.DataFrame:
    rows = [{"strategy": name, **_pooled(runs)} for name, runs in results.items() if runs]
    frame = pd.DataFrame(rows)
    by_name: dict[str, dict[str, Any]] = {str(row["strategy"]): row for row in rows}
    baseline = float(by_name["none"]["typical_step_s"]) if "none" in by_name else math.nan
    torch_stall = (
        float(by_name["torch-save"]["stall_mean_s"]) if "torch-save" in by_name else math.nan
    )
    frame["overhead_pct"] = (frame.pop("typical_step_s") / baseline - 1) * 100
    frame.loc[frame["strategy"] == "none", "overhead_pct"] = 0.0
    frame["reduction_vs_torch_save"] = [
        torch_stall / stall if stall > 0 else math.nan for stall in frame["stall_mean_s"]
    ]
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
    repeats: int = 1,
    warmup: bool = True,
    on_event: EventCallback | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
    progress: Progress | None = print,
    *,
    storage_options: dict[str, Any] | None = None,
    keep_checkpoints: bool = False,
) -> Comparison:
    """Run each strategy in turn (``repeats`` rounds) on ``workload``; measure floors first.

    Every strategy trains the same steps on the same batches. Each one's checkpoints are
    removed after its run unless ``keep_checkpoints``. ``on_result(strategy, metrics)`` is
    called after every run; ``stop`` ends the comparison after the current step.
    Strategies that write local files only are skipped (with a message) for URLs.
    """
    _check_run_args(steps, every)
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, not {repeats!r}")
    device = _resolve_device(workload, device)
    if not strategies:
        raise ConfigError("give at least one strategy to compare")
    options = {"storage_options": storage_options} if storage_options else {}
    # Strategies given by name start fresh each run; instances given are reopened.
    factories = [(get_strategy(spec, **options), _factory(spec, options)) for spec in strategies]
    names = [instance.name for instance, _ in factories]
    if len(set(names)) != len(names):
        raise ConfigError(f"each strategy may appear once, got {', '.join(names)}")
    say = progress or (lambda _line: None)
    if is_url(directory):
        for instance, _ in factories:
            if instance.local_only:
                say(f"skipping {instance.name}: it writes local files only, not to {directory}")
        factories = [(i, f) for i, f in factories if not i.local_only]
    else:
        directory = os.path.abspath(directory)
        os.makedirs(directory, exist_ok=True)

    say(f"workload {workload.describe()}")
    workload.build()
    floors = measure_floors(workload.nbytes, directory, device, storage_options)
    say(floors.describe())

    run_rows: list[dict[str, Any]] = []
    by_strategy: dict[str, list[ExperimentResult]] = {i.name: [] for i, _ in factories}
    frames: list[pd.DataFrame] = []
    for repeat in range(repeats):
        for _, factory in factories:
            if stop is not None and stop.is_set():
                break
            strategy = factory()
            say(f"[{strategy.name}] repeat {repeat + 1}/{repeats}: {steps} steps, every {every}")
            result = run_experiment(
                workload, strategy, directory, steps, every, device, on_event, stop,
                warmup=warmup, progress=progress,
            )
            if not keep_checkpoints and strategy.writes_checkpoints:
                _remove(strategy.path)
            metrics = {**result.metrics(), "repeat": repeat}
            run_rows.append(metrics)
            by_strategy[strategy.name].append(result)
            frame = result.timeline_frame()
            frame.insert(0, "repeat", repeat)
            frame.insert(0, "strategy", strategy.name)
            frames.append(frame)
            say(
                f"[{strategy.name}] mean step {metrics['mean_step_s']:.4f} s, stall per "
                f"checkpoint {metrics['stall_mean_s']:.4f} s over {metrics['checkpoints']} "
                f"checkpoint(s)"
            )
            if on_result is not None:
                on_result(strategy.name, metrics)

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
    )


def _factory(spec: str | Strategy, options: dict[str, Any]) -> Callable[[], Strategy]:
    if isinstance(spec, Strategy):
        return lambda: spec
    return lambda: get_strategy(spec, **options)


def _remove(path: str) -> None:
    if is_url(path):
        return  # object stores: the user's bucket, the user's retention
    shutil.rmtree(path, ignore_errors=True)


# -- the `nbckpt bench` command ----------------------------------------------------------------

DEFAULT_STRATEGIES = list(STRATEGIES)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nbckpt bench``."""
    parser.add_argument("--dir", default="data/checkpoints/bench",
                        help="where checkpoints are written (a directory or s3:// URL)")
    parser.add_argument("--preset", default=None,
                        help="GPT workload preset: tiny, small, base, 350m, 1b, 3b (default tiny)")
    parser.add_argument("--size-mb", type=float, default=None,
                        help="synthetic workload: a state of this many MiB instead of a GPT")
    parser.add_argument("--compute-ms", type=float, default=5.0,
                        help="synthetic workload: compute per step in ms (default 5)")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="comma-separated strategies (default: all): " + ", ".join(STRATEGIES))
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (default 20)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every K steps (default 5)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the strategies")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for training (default: torch's choice); "
                        "fewer than the cores leaves room for background persistence, as on a GPU node")
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up save")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")


def _parse_strategies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--strategies names no strategy")
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        raise ConfigError(
            f"unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def _check_json_target(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"--json {path} is a directory; give a file name")
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(f"--json {path}: directory {parent} does not exist or is not writable")


def _prepare_directory(directory: str) -> bool:
    """Create ``directory`` if needed and prove it is writable; True if it was created here."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ConfigError(f"--dir {directory} is not writable (it is a file, not a directory)")
    created = not os.path.exists(directory)
    probe = os.path.join(directory, f".nbckpt-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(directory, exist_ok=True)
        with open(probe, "wb") as stream:
            stream.write(b"nbckpt")
        os.unlink(probe)
    except OSError as exc:
        if created and os.path.isdir(directory):
            shutil.rmtree(directory, ignore_errors=True)
        raise ConfigError(f"--dir {directory} is not writable ({exc.strerror or exc})") from exc
    return created


def run_from_args(args: argparse.Namespace, progress: Progress | None = None) -> Comparison:
    """Validate ``nbckpt bench``'s options first, then run the comparison (``%ckpt_bench`` too)."""
    if args.preset is not None and args.size_mb is not None:
        raise ConfigError("give --preset or --size-mb, not both")
    names = _parse_strategies(args.strategies)
    _check_run_args(args.steps, args.every)
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be a positive integer, not {args.repeats}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be a positive integer, not {args.threads}")
    if args.json is not None:
        _check_json_target(args.json)
    workload = make_workload(args.preset, args.size_mb, args.device, compute_ms=args.compute_ms)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    directory = args.dir
    created = False if is_url(directory) else _prepare_directory(directory)
    try:
        return compare(
            workload, names, directory, steps=args.steps, every=args.every, device=args.device,
            repeats=args.repeats, warmup=not args.no_warmup, progress=progress,
        )
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise


def main(args: argparse.Namespace) -> int:
    """``nbckpt bench``: run, print the table, write JSON."""
    comparison = run_from_args(args, None if args.quiet else _stderr_line)
    print(comparison.table())
    if args.json is not None:
        comparison.to_json(args.json)
        print(f"results written to {args.json}")
    return 0


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
