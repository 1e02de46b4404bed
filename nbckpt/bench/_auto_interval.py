"""The checkpoint interval a comparison uses when it is not given: measured, not guessed.

A fixed default (every 5 steps of a few milliseconds) put every run in the queueing regime: a
checkpoint came before the previous one had persisted, so each save waited for the one before,
which a training job checkpointing every few minutes never sees (async +557 % against
torch-save +635 %, issue 29 defect 7). A short probe (:func:`choose_interval`) times a few
training steps and a save of the state to the target, to durable, and checkpoints every
:data:`SAVES_PER_INTERVAL` saves' worth of steps; a run lasts :data:`CHECKPOINTS_PER_RUN`
intervals unless its steps are given.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._util import check_count, is_url
from ._measure import measure_write, scratch
from ._runner import check_run_args
from ._strategy import plain_state
from ._workloads import Workload

__all__ = [
    "CHECKPOINTS_PER_RUN",
    "PROBE_SAVES",
    "PROBE_STEPS",
    "SAVES_PER_INTERVAL",
    "Interval",
    "choose_interval",
]

#: The interval is this many times the probe's save to durable: room for the write to run
#: slower beside training (and a loaded machine) than alone, and still be done in time.
SAVES_PER_INTERVAL = 4
#: Checkpoints in a run whose steps are not given: enough cycles for each repeat's overhead.
CHECKPOINTS_PER_RUN = 4
#: Timed steps and saves of the probe; the fastest step and the slowest save count, so that the
#: interval errs long (a burst of other work can only slow a step down, or a save).
PROBE_STEPS = 3
PROBE_SAVES = 2
#: Steps of a run when ``every`` is given and ``steps`` is not.
DEFAULT_STEPS = 20


@dataclass(frozen=True)
class Interval:
    """The steps and checkpoint interval chosen, and what the probe measured."""

    every: int
    steps: int
    step_s: float  # the fastest probe step
    save_s: float  # the slowest probe save, to durable
    fits: bool  # False: the given steps are fewer than the interval that keeps saves apart

    def describe(self) -> str:
        """One line: the interval and why."""
        text = (
            f"checkpoint every {self.every} steps, measured: a step {1e3 * self.step_s:.1f} ms, a save "
            f"to durable {1e3 * self.save_s:.1f} ms: {SAVES_PER_INTERVAL}x the save between checkpoints, "
            f"so that each save is durable before the next, as in a training job (a warning "
            f"follows if one was not); {self.steps} steps a run"
        )
        if not self.fits:
            text += (
                f" (the given steps allow no longer interval: saves may queue; give --steps "
                f"{CHECKPOINTS_PER_RUN * self.needed} or --every)"
            )
        return text

    @property
    def needed(self) -> int:
        """Steps between checkpoints that keep saves apart, as measured."""
        return max(1, math.ceil(SAVES_PER_INTERVAL * self.save_s / self.step_s)) if self.step_s > 0 else 1


def _step_s(workload: Workload) -> float:
    """The fastest of :data:`PROBE_STEPS` training steps (CUDA: synchronized)."""
    times = []
    for _ in range(PROBE_STEPS):
        started = time.perf_counter()
        workload.train_step()
        if workload.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times)


def _save_s(workload: Workload, directory: str, storage_options: dict[str, Any] | None) -> float:
    """The slowest of :data:`PROBE_SAVES` saves of the state to ``directory``, to durable: a
    ``torch.save`` with fsync (the slowest strategy's write) in a scratch folder removed after;
    an object store: the same bytes written as the storage probe writes them."""
    if is_url(directory):
        runs = measure_write(directory, workload.nbytes, repeats=PROBE_SAVES, storage_options=storage_options)
        return max(runs[0].write_rounds_s or (runs[0].write_s,))
    times = []
    with scratch(directory, None) as (_fs, work):
        for index in range(PROBE_SAVES):
            started = time.perf_counter()
            with open(os.path.join(work, f"probe-{index}.pt"), "wb") as stream:
                torch.save(plain_state(workload.state()), stream)
                stream.flush()
                os.fsync(stream.fileno())
            times.append(time.perf_counter() - started)
    return max(times)


def choose_interval(
    workload: Workload,
    directory: str,
    *,
    steps: int | None,
    storage_options: dict[str, Any] | None = None,
    agree: Any = None,
) -> Interval:
    """Time ``workload``'s (built) steps and a save to ``directory``, and checkpoint every
    :data:`SAVES_PER_INTERVAL` saves' worth of steps; ``steps`` None: :data:`CHECKPOINTS_PER_RUN`
    intervals; given steps fewer than the interval cap it there (``fits`` False). ``agree``: a
    function that makes every rank of a bench on many use the same (the largest) interval."""
    measured = Interval(
        every=1,
        steps=1,
        step_s=_step_s(workload),
        save_s=_save_s(workload, directory, storage_options),
        fits=True,
    )
    needed = measured.needed if agree is None else int(agree(measured.needed))
    run_steps = CHECKPOINTS_PER_RUN * needed if steps is None else steps
    return Interval(
        every=min(needed, run_steps),
        steps=run_steps,
        step_s=measured.step_s,
        save_s=measured.save_s,
        fits=needed <= run_steps,
    )


def check_interval_args(steps: int | None, every: int | None) -> None:
    """ConfigError unless ``steps`` and ``every`` make a run that saves (None: to be measured)."""
    if every is not None:
        check_run_args(DEFAULT_STEPS if steps is None else steps, every)
    elif steps is not None:
        check_count(steps, "steps")


def resolve_interval(
    workload: Workload,
    directory: str,
    steps: int | None,
    every: int | None,
    storage_options: dict[str, Any] | None,
    group: Any,
    say: Callable[[str], None],
) -> tuple[int, int]:
    """The steps and interval given, or those :func:`choose_interval` measures (said in a line);
    ``group``: the process group of a bench on many ranks, None on one."""
    if every is not None:
        return (DEFAULT_STEPS if steps is None else steps), every
    interval = choose_interval(
        workload, directory, steps=steps, storage_options=storage_options, agree=agree_largest(group)
    )
    say(interval.describe())
    return interval.steps, interval.every


def agree_largest(group: Any) -> Callable[[int], int] | None:
    """On many ranks (``group`` not None): the largest of every rank's measured interval, so that
    all save at the same steps (their saves are collective)."""
    if group is None:
        return None

    def largest(value: int) -> int:
        import torch.distributed as dist

        agreed = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        return int(agreed.item())

    return largest
