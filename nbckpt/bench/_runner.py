"""Training runs that checkpoint with a strategy and record everything: :func:`run_experiment`.

A run is a *lane*: one strategy's training, in chunks of one checkpoint cycle. A comparison
opens several lanes at once and runs their chunks in turn (:func:`run_lanes`); each lane's
clock, load record and timeline only run during its own chunks, so it reads as if it had
trained alone. Each chunk's loop time is kept (:class:`~._result.Cycle`): overhead pairs it
with the baseline's same chunk, trained beside it (:mod:`._stats`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import replace

import psutil
import torch

from .._errors import ConfigError
from .._util import MIB, check_count, format_duration
from ..engine import Event, Timeline
from ..engine._internal import now_ns
from ._load import Load, LoadMonitor, combine_loads
from ._result import STALL_NAMES, Cycle, ExperimentResult
from ._room import Room
from ._strategies import get_strategy
from ._strategy import WAIT_NOISE_NS, Strategy
from ._workloads import Workload

__all__ = [
    "EventCallback",
    "Lane",
    "Progress",
    "RunProgress",
    "check_run_args",
    "run_experiment",
    "run_lanes",
    "stall_text",
]

EventCallback = Callable[[Event], None]
Progress = Callable[[str], None]


class RunProgress:
    """Where a run or comparison is, for its progress lines: steps done of all, time taken and
    the time it will take in all at the pace so far (floors, warm-up and turns included)."""

    def __init__(self, say: Progress | None, *, total_steps: int, repeats: int = 1) -> None:
        self.say = say
        self.total_steps = max(total_steps, 1)
        self.repeats = repeats
        self.done = 0
        self.begin = time.perf_counter()

    def line(self, text: str) -> None:
        if self.say is not None:
            self.say(text)

    def step(self) -> None:
        self.done += 1

    def timing(self) -> str:
        """``12.3 s elapsed of about 41 s``: the expected total at the pace so far."""
        elapsed = time.perf_counter() - self.begin
        text = f"{format_duration(elapsed)} elapsed"
        if self.done:
            text += f" of about {format_duration(elapsed * self.total_steps / self.done)}"
        return text


def stall_text(stall_s: float, save_s: float, wait_s: float) -> str:
    """The stall of a checkpoint and its two parts, named as everywhere (``STALL_NAMES``)."""
    return (
        f"{STALL_NAMES['stall_mean_s']} {stall_s:.4f} s = {STALL_NAMES['save_stall_s']} "
        f"{save_s:.4f} s + {STALL_NAMES['wait_s']} {wait_s:.4f} s"
    )


def check_run_args(steps: int, every: int) -> None:
    """ConfigError unless ``steps`` and ``every`` make a run that saves at least once."""
    check_count(steps, "steps")
    check_count(every, "every")
    if every > steps:
        raise ConfigError(f"every ({every}) must not exceed steps ({steps}): nothing would be saved")


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _reset_peak_rss() -> tuple[int, bool]:
    """Start the kernel's peak RSS (VmHWM) again at the current RSS (writing 5 to
    /proc/self/clear_refs, Linux 4.0+: no sampling thread runs beside the measured runs); that
    RSS, and whether the reset took (a sandbox may refuse it, and VmHWM stays the process's peak)."""
    with suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    rss = _rss()
    return rss, _kernel_peak_rss() <= rss + (8 << 20)


def _kernel_peak_rss() -> int:
    """VmHWM: the peak RSS since the last reset (a huge number where the kernel does not say)."""
    with suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


class Lane:
    """One strategy's run, trained in chunks of one checkpoint cycle.

    In a repeat of several strategies the chunks of all strategies alternate (see
    :func:`nbckpt.bench.compare`); the lane's clock only runs during its own chunks, so its
    loop time, load record and timeline read as if it had trained alone. Each chunk starts
    with the checkpoint due before it (its copy or write then overlaps the chunk's steps, as
    in a training loop) and, when another strategy comes next, ends by waiting for the
    strategy's background work: that wait is what the next save would have waited for, and
    counts.
    """

    def __init__(
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
    ) -> None:
        self.name, self.strategy, self.workload = name, strategy, workload
        self.steps, self.every, self.device, self.repeat = steps, every, workload.device, repeat
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
        self.last_saved: int | None = None
        self.loads: list[Load] = []
        self.monitor: LoadMonitor | None = None
        self.held_rss = 0  # what opening and the warm-up save left resident
        self.rss_at_resume, self._kernel_peak = 0, False
        self.peak_above = 0  # the most RSS rose above its level at the start of a chunk
        self.peak_device = 0
        self.engine_cpu_s: float | None = None
        self.finished = False  # every chunk ran, the final checkpoint included
        self.cycles: list[Cycle] = []
        self._blocked_ns = 0  # stall recorded in the current chunk
        self._inner_wait_ns = 0  # the strategy's own backpressure waits in the current save
        self._waited: dict[int, float] = {}  # wait for the earlier save, by the save it preceded

    def _listen(self, event: Event) -> None:
        if not self.active:
            return
        if event.kind == "stall":
            self._blocked_ns += event.end_ns - event.start_ns
        elif event.kind == "wait":
            self._inner_wait_ns += event.end_ns - event.start_ns
        moved = replace(event, start_ns=event.start_ns - self.shift_ns, end_ns=event.end_ns - self.shift_ns)
        self.recorded.append(moved)
        if self.on_event is not None:
            self.on_event(moved)

    def open(self, directory: str, warmup: bool) -> None:
        before = _rss()
        self.strategy.open(directory, self.timeline)
        if warmup and self.strategy.writes_checkpoints:
            self.strategy.save(self.workload.state(), 0)
            self.strategy.before_step()
            self.strategy.finish()
        self.held_rss = max(_rss() - before, 0)

    def resume(self) -> None:
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
        self.rss_at_resume, self._kernel_peak = _reset_peak_rss()
        self.monitor = LoadMonitor()
        self.active = True

    def _before_update(self) -> None:
        begin = now_ns()
        self.strategy.before_step()
        if self.strategy.blocks_before_step and self.pending:
            self.timeline.record("stall", begin, step=self.pending.pop(), part="before_step")

    def chunk(self, first: int, last: int, stop: threading.Event | None) -> bool:
        """Save the checkpoint due after step ``first - 1``, then train ``first..last``;
        False when ``stop`` ended it early (the cycle is then not kept)."""
        begin = now_ns()
        self._blocked_ns = 0
        completed = False
        saved = 0
        try:
            due = first - 1
            if self.strategy.writes_checkpoints and due > 0 and due % self.every == 0:
                self.workload.step = due
                self._inner_wait_ns = 0
                started = now_ns()
                self.strategy.save(self.workload.state(), due)
                stall = self.timeline.record(
                    "stall", started, step=due, nbytes=self.workload.nbytes, part="save"
                )
                saved = 1
                self.pending[:] = [due]
                self.last_saved = due
                self._report_save(due, stall.duration_s)
                if stop is not None and stop.is_set() and due < self.steps:
                    return False
            for step in range(first, last + 1):
                self.workload.step = step - 1  # every lane trains on the same batches
                started = now_ns()
                self.workload.train_step(self._before_update)
                self.timeline.record("step", started, step=step)
                if self.progress is not None:
                    self.progress.step()
                if stop is not None and stop.is_set() and step < self.steps:
                    return False
            completed = True
            return True
        finally:
            elapsed = now_ns() - begin
            self.loop_ns += elapsed
            if completed:
                self.cycles.append(
                    Cycle(
                        steps=last - first + 1,
                        loop_s=elapsed / 1e9,
                        stall_s=self._blocked_ns / 1e9,
                        checkpoints=saved,
                    )
                )

    def _report_save(self, step: int, stall_s: float) -> None:
        """One progress line per checkpoint: its stall and the stall's two parts."""
        if self.progress is None:
            return
        inner = min(self._inner_wait_ns / 1e9, stall_s)
        wait = self._waited.pop(step, 0.0) + inner
        save = stall_s - inner
        self.progress.line(
            f"[{self.name}] repeat {self.repeat + 1}/{self.progress.repeats}, step {step}/"
            f"{self.steps}: {stall_text(save + wait, save, wait)}; {self.progress.timing()}"
        )

    def settle(self, next_save: int | None, *, final: bool = False) -> None:
        """Wait for the strategy's background work. Before another lane runs, the wait stands
        for the backpressure the next save (``next_save``) would have met; after the final
        cycle (``final``) it is the wait for the last checkpoint's write. Both count, in the
        cycle just run (the write waited for is that cycle's), so every checkpoint's write
        counts once; a wait after a stop does not."""
        begin = now_ns()
        self.strategy.finish()
        waited = now_ns() - begin
        if waited <= WAIT_NOISE_NS:
            return
        if next_save is not None:
            self.timeline.record("stall", begin, step=next_save, part="wait")
            self._waited[next_save] = waited / 1e9
        elif final and self.last_saved is not None:
            self.timeline.record("stall", begin, step=self.last_saved, part="final")
        else:
            return
        self.loop_ns += waited
        if self.cycles:
            last = self.cycles[-1]
            self.cycles[-1] = replace(
                last, loop_s=last.loop_s + waited / 1e9, stall_s=last.stall_s + waited / 1e9
            )

    def pause(self) -> None:
        if not self.active:
            return
        if self.monitor is not None:
            self.loads.append(self.monitor.stop())
        peak = _kernel_peak_rss() if self._kernel_peak else _rss()  # else: the RSS at the turn's end
        self.peak_above = max(self.peak_above, peak - self.rss_at_resume)
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
            bytes=self.workload.nbytes,
            timeline=timeline,
            wall_s=self.loop_ns / 1e9,
            peak_host_mb=(base_rss + self.held_rss + self.peak_above) / MIB,
            peak_device_mb=self.peak_device / MIB if self.device == "cuda" else math.nan,
            stopped=not self.finished,
            events=list(self.recorded),
            load=combine_loads(self.loads),
            repeat=self.repeat,
            engine_cpu_s=math.nan if self.engine_cpu_s is None else self.engine_cpu_s,
            cycles=list(self.cycles),
            stall_covers_copy=self.strategy.stall_covers_copy,
        )


def run_lanes(
    lanes: list[Lane],
    directory: str,
    *,
    steps: int,
    every: int,
    stop: threading.Event | None,
    warmup: bool,
) -> list[ExperimentResult]:
    """Open every lane, run their chunks in turn (rotated by one place per cycle), close them.
    A cycle whose saves cannot fit in ``directory`` ends the run first, in a one-line
    ConfigError (:class:`~._room.Room`).

    With one lane the chunks run back to back: a plain training run. The last cycle holds
    only the final checkpoint, when ``steps`` is a multiple of ``every``.
    """
    cycles = [(first, min(first + every - 1, steps)) for first in range(1, steps + 1, every)]
    if steps % every == 0:
        cycles.append((steps + 1, steps))  # the final checkpoint, no steps after it
    room, shares = Room.of(directory), [(lane.strategy, lane.workload.share_bytes) for lane in lanes]
    opened: list[Lane] = []
    base_rss = _rss()
    try:
        for lane in lanes:
            opened.append(lane)
            lane.open(directory, warmup)
        alone = len(lanes) == 1
        stopped = False
        for index, (first, last) in enumerate(cycles):
            room.check(shares, index, len(cycles))  # each cycle after the first starts with saves
            final = index == len(cycles) - 1
            for lane in lanes[index % len(lanes) :] + lanes[: index % len(lanes)]:
                if stop is not None and stop.is_set() and not alone:
                    stopped = True
                    break
                lane.resume()
                completed = lane.chunk(first, last, stop)
                if not alone or final or not completed:
                    # The next chunk starts with the checkpoint of step `last`, if one is due.
                    due = last if completed and not final and last % every == 0 else None
                    lane.settle(due, final=completed and final)
                    lane.pause()
                lane.finished = completed and final
                if not completed:
                    stopped = True
                    break
            if stopped:
                break
        for lane in lanes:
            if lane.active:  # alone and stopped between steps: wait for its saves
                lane.settle(None)
                lane.pause()
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
    *,
    steps: int,
    every: int,
    on_event: EventCallback | None = None,
    stop: threading.Event | None = None,
    warmup: bool = False,
) -> ExperimentResult:
    """One strategy's run alone: train ``steps`` steps, checkpoint every ``every``, record
    everything (``on_event`` gets each event, ``stop`` ends the run after the current step,
    ``warmup`` makes one unrecorded save first)."""
    check_run_args(steps, every)
    chosen = get_strategy(strategy)
    workload.build()
    lane = Lane(
        chosen.name, chosen, workload, steps=steps, every=every, on_event=on_event, progress=None, repeat=0
    )
    return run_lanes([lane], directory, steps=steps, every=every, stop=stop, warmup=warmup)[0]
