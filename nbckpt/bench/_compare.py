"""Run checkpoint strategies side by side on one workload and measure what each costs.

    >>> from nbckpt import bench
    >>> cmp = bench.compare(bench.gpt("tiny"), ["torch-save", "nbckpt-async"],
    ...                     "data/checkpoints/bench", steps=20, every=5, repeats=3)
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
- **One method for overhead**, stated once (:data:`nbckpt.bench.OVERHEAD_METHOD`, the
  docstring of the statistics module) and summed up under every table
  (:data:`nbckpt.bench.OVERHEAD_DEFINITION`): the ratio of each cycle's loop time to the same
  cycle of the ``none`` run beside it, averaged in log space, its 95 % interval clustered by
  repeat (cycles pooled when the repeats agree, the repeats alone when they do not, one repeat
  widened for what it cannot show). The table always shows the estimate, its interval, each
  repeat's overhead and what the row rests on; "no measurable difference" only stands beside
  an interval that contains 0.
- **The stall in two parts**: per checkpoint, the *save stall* (``save()``, and an overlapped
  copy's wait before the next update), the *wait for the earlier save* (backpressure), and the
  *stall*, their sum; the same three names in log lines, tables and figures.
- **The machine's load** (:class:`nbckpt.bench.Load`): load average, CPU steal (from
  ``/proc/stat`` via psutil) and the CPU that other processes used, per run and over the whole
  comparison; a warning is printed and stored when it is high.
- **Partial runs.** A run ended by ``stop`` is marked ``stopped``; a strategy whose every run
  was stopped is a ``partial`` row. Its overhead rests on the cycles completed before the stop
  and says so; conclusions leave it out.
- **Floors beside each repeat** (:func:`nbckpt.bench.measure_floors`): before every repeat, a
  copy of the same bytes into preallocated memory (one thread, and two as nbckpt stages), and
  the raw fsync'd write of the same bytes into the same directory measured exactly as ``nbckpt
  probe`` measures, at 1 and 2 streams; the fastest of all repeats is the floor. A save stall
  below the copy floor, or a write faster than the write floor, is flagged as a measurement
  problem (``floor_check``, and a warning).
- **Progress**: a line per checkpoint and per run: strategy, repeat, step, the stall in its
  parts, the time elapsed and the time the whole comparison is expected to take.

The metrics and the JSON document are described with :class:`nbckpt.bench.Comparison`.
From the shell (the default strategies, :data:`DEFAULT_STRATEGIES`, on the tiny preset)::

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json bench.json
    nbckpt bench --dir /mnt/flashblade/ckpt --preset small --strategies none,torch-save,nbckpt-async
"""

from __future__ import annotations

import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pandas as pd
import psutil
import torch

from .._errors import ConfigError
from .._util import GB, check_count, format_bytes, is_url, writable_directory
from .._version import __version__
from ._aggregate import RESULT_COLUMNS, aggregate
from ._comparison import TIMELINE_COLUMNS, Comparison
from ._load import Load, LoadMonitor, combine_loads
from ._measure import DEFAULT_REPEATS as WRITE_ROUNDS
from ._measure import Floors, combine_floors, measure_floors
from ._result import ExperimentResult
from ._runner import (
    EventCallback,
    Lane,
    Progress,
    RunProgress,
    check_run_args,
    resolve_device,
    run_lanes,
    stall_text,
)
from ._strategies import get_strategy
from ._strategy import Strategy
from ._workloads import Workload

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_STRATEGIES",
    "WARMUP_STEPS",
    "compare",
    "environment",
    "run_order",
]

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
#: Untimed training steps before the first run, so that no run pays for first-touch allocation.
WARMUP_STEPS = 2


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


def _cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what ``platform`` knows (on Linux
    ``platform.processor()`` is only the architecture, ``x86_64``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Where the numbers were measured."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nbckpt": __version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_memory_gb": round(psutil.virtual_memory().total / GB, 1),
        "device_name": torch.cuda.get_device_name() if device == "cuda" else _cpu_model(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def compare(
    workload: Workload,
    strategies: Sequence[str | Strategy],
    directory: str,
    *,
    steps: int = 20,
    every: int = 5,
    device: str | None = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: bool = True,
    on_event: EventCallback | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
    progress: Progress | None = print,
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
    device = resolve_device(workload, device)
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
    if warmup:
        for _ in range(WARMUP_STEPS):
            workload.train_step()

    order = run_order(names, repeats)
    run_rows: list[dict[str, Any]] = []
    by_strategy: dict[str, list[ExperimentResult]] = {name: [] for name in names}
    frames: list[pd.DataFrame] = []
    measured_floors: list[Floors] = []
    floor_loads: list[Load] = []
    mode = _interleaving(interleave, workload, strategies=len(names), say=say)
    tracker = RunProgress(progress, total_steps=steps * len(names) * repeats, repeats=repeats)
    for repeat, names_in_order in enumerate(order):
        if stop is not None and stop.is_set():
            break
        # The floors beside each repeat: they see the same moments of the machine as its runs.
        floor_monitor = LoadMonitor()
        measured_floors.append(measure_floors(
            workload.nbytes, directory, device=device, storage_options=storage_options,
            repeats=1 if repeats > 1 else WRITE_ROUNDS))
        floor_loads.append(floor_monitor.stop())
        floor = measured_floors[-1]
        say(f"repeat {repeat + 1}/{repeats}: {', '.join(names_in_order)}; floors beside it: copy "
            f"{floor.copy_gbs:.1f} GB/s, write {floor.write_gbs:.2f} GB/s; {tracker.timing()}")
        # Local runs' checkpoints are removed after each run; objects stay in the user's bucket,
        # so each repeat gets a prefix of its own instead of saving the same steps again.
        where = f"{directory.rstrip('/')}/repeat-{repeat}" if is_url(directory) else directory
        groups = [names_in_order] if mode == "cycle" else [[name] for name in names_in_order]
        done: list[tuple[str, Strategy, ExperimentResult]] = []
        for group in groups:
            if stop is not None and stop.is_set():
                break
            lanes = [Lane(name, factories[name](), workload, steps=steps, every=every, device=device,
                          on_event=on_event, progress=tracker, repeat=repeat) for name in group]
            results_of_group = run_lanes(lanes, where, steps=steps, every=every, stop=stop,
                                         warmup=warmup)
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
            say(_run_summary(name, repeat, repeats, metrics, stopped=result.stopped))
            if on_result is not None:
                on_result(name, metrics)

    load = overall.stop()
    floors = combine_floors(measured_floors) if measured_floors else measure_floors(
        workload.nbytes, directory, device=device, storage_options=storage_options)
    floors_load = combine_loads(floor_loads) or load
    say(floors.describe())
    for during, text in (("", load.warning()), ("while the floors were measured, ", floors_load.warning())):
        if text is not None:
            warnings.append(during + text)
    if repeats == 1 and baseline:
        warnings.append("a single repeat: its overhead intervals allow for the disagreement "
                        "between repeats that one repeat cannot show, so only a large effect is "
                        "measurable; use 3 or more repeats")
    stopped = sorted({str(row["strategy"]) for row in run_rows if row["stopped"]})
    if stopped:
        warnings.append(f"stopped before the end: {', '.join(stopped)}; their rows rest on the "
                        "cycles completed before the stop (see 'rests on')")

    runs = pd.DataFrame(run_rows)
    results = aggregate(by_strategy, floors) if run_rows else pd.DataFrame(columns=RESULT_COLUMNS)
    for row in results.to_dict(orient="records"):
        if row["floor_check"]:
            warnings.append(f"{row['strategy']}: {row['floor_check']}")
    for text in warnings:
        say(f"warning: {text}")
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


def _run_summary(name: str, repeat: int, repeats: int, metrics: dict[str, Any], *,
                 stopped: bool) -> str:
    """The progress line after a run: its mean step, and per checkpoint the stall in parts."""
    text = f"[{name}] repeat {repeat + 1}/{repeats} done: mean step {metrics['mean_step_s']:.4f} s"
    if metrics["checkpoints"]:
        parts = stall_text(metrics["stall_mean_s"], metrics["save_stall_s"], metrics["wait_s"])
        text += f"; per checkpoint {parts}, over {metrics['checkpoints']} checkpoint(s)"
    return text + (" (stopped: partial)" if stopped else "")


def _interleaving(interleave: str, workload: Workload, *, strategies: int, say: Progress) -> str:
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
