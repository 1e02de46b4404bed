"""One strategy's measured run (:class:`ExperimentResult`) and the metrics read from its events.

Metrics that need no other run (steps, stalls, persist time, write rate, peak memory) are
pooled here over one or more runs of a strategy; those relative to the baseline run of the
same repeat (overhead, drag, CPU per checkpoint) are the comparison's (:mod:`._comparison`).

Three numbers describe what a checkpoint cost the loop directly, and each has one name
(:data:`STALL_NAMES`): the **save stall** (``save()`` itself, and with ``overlap=True`` the
wait for its own copy before the next update), the **wait for the earlier save** (the loop
waited for the previous checkpoint's write before this save could start: backpressure), and
the **stall**, their sum: all the time the loop was blocked for that checkpoint.
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

__all__ = ["STALL_DEFINITION", "STALL_NAMES", "Cycle", "ExperimentResult", "pooled_metrics"]

#: The label of each of the three numbers, used by every table, log line and figure.
STALL_NAMES = {
    "stall_mean_s": "stall",
    "save_stall_s": "save stall",
    "wait_s": "wait for the earlier save",
}
#: The three numbers in one line, printed under every table that shows them.
STALL_DEFINITION = (
    "Per checkpoint: save stall = the time save() blocked the loop (with overlap=True, plus the wait "
    "for its own copy before the next update); wait for the earlier save = the time the loop waited "
    "for the previous checkpoint's write first; stall = the two together, all the time the loop "
    "was blocked (the wait for the last write at the end of a run counts in the overhead, not "
    "here). Drag = loop time lost beyond the stall, against the baseline's same cycle."
)


@dataclass(frozen=True)
class Cycle:
    """One checkpoint cycle of a run, as the runner timed it: the checkpoint due at its start
    (if any), its training steps, and (strategies taking turns) the wait for that checkpoint's
    write before the next strategy's turn."""

    steps: int
    loop_s: float
    """Loop time of the cycle: what overhead compares with the baseline's same cycle."""
    stall_s: float
    """Time the loop was blocked by checkpointing within the cycle (save stalls and waits)."""
    checkpoints: int
    """Checkpoints saved in the cycle (0 or 1)."""


@dataclass
class ExperimentResult:
    """One strategy's run: its events and the metrics derived from them."""

    strategy: str
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
    cycles: list[Cycle] = field(default_factory=list)
    """Every cycle the run completed, in order (a cycle cut short by a stop is left out)."""
    stall_covers_copy: bool = True
    """The strategy's save stall includes copying every byte once (see :class:`Strategy`)."""

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
    def checkpoints(self) -> int:
        return len(self.stall_parts())

    def stall_parts(self) -> dict[int, tuple[float, float]]:
        """``{step: (save stall, wait for the earlier save)}`` of every checkpoint saved.

        The runner times each save (``part="save"``, plus ``"before_step"`` for overlapped
        copies) and, strategies taking turns, the wait before the next one (``"wait"``). A
        strategy's own ``wait`` events inside a save's stall (backpressure in ``save()``) are
        moved from the save stall to the wait, so the two always add up to the stall. The wait
        for the last write at the end of a run (``"final"``) is no checkpoint's: it counts in
        the loop time (and overhead), not here.
        """
        saves: dict[int, float] = {}
        waits: dict[int, float] = {}
        windows: list[tuple[int, int, int]] = []
        for event in self.events:
            if event.kind != "stall" or event.step is None or event.detail.get("part") == "final":
                continue  # the wait for the last write at the end belongs to no next save
            if event.detail.get("part") == "wait":
                waits[event.step] = waits.get(event.step, 0.0) + event.duration_s
                continue
            saves[event.step] = saves.get(event.step, 0.0) + event.duration_s
            if event.detail.get("part", "save") == "save":
                windows.append((event.start_ns, event.end_ns, event.step))
        for event in self.events:
            if event.kind != "wait":
                continue
            for start, end, step in windows:
                if start <= event.start_ns and event.end_ns <= end:
                    moved = min(event.duration_s, saves[step])
                    saves[step] -= moved
                    waits[step] = waits.get(step, 0.0) + moved
                    break
        return {step: (saves[step], waits.get(step, 0.0)) for step in sorted(saves)}

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
            "cycle_loop_s": [cycle.loop_s for cycle in self.cycles],
            "stopped": self.stopped,
        }

    def timeline_frame(self) -> pd.DataFrame:
        return self.timeline.to_pandas()


def pooled_metrics(results: Sequence[ExperimentResult]) -> dict[str, Any]:
    """Metrics over the checkpoints of one or more runs of the same strategy."""
    runs = max(len(results), 1)
    step_total = sum(r.steps_run for r in results)
    parts = [part for r in results for part in r.stall_parts().values()]
    stalls = [save + wait for save, wait in parts]
    persists = [p for r in results for p in r.durations("persist").values()]
    persist_bytes = sum(e.bytes for r in results for e in r.events if e.kind == "persist")
    wall_s = sum(r.wall_s for r in results)
    return {
        "steps": round(step_total / runs),
        "checkpoints": round(len(parts) / runs),
        "mean_step_s": wall_s / step_total if step_total else math.nan,
        "stall_mean_s": float(np.mean(stalls)) if stalls else 0.0,
        "stall_p95_s": float(np.percentile(stalls, 95)) if stalls else 0.0,
        "save_stall_s": float(np.mean([save for save, _ in parts])) if parts else 0.0,
        "wait_s": float(np.mean([wait for _, wait in parts])) if parts else 0.0,
        "persist_s": float(np.mean(persists)) if persists else math.nan,
        "write_gbs": persist_bytes / sum(persists) / GB if sum(persists) > 0 else math.nan,
        "peak_host_mb": max(r.peak_host_mb for r in results),
        "peak_device_mb": max(r.peak_device_mb for r in results),
    }
