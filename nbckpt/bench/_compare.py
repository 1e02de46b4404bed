"""Run checkpoint strategies side by side on one workload and measure what each costs.

    >>> from nbckpt import bench
    >>> cmp = bench.compare(bench.make_workload("tiny"), ["torch-save", "nbckpt-async"],
    ...                     "data/checkpoints/bench", repeats=3)  # steps, every: measured first
    >>> print(cmp.table())  # overhead with its 95 % interval, stalls, floors, the machine's load
    >>> cmp.results         # one row per strategy; cmp.runs: one per run; cmp.timeline: events

Every repeat runs every strategy (and the ``none`` baseline, added when missing) on the same
steps and batches, in an order rotated by one place per repeat (:func:`run_order`). Within a
repeat the strategies take turns every checkpoint cycle, so that a burst of other work on a
shared machine falls on all of them alike: each one's clock only runs during its own turns, and
a turn ends by waiting for the strategy's background write (the wait its next save would have
had). Before every repeat the floors (:func:`~._measure.measure_floors`) are measured beside
it; the machine's load (:class:`~._load.Load`) is recorded per run and over the comparison.
How overhead and its interval come from the cycles is stated once, in
:data:`nbckpt.bench.OVERHEAD_METHOD`; the metrics and the JSON document are described with
:class:`nbckpt.bench.Comparison`. A line of progress per checkpoint and per run.

From the shell (:func:`add_bench_arguments` defines the options of ``nbckpt bench`` and
``%ckpt_bench`` once; without ``--strategies``, :data:`DEFAULT_STRATEGIES`)::

    nbckpt bench --dir data/checkpoints/bench --preset tiny --json bench.json
    nbckpt bench --dir /mnt/flashblade/ckpt --preset small --strategies none,torch-save,nbckpt-async
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, Protocol, TypeVar

import pandas as pd
import psutil
import torch

from .._errors import ConfigError
from .._util import GB, check_count, check_path, format_bytes, is_url, run_target, writable_directory
from .._version import __version__
from ._auto_interval import (
    CHECKPOINTS_PER_RUN,
    DEFAULT_STEPS,
    SAVES_PER_INTERVAL,
    check_interval_args,
    resolve_interval,
)
from ._comparison import TIMELINE_COLUMNS, Comparison
from ._load import Load, LoadMonitor, combine_loads
from ._measure import DEFAULT_REPEATS as WRITE_ROUNDS
from ._measure import Floors, combine_floors, measure_floors
from ._ranks import in_torchrun, on_ranks
from ._result import RESULT_COLUMNS, ExperimentResult, aggregate
from ._runner import (
    EventCallback,
    Lane,
    Progress,
    RunProgress,
    run_lanes,
    stall_text,
)
from ._strategies import STRATEGIES, get_strategy
from ._strategy import Strategy
from ._workloads import Workload, make_workload

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_STRATEGIES",
    "WARMUP_STEPS",
    "Coordination",
    "add_bench_arguments",
    "checked_bench",
    "compare",
    "environment",
    "queueing",
    "run_bench_from_args",
    "run_bench_on_ranks",
    "run_order",
    "strategy_names",
]

P = ParamSpec("P")
R = TypeVar("R")

#: Repeats ``compare`` and ``nbckpt bench`` run unless told otherwise: the fewest that give a
#: t-interval with a usable width, and one place in the rotation per strategy of a 3-way run.
DEFAULT_REPEATS = 3
#: What ``nbckpt bench`` runs without ``--strategies``: every built-in strategy.
DEFAULT_STRATEGIES = list(STRATEGIES)
#: Untimed training steps before the first run, so that no run pays for first-touch allocation.
WARMUP_STEPS = 2


class Coordination(Protocol):
    """How :func:`compare` runs as one rank of many (``nbckpt.bench._ranks.RankJob``): the
    strategies in their many-rank form, lanes that take their turns in lockstep with the other
    ranks, a measurement of all ranks at once before each repeat, and who removes checkpoints."""

    def strategy(self, strategy: Strategy) -> Strategy: ...

    def lane(
        self,
        name: str,
        strategy: Strategy,
        workload: Workload,
        *,
        steps: int,
        every: int,
        on_event: EventCallback | None,
        progress: RunProgress | None,
        repeat: int,
    ) -> Lane: ...

    def before_repeat(self, repeat: int, directory: str, storage_options: dict[str, Any] | None) -> None: ...

    def beside(self, repeat: int, directory: str, *, steps: int, every: int) -> list[Lane]:
        """Lanes that are no strategy's, taking turns with the repeat's strategies (their
        results stay out of the comparison's): a floor measured while the ranks train."""

    def remove(self, path: str) -> None: ...

    #: The bench's own gloo group (the ranks agree on a measured interval over it).
    group: Any

    def adopt(self, workload: Workload) -> Workload:
        """The workload as this rank holds it (replicated, sharded, or a state of its own)."""

    def gather_timeline(self, timeline: pd.DataFrame) -> list[dict[str, Any]]:
        """Every rank's events on the wall clock, on rank 0 (``[]`` elsewhere): a collective,
        after the comparison (``nbckpt.bench._rank_timeline``)."""


def run_order(names: Sequence[str], repeats: int) -> list[list[str]]:
    """The order of each repeat: ``names`` rotated by one place per repeat.

    With as many repeats as strategies every strategy runs once in every position, so a drift
    of the machine's speed over the comparison spreads evenly over the strategies.
    """
    check_count(repeats, "repeats")
    items = list(names)
    if not items:
        return [[] for _ in range(repeats)]
    return [items[r % len(items) :] + items[: r % len(items)] for r in range(repeats)]


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


class ComparisonInterrupted(KeyboardInterrupt):
    """Ctrl-C in a comparison, as one line saying what is left; still a KeyboardInterrupt."""

    def _render_traceback_(self) -> list[str]:
        # IPython's hook for exceptions that format themselves, looked up by name (no import):
        # a notebook shows this line instead of a traceback through every frame of the run
        return [f"KeyboardInterrupt: {self}"]


def _one_line_interrupt(function: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except ComparisonInterrupted:
            raise
        except KeyboardInterrupt:
            raise ComparisonInterrupted(
                "the comparison was stopped; the checkpoints its runs wrote were removed"
            ) from None

    return wrapper


@_one_line_interrupt
def compare(
    workload: Workload,
    strategies: str | Sequence[str | Strategy],
    directory: str,
    *,
    steps: int | None = None,
    every: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    warmup: bool = True,
    progress: Progress | None = print,
    stop: threading.Event | None = None,
    on_event: EventCallback | None = None,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    keep: bool = False,
    ranks: Coordination | None = None,
) -> Comparison:
    """Run every strategy on ``workload`` (on its device) in each of ``repeats`` repeats;
    ``strategies``: names or instances, or one text of names separated by commas.

    ``warmup`` trains :data:`WARMUP_STEPS` untimed steps first and makes one unrecorded save
    per run. ``stop`` ends the comparison after the current step (what could not finish is
    marked partial); ``on_event`` gets every event, ``on_result(strategy, metrics)`` every
    finished run. Strategies given by name start fresh each run, instances are reopened. Each
    run's checkpoints are removed after it, except in an object store (``storage_options``:
    fsspec's), where each repeat writes under ``<directory>/repeat-<r>/`` and strategies that
    write local files only are skipped. When the staging buffers of all strategies at once
    would not fit in free memory, they run one after the other instead of taking turns.
    ``keep`` keeps the checkpoints of the last repeat (to inspect or restore them).

    Under ``torchrun`` every rank calls it and runs as one rank of a bench on many, as ``nbckpt
    bench`` there: the strategies in their many-rank form, taking their turns in lockstep; a GPT
    replicated as under DDP, any other state each rank's own. Rank 0's comparison carries every
    rank's figures and the job's (``ranks``, ``job``, ``rank_timeline``); every other rank's is
    its own, and prints no progress. ``ranks`` (``nbckpt bench`` under torchrun gives it) is the
    coordination with the other ranks, the workload already adopted.

    ``every`` None: measured after the warm-up (:func:`~._auto_interval.choose_interval`), so that
    no save waits for the one before; ``steps`` None: a few such intervals (20 with ``every``). A
    given ``every`` whose saves queue says so in a warning (:func:`queueing`).
    """
    check_interval_args(steps, every)
    check_count(repeats, "repeats")
    strategies, directory = _checked_inputs(workload, strategies, directory)
    if ranks is None and in_torchrun():
        return on_ranks(
            workload.device,
            lambda job: compare(
                job.adopt(workload),
                strategies,
                directory,
                steps=steps,
                every=every,
                repeats=repeats,
                warmup=warmup,
                progress=progress if job.rank == 0 else None,
                stop=stop,
                on_event=on_event,
                on_result=on_result,
                storage_options=storage_options,
                keep=keep,
                ranks=job,
            ),
            keep=keep,
            repeats=repeats,
            write_beside=workload.device == "cpu" and not getattr(workload, "idle_compute", False),
        )
    say = progress or (lambda _line: None)
    lineup = _Lineup.of(strategies, directory, storage_options, ranks, say)
    overall = LoadMonitor()
    say(f"workload {workload.describe()}")
    workload.build()
    if warmup:
        for _ in range(WARMUP_STEPS):
            workload.train_step()
    group = None if ranks is None else ranks.group
    steps, every = resolve_interval(workload, lineup.directory, steps, every, storage_options, group, say)
    plan = _Plan(
        workload=workload,
        lineup=lineup,
        steps=steps,
        every=every,
        repeats=repeats,
        warmup=warmup,
        stop=stop,
        on_event=on_event,
        storage_options=storage_options,
        keep=keep,
        ranks=ranks,
        mode=_interleaving(workload, strategies=len(lineup.names), say=say),
        tracker=RunProgress(progress, total_steps=steps * len(lineup.names) * repeats, repeats=repeats),
    )
    order = run_order(lineup.names, repeats)
    tally = _Tally({name: [] for name in lineup.names})
    for repeat, names_in_order in enumerate(order):
        if stop is not None and stop.is_set():
            break
        for name, metrics, result in plan.run_repeat(repeat, names_in_order, tally, say):
            say(_run_summary(name, repeat, repeats, metrics, stopped=result.stopped))
            if on_result is not None:
                on_result(name, metrics)
    comparison = tally.comparison(plan, order, overall.stop(), say)
    if ranks is not None:  # every rank's events to rank 0, for the report's swimlanes
        comparison.rank_timeline = ranks.gather_timeline(comparison.timeline)
    return comparison


def _checked_inputs(
    workload: Workload, strategies: str | Sequence[str | Strategy], directory: str
) -> tuple[Sequence[str | Strategy], str]:
    """:func:`compare`'s strategies as a list and its directory, checked before anything is built or
    made: a text of names is split at commas (as ``sweep`` and ``--strategies`` take it), not read
    letter by letter; an empty directory is refused, not taken as the current one."""
    if not isinstance(workload, Workload):
        raise ConfigError(
            "compare() wants a Workload (make_workload(preset) or synthetic(size_mb) of nbckpt.bench), "
            f"not {type(workload).__name__} {repr(workload)[:80]}"
        )
    names = strategy_names(strategies) if isinstance(strategies, str) else list(strategies)
    return names, check_path(directory, "directory")


def strategy_names(text: str) -> list[str]:
    """``"dcp-sync, nbckpt-async"`` -> ``["dcp-sync", "nbckpt-async"]`` (empty names dropped)."""
    return [name.strip() for name in text.split(",") if name.strip()]


@dataclass
class _Lineup:
    """The strategies a comparison runs, by name (with the ``none`` baseline), how each run
    gets a fresh one, and the directory they write to."""

    names: list[str]
    factories: dict[str, Callable[[], Strategy]]
    directory: str

    @classmethod
    def of(
        cls,
        strategies: Sequence[str | Strategy],
        directory: str,
        storage_options: dict[str, Any] | None,
        ranks: Coordination | None,
        say: Progress,
    ) -> _Lineup:
        if not strategies:
            raise ConfigError("give at least one strategy to compare")
        options = {"storage_options": storage_options} if storage_options else {}
        # Strategies given by name start fresh each run; instances given are reopened.
        chosen = [(get_strategy(spec, **options), spec) for spec in strategies]
        names = [instance.name for instance, _ in chosen]
        if len(set(names)) != len(names):
            raise ConfigError(f"each strategy may appear once, got {', '.join(names)}")
        if "none" not in names:
            chosen.insert(0, (get_strategy("none"), "none"))
            say("added the 'none' baseline: overhead is measured against it in every repeat")
        if not is_url(directory):
            directory = str(writable_directory(os.path.abspath(directory), "directory"))
        kept = []
        for instance, spec in chosen:
            if is_url(directory) and instance.local_only:
                say(f"skipping {instance.name}: it writes local files only, not to {directory}")
            else:
                kept.append((instance.name, _factory(spec, options, ranks)))
        return cls([name for name, _ in kept], dict(kept), directory)


@dataclass
class _Plan:
    """What every repeat of a comparison runs, and how: :meth:`run_repeat` runs one."""

    workload: Workload
    lineup: _Lineup
    steps: int
    every: int
    repeats: int
    warmup: bool
    stop: threading.Event | None
    on_event: EventCallback | None
    storage_options: dict[str, Any] | None
    keep: bool
    ranks: Coordination | None
    mode: str
    tracker: RunProgress

    def run_repeat(
        self, repeat: int, names_in_order: list[str], tally: _Tally, say: Progress
    ) -> list[tuple[str, dict[str, Any], ExperimentResult]]:
        """Measure the floors beside the repeat, then run its strategies (taking turns every
        cycle, or one run after the other); each run's (name, metrics, result), tallied."""
        directory = self.lineup.directory
        if self.ranks is not None:  # every rank starts the repeat together (and after the last's cleanup)
            self.ranks.before_repeat(repeat, directory, self.storage_options)
        # The floors beside each repeat: they see the same moments of the machine as its runs.
        floor = tally.add_floors(self.workload, directory, self.storage_options, self.repeats)
        say(
            f"repeat {repeat + 1}/{self.repeats}: {', '.join(names_in_order)}; floors beside it: copy "
            f"{floor.copy_gbs:.1f} GB/s, write {floor.write_gbs:.2f} GB/s; {self.tracker.timing()}"
        )
        # Local runs' checkpoints are removed after each run; objects stay in the user's bucket,
        # so each repeat gets a prefix of its own instead of saving the same steps again.
        where = f"{directory.rstrip('/')}/repeat-{repeat}" if is_url(directory) else directory
        groups = [names_in_order] if self.mode == "cycle" else [[name] for name in names_in_order]
        done: list[tuple[str, ExperimentResult]] = []
        for index, group in enumerate(groups):
            if self.stop is not None and self.stop.is_set():
                break
            # The coordination's own lanes take their turns in the first group (all of them in
            # cycle mode), so that they meet the same moments of the machine as the strategies.
            beside = (
                self.ranks.beside(repeat, where, steps=self.steps, every=self.every)
                if (self.ranks is not None and index == 0)
                else []
            )
            done += self._run_group(group, repeat, where, beside)
        return [
            (name, tally.add_run(name, repeat, names_in_order.index(name), result), result)
            for name, result in done
        ]

    def _run_group(
        self, group: list[str], repeat: int, where: str, beside: list[Lane]
    ) -> list[tuple[str, ExperimentResult]]:
        """The strategies of ``group`` taking turns, with the lanes ``beside`` them (no
        strategy's: their results are not returned); each run's checkpoints go after it (unless
        kept: the last repeat's, with ``keep``; ``beside``'s always), after a Ctrl-C in it too."""
        make_lane = Lane if self.ranks is None else self.ranks.lane
        lanes = [
            make_lane(
                name,
                self.lineup.factories[name](),
                self.workload,
                steps=self.steps,
                every=self.every,
                on_event=self.on_event,
                progress=self.tracker,
                repeat=repeat,
            )
            for name in group
        ]
        kept = self.keep and repeat == self.repeats - 1
        try:
            results = run_lanes(
                [*lanes, *beside],
                where,
                steps=self.steps,
                every=self.every,
                stop=self.stop,
                warmup=self.warmup,
            )
        finally:
            for lane in [*([] if kept else lanes), *beside]:
                _remove_checkpoints(lane.strategy, self.ranks)
        return [(lane.name, result) for lane, result in zip(lanes, results[: len(lanes)], strict=True)]


@dataclass
class _Tally:
    """What a comparison's repeats measured, gathered as they finish: :meth:`comparison` turns
    it into the :class:`Comparison` with its warnings."""

    by_strategy: dict[str, list[ExperimentResult]]
    rows: list[dict[str, Any]] = field(default_factory=list)
    frames: list[pd.DataFrame] = field(default_factory=list)
    floors: list[Floors] = field(default_factory=list)
    floor_loads: list[Load] = field(default_factory=list)

    def add_floors(
        self, workload: Workload, directory: str, storage_options: dict[str, Any] | None, repeats: int
    ) -> Floors:
        monitor = LoadMonitor()
        self.floors.append(
            measure_floors(
                workload.nbytes,
                directory,
                device=workload.device,
                storage_options=storage_options,
                repeats=1 if repeats > 1 else WRITE_ROUNDS,
            )
        )
        self.floor_loads.append(monitor.stop())
        return self.floors[-1]

    def add_run(self, name: str, repeat: int, position: int, result: ExperimentResult) -> dict[str, Any]:
        metrics = {**result.metrics(), "repeat": repeat, "position": position}
        self.rows.append(metrics)
        self.by_strategy[name].append(result)
        frame = result.timeline_frame()
        frame.insert(0, "repeat", repeat)
        frame.insert(0, "strategy", name)
        self.frames.append(frame)
        return metrics

    def comparison(self, plan: _Plan, order: list[list[str]], load: Load, say: Progress) -> Comparison:
        workload, directory = plan.workload, plan.lineup.directory
        floors = (
            combine_floors(self.floors)
            if self.floors
            else measure_floors(
                workload.nbytes, directory, device=workload.device, storage_options=plan.storage_options
            )
        )
        floors_load = combine_loads(self.floor_loads) or load
        say(floors.describe())
        results = aggregate(self.by_strategy, floors) if self.rows else pd.DataFrame(columns=RESULT_COLUMNS)
        warnings = self._warnings(load, floors_load, results, plan)
        for text in warnings:
            say(f"warning: {text}")
        timeline = (
            pd.concat(self.frames, ignore_index=True)[TIMELINE_COLUMNS]
            if self.frames
            else pd.DataFrame(columns=TIMELINE_COLUMNS)
        )
        return Comparison(
            results=results,
            runs=pd.DataFrame(self.rows),
            timeline=timeline,
            floors=floors,
            workload=workload.describe(),
            device=workload.device,
            directory=directory,
            environment=environment(workload.device),
            steps=plan.steps,
            every=plan.every,
            repeats=plan.repeats,
            bytes=workload.nbytes,
            order=order,
            interleave=plan.mode,
            load={**load.to_dict(), "floors": floors_load.to_dict()},
            warnings=warnings,
        )

    def _warnings(self, load: Load, floors_load: Load, results: pd.DataFrame, plan: _Plan) -> list[str]:
        """What makes the numbers less sure: a busy machine, one repeat, stopped runs, a floor
        a strategy beat, saves queueing behind each other."""
        warnings = [
            during + text
            for during, text in (
                ("", load.warning()),
                ("while the floors were measured, ", floors_load.warning()),
            )
            if text is not None
        ]
        if plan.repeats == 1:
            warnings.append(
                "a single repeat: its overhead intervals allow for the disagreement "
                "between repeats that one repeat cannot show, so only a large effect is "
                "measurable; use 3 or more repeats"
            )
        stopped = sorted({str(row["strategy"]) for row in self.rows if row["stopped"]})
        if stopped:
            warnings.append(
                f"stopped before the end: {', '.join(stopped)}; their rows rest on the "
                "cycles completed before the stop (see 'rests on')"
            )
        warnings += [
            f"{row['strategy']}: {row['floor_check']}"
            for row in results.to_dict(orient="records")
            if row["floor_check"]
        ]
        queued = queueing(results, plan.every)
        return warnings if queued is None else [*warnings, queued]


def queueing(results: pd.DataFrame, every: int) -> str | None:
    """One line when checkpoints came faster than the asynchronous saves persist (the interval,
    ``every`` of the baseline's steps, shorter than a save's persist time): each save then waits
    for the one before it, which no training job that checkpoints every few minutes sees; None
    when every save persisted within the interval."""
    rows = results.set_index("strategy") if "strategy" in results.columns else results
    if "none" not in rows.index or not {"mean_step_s", "persist_s", "stall_mean_s"} <= set(rows.columns):
        return None
    step_s = float(rows["mean_step_s"]["none"])
    interval = every * step_s
    # A blocking save persists within its own stall; the save's own part of the stall, not the
    # wait for the save before it (which queueing adds to the stall), tells which one blocks.
    own = rows["save_stall_s"] if "save_stall_s" in rows.columns else rows["stall_mean_s"]
    slower = [
        (str(name), float(persist))
        for name, persist, stall in zip(rows.index, rows["persist_s"], own, strict=True)
        if name != "none" and float(persist) > max(interval, float(stall) * 1.05)
    ]
    if not slower or not interval > 0:
        return None
    longest = max(persist for _, persist in slower)
    steps = math.ceil(3 * longest / step_s)
    return (
        f"queueing regime: a checkpoint every {every} steps ({interval:.3f} s) came before the "
        f"previous save had persisted ({', '.join(f'{n} {p:.3f} s' for n, p in slower)}), so "
        f"saves waited for each other, which a training job checkpointing every few minutes "
        f"never sees; every {steps} steps or more (or longer steps) shows that regime"
    )


def _remove_checkpoints(strategy: Strategy, ranks: Any) -> None:
    """A run's local checkpoints (closed by then: run_lanes closes every lane it opened); on many
    ranks, rank 0 removes the shared folder once every rank is done with it."""
    if strategy.writes_checkpoints and strategy.path and not is_url(strategy.path):
        if ranks is None:
            shutil.rmtree(strategy.path, ignore_errors=True)
        else:
            ranks.remove(strategy.path)


def _run_summary(name: str, repeat: int, repeats: int, metrics: dict[str, Any], *, stopped: bool) -> str:
    """The progress line after a run: its mean step, and per checkpoint the stall in parts."""
    text = f"[{name}] repeat {repeat + 1}/{repeats} done: mean step {metrics['mean_step_s']:.4f} s"
    if metrics["checkpoints"]:
        parts = stall_text(metrics["stall_mean_s"], metrics["save_stall_s"], metrics["wait_s"])
        text += f"; per checkpoint {parts}, over {metrics['checkpoints']} checkpoint(s)"
    return text + (" (stopped: partial)" if stopped else "")


def _interleaving(workload: Workload, *, strategies: int, say: Progress) -> str:
    """``cycle`` or ``run``: ``cycle`` holds every strategy's buffers at once (up to two copies
    of the state each, nbckpt's staging and DCP's), which must fit in the memory free now."""
    if strategies > 1:
        needed = 2 * strategies * workload.nbytes
        available = psutil.virtual_memory().available
        if needed > available:
            say(
                f"interleaving whole runs, not checkpoint cycles: {strategies} strategies open at "
                f"once would hold about {format_bytes(needed)} and {format_bytes(available)} is free"
            )
            return "run"
    return "cycle"


def _factory(
    spec: str | Strategy, options: dict[str, Any], ranks: Coordination | None
) -> Callable[[], Strategy]:
    def make() -> Strategy:
        strategy = spec if isinstance(spec, Strategy) else get_strategy(spec, **options)
        return strategy if ranks is None else ranks.strategy(strategy)

    return make


# -- the options of ``nbckpt bench`` and ``%ckpt_bench``, defined once --------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nbckpt bench`` (and ``%ckpt_bench``)."""
    parser.add_argument(
        "-d",
        "--dir",
        default="data/checkpoints/bench",
        help="where checkpoints are written, a directory or s3:// URL (default: %(default)s)",
    )
    parser.add_argument(
        "--preset",
        default=None,
        help="GPT workload preset: tiny, small, base, 350m, 1b, 3b (default: tiny unless --size-mb is given)",
    )
    parser.add_argument(
        "--finetune",
        action="store_true",
        help="fine-tune the GPT preset: its base frozen, rank-8 low-rank adapters trained "
        "(compare nbckpt-incremental with the others on it; default: the whole GPT trained)",
    )
    parser.add_argument(
        "--size-mb",
        type=float,
        default=None,
        help="synthetic workload: a state of this many MiB instead of a GPT (default: none)",
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=5.0,
        help="synthetic workload: compute per step in ms (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-compute",
        action="store_true",
        help="synthetic workload: each step's compute stands for device compute, the host idle "
        "through it (the step waits --compute-ms, as a GPU node's CPU while its kernels run); "
        "default: matrix multiplies on the host's cores, as training on CPU",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(DEFAULT_STRATEGIES),
        help="comma-separated strategies, from: "
        + ", ".join(STRATEGIES)
        + " (default: %(default)s); none is added when missing",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"training steps per run (default: {CHECKPOINTS_PER_RUN} checkpoint intervals; "
        f"{DEFAULT_STEPS} with --every)",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=None,
        help=f"checkpoint every K steps (default: measured first, {SAVES_PER_INTERVAL}x a save to durable "
        "in steps, so that saves never queue)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help="repeats, each running every strategy in a rotated order (default: %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for training (default: one per core); fewer "
        "leaves a core for background writes, as on a GPU node",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip the warm-up steps and saves (default: warm up)"
    )
    parser.add_argument(
        "--json", default=None, metavar="OUT", help="write the results as JSON to OUT (default: no file)"
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress lines (default: one per checkpoint and per run, on stderr)",
    )


def _checked_bench_args(args: argparse.Namespace) -> list[str]:
    """The strategies ``--strategies`` names, once every option is known to be usable: a bad one
    fails here, before a workload is built or a directory made."""
    if args.preset is not None and args.size_mb is not None:
        raise ConfigError("give --preset or --size-mb, not both")
    if args.idle_compute and (args.size_mb is None or not args.compute_ms > 0):
        raise ConfigError(
            "--idle-compute stands in for the synthetic state's compute: "
            "give --size-mb and --compute-ms above 0"
        )
    names = strategy_names(args.strategies)
    if not names:
        raise ConfigError("--strategies names no strategy")
    for name in names:
        get_strategy(name)  # unknown: the one-line error that lists them
    check_interval_args(args.steps, args.every)
    check_count(args.repeats, "--repeats")
    if args.threads is not None:
        check_count(args.threads, "--threads")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            raise ConfigError(f"--json {args.json} is a directory; give a file name")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--json {args.json}: directory {parent} does not exist or is not writable")
    return names


def checked_bench(args: argparse.Namespace) -> tuple[list[str], Workload]:
    """The strategies and the workload (not built) that ``nbckpt bench``'s options name, every
    option checked: a bad one fails here in one line, before any memory, directory or rank."""
    names = _checked_bench_args(args)
    workload = make_workload(
        args.preset,
        args.size_mb,
        args.device,
        compute_ms=args.compute_ms,
        finetune=args.finetune,
        idle_compute=args.idle_compute,
    )
    return names, workload


def run_bench_from_args(
    args: argparse.Namespace,
    progress: Progress | None = None,
    *,
    ranks: Coordination | None = None,
    on_event: EventCallback | None = None,
) -> Comparison:
    """Validate ``nbckpt bench``'s options first, then run the comparison (``%ckpt_bench`` too);
    ``ranks``: as one rank of many (:func:`run_bench_on_ranks`); ``on_event``
    gets every event (``nbckpt bench --events``)."""
    names, workload = checked_bench(args)
    if ranks is not None:
        workload = ranks.adopt(workload)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with run_target(args.dir, "--dir"):
        return compare(
            workload,
            names,
            args.dir,
            steps=args.steps,
            every=args.every,
            repeats=args.repeats,
            warmup=not args.no_warmup,
            progress=progress,
            # nbckpt bench's own option (the live lab of %ckpt_bench removes them all)
            keep=getattr(args, "keep", False),
            ranks=ranks,
            on_event=on_event,
        )


def run_bench_on_ranks(
    args: argparse.Namespace, progress: Progress | None = None, on_event: EventCallback | None = None
) -> Comparison | None:
    """``nbckpt bench`` under torchrun: this rank's part of the bench on many ranks. Returns the
    comparison with the job's figures on rank 0, None on every other rank (rank 0 alone prints
    and writes results). ``on_event`` gets every event of this rank."""
    comparison = on_ranks(
        args.device,
        lambda job: run_bench_from_args(
            args, progress if job.rank == 0 else None, ranks=job, on_event=on_event
        ),
        sharded=args.fsdp,
        keep=bool(getattr(args, "keep", False)),
        repeats=args.repeats,
        # Where the host's cores train, its writes compete with training: the floor beside it too.
        write_beside=args.device == "cpu" and not args.idle_compute,
    )
    return comparison if comparison.job else None
