"""One strategy's measured run (:class:`ExperimentResult`) and the metrics read from its events.

Metrics that need no other run (steps, stalls, persist time, write rate, peak memory) are
pooled here over one or more runs of a strategy; those relative to the baseline run of the
same repeat (overhead, drag, CPU per checkpoint) are the comparison's (:mod:`._comparison`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .._util import GB
from ..engine import Event, Timeline
from ._load import Load

__all__ = ["ExperimentResult", "pooled_metrics"]


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

    def durations(self, kind: str) -> dict[int, float]:
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
        return len(self.durations("stall"))

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
            **pooled_metrics([self]),
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


def pooled_metrics(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Metrics over the checkpoints of one or more runs of the same strategy."""
    runs = max(len(results), 1)
    step_total = sum(r.steps_run for r in results)
    stalls = [s for r in results for s in r.durations("stall").values()]
    persists = [p for r in results for p in r.durations("persist").values()]
    persist_bytes = sum(e.bytes for r in results for e in r.events if e.kind == "persist")
    wall_s = sum(r.wall_s for r in results)
    return {
        "steps": round(step_total / runs),
        "checkpoints": round(len(stalls) / runs),
        "mean_step_s": wall_s / step_total if step_total else math.nan,
        "stall_mean_s": float(np.mean(stalls)) if stalls else 0.0,
        "stall_p95_s": float(np.percentile(stalls, 95)) if stalls else 0.0,
        "persist_s": float(np.mean(persists)) if persists else math.nan,
        "write_gbs": persist_bytes / sum(persists) / GB if sum(persists) > 0 else math.nan,
        "peak_host_mb": max(r.peak_host_mb for r in results),
        "peak_device_mb": max(r.peak_device_mb for r in results),
    }
