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
from dataclasses import dataclass

from .._errors import ConfigError
from .._util import check_count, format_duration, parse_duration

__all__ = ["JOB_MTTF_H", "Costs", "Interval", "SaveSchedule", "expected_waste", "job_mtbf_s",
           "young_daly_interval"]

HOUR_S = 3600.0
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


def expected_waste(interval_s: float, cost_s: float, mtbf_s: float, *, lag_s: float = 0.0,
                   restore_s: float = 0.0) -> float:
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
    """From the save to durable: the lag, and the shortest interval one save in flight allows."""
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
            self.source = (f"a job MTBF of {format_duration(self.mtbf_s)} at {gpus:,} GPUs "
                           "(Meta's fit, Kokolis et al., HPCA 2025)")

    def interval(self, costs: Costs) -> Interval:
        """The interval for ``costs``: the Young/Daly optimum, never shorter than the persist time."""
        cost = costs.stall_s + costs.drag_s
        optimum = young_daly_interval(cost, self.mtbf_s)
        seconds, bound = (optimum, "daly") if optimum >= costs.persist_s else (costs.persist_s, "persist")
        waste = expected_waste(max(seconds, 1e-9), cost, self.mtbf_s, lag_s=costs.persist_s,
                               restore_s=costs.restore_s)
        why = (f"Young/Daly for {format_duration(cost)} a save (stall {format_duration(costs.stall_s)}, "
               f"drag {format_duration(costs.drag_s)}) and {self.source}" if bound == "daly" else
               f"the background write's {format_duration(costs.persist_s)} (Young/Daly for "
               f"{format_duration(cost)} a save and {self.source} would save every "
               f"{format_duration(optimum)}: faster than one save in flight can persist)")
        reason = f"save every {format_duration(seconds)}: {why}; expected loss {100 * waste:.2g} % of time"
        return Interval(seconds, bound, reason)

    def __repr__(self) -> str:
        return f"SaveSchedule(mtbf_s={self.mtbf_s:.6g})"
