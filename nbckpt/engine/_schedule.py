"""When to save: the interval that loses the least training time, from what this run's saves cost
and how often the job fails (Young 1974, Daly 2006).

A first-order model, valid while cost and interval are small against the MTBF. With a cost per
save ``C = stall + drag`` (the time training stops, and the time the background write slows it),
interval ``tau`` and job MTBF ``M``::

    waste(tau) = C / tau + (tau / 2 + lag + R) / M

Each failure loses half an interval of work, the restore time ``R`` and, for an asynchronous save,
the ``lag`` until the snapshot is durable. With one save in flight a save is never due before the
one before it is durable: the interval is never shorter than the persist time.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._errors import ConfigError
from .._util import check_count, format_duration, parse_duration
from ._timeline import SaveRecord

__all__ = [
    "JOB_MTTF_H",
    "Costs",
    "Grace",
    "Interval",
    "Pacer",
    "SaveSchedule",
    "expected_waste",
    "final_save_s",
    "job_mtbf_s",
    "young_daly_interval",
]

HOUR_S = 3600.0
#: How many recent saves (and steps) the measured costs are taken over: the schedule follows
#: costs that change (a fuller disk, a bigger state) within a few saves.
RECENT = 5
#: With several ranks, the most steps between two of rank 0's decisions: each costs a collective,
#: and a count of steps cannot see the steps slow down (a save is at most this many steps late).
ASK_AT_MOST = 50
#: Job mean time to failure against job size (GPUs, hours), as fitted by Meta on its research
#: clusters: Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research
#: Clusters", HPCA 2025 (arXiv 2410.21680).
JOB_MTTF_H = ((1024, 7.9), (16384, 1.8), (131072, 14.0 / 60.0))


def young_daly_interval(cost_s: float, mtbf_s: float, method: str = "daly") -> float:
    """Checkpoint interval (seconds of training between checkpoints) that minimises lost time.

    ``method="young"``: ``sqrt(2 C M)``. ``method="daly"`` (Daly 2006, higher order):
    ``sqrt(2 C M) (1 + sqrt(C / 2M) / 3 + C / 18M) - C`` for ``C < 2M``, else ``M``.
    """
    if not cost_s >= 0 or math.isinf(cost_s):
        raise ConfigError(f"checkpoint cost must be a finite number >= 0 seconds, got {cost_s}")
    if not mtbf_s > 0 or math.isinf(mtbf_s):
        raise ConfigError(f"MTBF must be a finite number > 0 seconds, got {mtbf_s}")
    young = math.sqrt(2.0 * cost_s * mtbf_s)
    if method == "young":
        return young
    if method != "daly":
        raise ConfigError(f"unknown interval method {method!r}: use 'young' or 'daly'")
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2.0 * mtbf_s)
    return young * (1.0 + math.sqrt(ratio) / 3.0 + cost_s / (18.0 * mtbf_s)) - cost_s


def expected_waste(
    interval_s: float, cost_s: float, mtbf_s: float, *, lag_s: float = 0.0, restore_s: float = 0.0
) -> float:
    """Fraction of time lost, ``C / tau + (tau / 2 + lag + R) / M``, at most 1 (see module doc)."""
    if not interval_s > 0:
        raise ConfigError(f"checkpoint interval must be > 0 seconds, got {interval_s}")
    if not mtbf_s > 0:
        raise ConfigError(f"MTBF must be > 0 seconds, got {mtbf_s}")
    if min(cost_s, lag_s, restore_s) < 0:
        raise ConfigError("checkpoint cost, lag and restore time must be >= 0 seconds")
    waste = cost_s / interval_s + (interval_s / 2.0 + lag_s + restore_s) / mtbf_s
    return min(waste, 1.0)


def job_mtbf_s(gpus: int) -> float:
    """A job's MTBF from its size, through :data:`JOB_MTTF_H` (straight lines on log-log axes
    between the published points; beyond them, the nearest segment's slope)."""
    check_count(gpus, "gpus")
    points = [(math.log(n), math.log(h)) for n, h in JOB_MTTF_H]
    x = math.log(gpus)
    (x0, y0), (x1, y1) = points[:2] if x < points[1][0] else points[1:]
    return math.exp(y0 + (y1 - y0) * (x - x0) / (x1 - x0)) * HOUR_S


@dataclass(frozen=True)
class Costs:
    """What one save costs this run, in seconds."""

    stall_s: float
    """Training stopped (the copy, and any wait for the save before)."""
    drag_s: float
    """Training slowed by the background write, summed over the steps it overlapped."""
    persist_s: float
    """From the save's start to durable: the shortest interval one save in flight allows; beyond
    the stall, the lag (the work done meanwhile is lost if a failure comes before)."""
    restore_s: float
    """Restoring after a failure."""


@dataclass(frozen=True)
class Interval:
    """The advised time between saves and why."""

    seconds: float
    bound: str
    """``"daly"``: the optimum of the model; ``"persist"``: the background write's pace."""
    reason: str
    """One line saying how it was chosen."""
    daly_s: float
    """The Young/Daly optimum alone (``seconds`` where ``bound`` is ``"daly"``): a schedule saves
    once this long has passed and the save before is durable."""


class SaveSchedule:
    """Save every :meth:`interval` seconds, from a job MTBF given as ``mtbf`` (seconds or a
    duration such as ``"8h"``) or derived from the job's size (``gpus``, through Meta's fits,
    :data:`JOB_MTTF_H`). Give it to a Checkpointer (``Checkpointer(..., schedule=...)``) and ask
    ``ckpt.due()`` each step."""

    def __init__(self, mtbf: float | str | None = None, *, gpus: int | None = None) -> None:
        if (mtbf is None) == (gpus is None):
            raise ConfigError("SaveSchedule needs one of mtbf (the job's, e.g. '8h') or gpus (its size)")
        if mtbf is not None:
            self.mtbf_s = parse_duration(mtbf, "mtbf")
            self.source = f"an MTBF of {format_duration(self.mtbf_s)}"
        else:
            self.mtbf_s = job_mtbf_s(check_count(gpus, "gpus"))
            self.source = (
                f"a job MTBF of {format_duration(self.mtbf_s)} at {gpus:,} GPUs "
                "(Meta's fit, Kokolis et al., HPCA 2025)"
            )

    def interval(self, costs: Costs) -> Interval:
        """The interval for ``costs``: the Young/Daly optimum, never shorter than the persist time."""
        cost = costs.stall_s + costs.drag_s
        optimum = young_daly_interval(cost, self.mtbf_s)
        seconds, bound = (optimum, "daly") if optimum >= costs.persist_s else (costs.persist_s, "persist")
        lag = max(costs.persist_s - costs.stall_s, 0.0)  # a sync save's: none
        waste = expected_waste(max(seconds, 1e-9), cost, self.mtbf_s, lag_s=lag, restore_s=costs.restore_s)
        why = (
            f"Young/Daly for {format_duration(cost)} a save (stall {format_duration(costs.stall_s)}, "
            f"drag {format_duration(costs.drag_s)}) and {self.source}"
            if bound == "daly"
            else f"the background write's {format_duration(costs.persist_s)} (Young/Daly for "
            f"{format_duration(cost)} a save and {self.source} would save every "
            f"{format_duration(optimum)}: faster than one save in flight can persist)"
        )
        reason = f"save every {format_duration(seconds)}: {why}; expected loss {100 * waste:.2g} % of time"
        return Interval(seconds, bound, reason, optimum)

    def __repr__(self) -> str:
        return f"SaveSchedule(mtbf_s={self.mtbf_s:.6g})"


def final_save_s(records: Sequence[SaveRecord]) -> float | None:
    """What a final synchronous save takes in this run: the copy, the write and the commit of the
    recent saves (their median; None before any has committed)."""
    recent = records[-RECENT:]
    return statistics.median(r.stage_s + r.persist_s for r in recent) if recent else None


class Grace:
    """The time a final save has (``save_on_signal``'s ``timeout_s``; None: none set), and whether
    this run was told that its saves take longer."""

    def __init__(self, seconds: float | None = None, given_by: str = "save_on_signal") -> None:
        self.seconds, self.given_by = seconds, given_by
        self._said = False

    def late(self, records: Sequence[SaveRecord]) -> str | None:
        """The warning, once, as soon as the recent saves show a final save would not fit."""
        final = final_save_s(records)
        if self._said or self.seconds is None or final is None or final <= self.seconds:
            return None
        self._said = True
        return (
            f"nbckpt: a final save takes about {final:.3g} s here (the copy and write of the "
            f"recent saves), more than the {self.seconds:g} s {self.given_by} gives it: it would "
            "not commit in time. Save less in it (the model without the optimizer), write to a "
            "faster target, or save more often so that the checkpoint before it loses less"
        )


class Pacer:
    """A :class:`SaveSchedule` applied to one training loop, asked once a step (``due``): it
    times the steps (those that ran beside a background write apart, which is how the drag is
    measured), takes the costs from the recent saves, and says when the next save is due.

    In one process the clock decides at every step. With several ranks only rank 0's pacer
    decides, from its own clock and costs, and the others follow its answer; to need no
    collective at every step, an answer also says how many calls from now the next one is asked
    for (:attr:`ask_in`, at most :data:`ASK_AT_MOST`)."""

    def __init__(self, schedule: SaveSchedule, clock: Callable[[], float] = time.monotonic) -> None:
        self.schedule = schedule
        self._clock = clock
        self._costed: SaveRecord | None = None  # the newest record the interval was computed with
        self.interval: Interval | None = None
        """The last decision: the interval and the line saying why (None before the first save)."""
        self.ask_in = 1
        self._last_tick: float | None = None
        self._last_save: float | None = None
        self._idle: deque[float] = deque(maxlen=8 * RECENT)  # steps with nothing persisting
        self._busy: deque[float] = deque(maxlen=8 * RECENT)  # steps beside a background write
        self._busy_since_save = 0
        self._busy_per_save: deque[int] = deque(maxlen=RECENT)

    def due(
        self,
        persisting: bool,
        records: Sequence[SaveRecord],
        restore_s: Callable[[], float | None],
        group: Any,
    ) -> bool:
        """A step ended now: whether a save is due, by rank 0's decision (``group.from_rank0``;
        ``group.pg`` None: one process, decided here), from the saves ``records`` and the last
        restore's time (``restore_s()``, asked only when deciding; None: none)."""
        now = self._clock()
        self.tick(now, persisting)
        if group.pg is None:
            return self._due_here(now, records, restore_s, persisting)
        if self.ask_in > 0:
            return False
        decide = partial(self.decide, now, records, restore_s(), persisting)
        due, self.ask_in = group.from_rank0(("due",), decide)
        return bool(due)

    def _due_here(
        self,
        now: float,
        records: Sequence[SaveRecord],
        restore_s: Callable[[], float | None],
        persisting: bool,
    ) -> bool:
        """One process: no collective to spare, so the clock decides at every step (a count of
        steps would make a save late when the steps slow down), against the interval computed
        when a save last committed (its costs change only then)."""
        if self._last_save is None or not records:
            return self._last_save is None
        if self.interval is None or self._costed is not records[-1]:
            self._costed = records[-1]
            return self.decide(now, records, restore_s(), persisting)[0]
        return self._ripe(now, persisting)

    def tick(self, now: float, persisting: bool) -> None:
        """A step ended at ``now`` (a call of ``due``), a save persisting or not meanwhile."""
        if self._last_tick is not None:
            (self._busy if persisting else self._idle).append(now - self._last_tick)
            self._busy_since_save += persisting
        self._last_tick = now
        self.ask_in = max(self.ask_in - 1, 0)

    def saved(self, now: float) -> None:
        """A save started at ``now``."""
        if self._last_save is not None:
            self._busy_per_save.append(self._busy_since_save)
        self._last_save, self._busy_since_save = now, 0

    def decide(
        self, now: float, records: Sequence[SaveRecord], restore_s: float | None, persisting: bool = False
    ) -> tuple[bool, int]:
        """Whether a save is due at ``now`` (``persisting``: the save before is still being
        written), and in how many calls to ask again. The first save is due at once: it measures
        what saving costs (checkpoint once early, as on a new cluster). Then a save is due once the
        Young/Daly optimum has passed and the save before is durable: never two in flight, and
        that judged by the save itself, not by its recent saves' median (a sync save, durable
        when it returns, would otherwise be due or not by the noise of its own time)."""
        if self._last_save is None or not records:
            return self._last_save is None, 1
        self.interval = self.schedule.interval(self.costs(records, restore_s))
        if self._ripe(now, persisting):
            return True, 1
        left = max(self.interval.seconds - (now - self._last_save), 0.0)
        step = statistics.median(self._idle or self._busy or [left])
        return False, max(1, min(math.floor(left / max(step, 1e-9)), ASK_AT_MOST))

    def _ripe(self, now: float, persisting: bool) -> bool:
        """The rule, once an interval is known: the Young/Daly optimum has passed since the last
        save began, and that save is durable."""
        assert self.interval is not None and self._last_save is not None
        return not persisting and now - self._last_save >= self.interval.daly_s

    def costs(self, records: Sequence[SaveRecord], restore_s: float | None) -> Costs:
        """This run's costs: the recent saves' stall and time to durable (the wait for the save
        before, the copy and the write: a sync save's stall holds all three), the drag measured as the
        recent steps beside a write against those without (zero until both were seen), and the
        last restore's time (else the write's, reading being about as fast as writing). The run's
        first save is left out once there are others: it also allocated the staging buffers."""
        recent = (records[1:] or records)[-RECENT:]
        stall = statistics.median(r.stall_s for r in recent)
        durable = statistics.median(r.wait_s + r.stage_s + r.persist_s for r in recent)
        drag = 0.0
        if len(self._idle) >= 3 and len(self._busy) >= 3 and self._busy_per_save:
            slower = statistics.median(self._busy) - statistics.median(self._idle)
            drag = max(slower, 0.0) * statistics.median(self._busy_per_save)
        restore = restore_s if restore_s is not None else statistics.median(r.persist_s for r in recent)
        return Costs(stall_s=stall, drag_s=drag, persist_s=durable, restore_s=restore)
