"""What else the machine did while nbckpt measured: other processes' CPU, steal, load average.

A shared machine widens every interval; :class:`LoadMonitor` counts machine-wide and own CPU
time (``/proc/stat`` via psutil) so that a comparison can say when the numbers are suspect.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import psutil

__all__ = ["Load", "LoadMonitor", "Snapshot", "combine_loads", "machine_load"]

# "High" load: other processes kept a quarter of the cores busy, or the hypervisor took 5 %.
_HIGH_OTHER_SHARE = 0.25
_HIGH_STEAL_PCT = 5.0


def machine_load() -> tuple[float, int]:
    """The 1-minute load average and the cores this process may use, as a measurement is about to
    start (before it, the load is the other processes')."""
    return os.getloadavg()[0], len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1
    )


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
        return (
            f"the machine was busy while this ran ({'; '.join(reasons)}): expect wide "
            "intervals, and repeat when it is quieter"
        )

    def describe(self) -> str:
        return (
            f"other processes used {self.other_cpu_cores:.2f} of {self.cpus} cores on average, "
            f"CPU steal {self.steal_pct:.1f} %, 1-minute load average "
            f"{self.loadavg_1m_start:.2f} -> {self.loadavg_1m:.2f} (this process used "
            f"{self.own_cores:.2f} cores)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "high": self.warning() is not None}

    @classmethod
    def between(cls, begin: Snapshot, end: Snapshot, *, cpus: int) -> Load:
        """The load from ``begin`` to ``end`` on a machine of ``cpus`` cores."""

        def delta(name: str) -> float:
            return float(getattr(end.cpu_times, name, 0.0)) - float(getattr(begin.cpu_times, name, 0.0))

        # guest time is already inside user time in /proc/stat; iowait counts as idle.
        busy = sum(delta(name) for name in ("user", "nice", "system", "irq", "softirq"))
        total = busy + sum(delta(name) for name in ("idle", "iowait", "steal"))
        wall = end.at_s - begin.at_s
        own = end.own_cpu_s - begin.own_cpu_s
        return cls(
            cpus=cpus,
            wall_s=wall,
            own_cpu_s=own,
            other_cpu_cores=max(busy - own, 0.0) / wall if wall > 0 else math.nan,
            steal_pct=100.0 * delta("steal") / total if total > 0 else 0.0,
            loadavg_1m_start=begin.loadavg_1m,
            loadavg_1m=end.loadavg_1m,
        )


class Snapshot(NamedTuple):
    """The machine's counters at one moment."""

    at_s: float
    """``time.perf_counter()``."""
    cpu_times: Any
    """Machine-wide CPU times by kind (``psutil.cpu_times()``: user, system, idle, steal, ...)."""
    own_cpu_s: float
    """CPU seconds of this process and its children so far."""
    loadavg_1m: float


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

    def _snapshot(self) -> Snapshot:
        return Snapshot(time.perf_counter(), psutil.cpu_times(), self._own_cpu_s(), _loadavg())

    def stop(self) -> Load:
        """The load since this monitor was created."""
        return Load.between(self._begin, self._snapshot(), cpus=psutil.cpu_count() or 1)


def combine_loads(loads: Sequence[Load]) -> Load | None:
    """One load record for several stretches of time (a strategy's turns in a repeat)."""
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


def _loadavg() -> float:
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return math.nan
