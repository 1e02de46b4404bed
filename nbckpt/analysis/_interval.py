"""How often to checkpoint: the Young/Daly interval and the time it loses.

A first-order model (Young 1974, Daly 2006; the formulas are the engine's, which a training
loop's save schedule uses too), valid while cost and interval are small against the MTBF. With
per-checkpoint cost ``C = stall + drag``, interval ``tau`` and job MTBF ``M``::

    waste(tau) = C / tau + (tau / 2 + lag + R) / M

Each failure loses half an interval, the restore time ``R`` and, for async saves, the ``lag``
until the snapshot is durable. With one save in flight the advised interval is never shorter
than ``lag``. The job MTBF is the engine's one source, :func:`~nbckpt.engine.job_mtbf_s` (Meta's
fit of job failures against job size, HPCA 2025), unless the caller gives the job's own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from .._errors import ConfigError
from .._util import check_count
from ..bench import Comparison
from ..engine._internal import expected_waste, job_mtbf_s, young_daly_interval
from ._costs import Measured, measurements
from ._job_costs import costs_for

__all__ = [
    "ADVICE_COLUMNS",
    "Overhead",
    "advise",
    "compare_modes",
    "expected_waste",
    "job_mtbf_s",
    "table_order",
    "waste_curve",
    "young_daly_interval",
]

HOUR_S = 3600.0
DAY_S = 86400.0
#: Where a job MTBF comes from when none is given: the engine's fit (:func:`job_mtbf_s`).
MTBF_SOURCE = "Meta's fit for the job's size (Kokolis et al., HPCA 2025)"


#: Columns :func:`advise` returns.
ADVICE_COLUMNS = [
    "strategy",
    "mode",
    "stall_s",
    "drag_s",
    "cost_s",
    "persist_s",
    "lag_s",
    "restore_s",
    "job_mtbf_h",
    "interval_s",
    "bound",
    "checkpoint_pct",
    "drag_pct",
    "rework_pct",
    "restore_pct",
    "waste_pct",
    "storage_duty_pct",
    "gpu_hours_lost_per_day",
    "checkpoints_per_day",
]


def advise(
    results: Measured | Comparison | Sequence[Comparison],
    *,
    gpus: int = 8,
    job_mtbf_hours: float | None = None,
    restore_s: float = 0.0,
    method: str = "daly",
) -> pd.DataFrame:
    """The best checkpoint interval per strategy and what it costs (columns :data:`ADVICE_COLUMNS`).

    The job of ``gpus`` GPUs fails every ``job_mtbf_hours`` on average (None: Meta's fit for its
    size, :func:`job_mtbf_s`); ``bound`` says what set the interval (the Young/Daly optimum, or
    the persist time of an async save). The lost time splits into stalls, drag, rework and
    restores; ``storage_duty_pct`` is the share of time the storage writes this job's checkpoints.

    ``results``: a table of one process's costs, or bench runs (:class:`~nbckpt.bench.Comparison`,
    one or a list, e.g. ``nbckpt bench --ranks`` read by :func:`read_jobs`): then the costs come
    from the run of ``gpus`` ranks, else the largest given (:mod:`._job_costs`), and the table's
    ``attrs["costs_from"]`` says which.
    """
    if restore_s < 0:
        raise ConfigError(f"restore_s must be >= 0, got {restore_s}")
    check_count(gpus, "gpus")
    if job_mtbf_hours is not None and not 0 < job_mtbf_hours < math.inf:
        raise ConfigError(f"job_mtbf_hours must be a number of hours > 0, got {job_mtbf_hours}")
    mtbf_s = job_mtbf_s(gpus) if job_mtbf_hours is None else job_mtbf_hours * HOUR_S
    if isinstance(results, Comparison) or (isinstance(results, Sequence) and not isinstance(results, str)):
        costs, source = costs_for(results, gpus)
    else:
        costs, source = (
            measurements(results),
            {
                "costs_from": "costs from the results table given: one rank's, as if all ranks paid them",
                "measured_ranks": 1,
                "job_size_measured": gpus == 1,
            },
        )
    rows: list[dict[Any, Any]] = []
    for row in costs.to_dict("records"):
        stall, lag = float(row["stall_s"]), float(row["lag_s"])
        cost = stall + float(row["drag_s"])
        optimum = young_daly_interval(cost, mtbf_s, method)
        interval = max(optimum, lag)
        if interval <= 0:
            raise ConfigError(f"strategy {row['strategy']!r} has zero stall and zero persist time")
        waste = expected_waste(interval, cost, mtbf_s, lag_s=lag, restore_s=restore_s)
        rows.append(
            {
                **row,
                "cost_s": cost,
                "restore_s": restore_s,
                "job_mtbf_h": mtbf_s / HOUR_S,
                "interval_s": interval,
                "bound": method if optimum >= lag else "persist",
                "checkpoint_pct": 100.0 * stall / interval,
                "drag_pct": 100.0 * row["drag_s"] / interval,
                "rework_pct": 100.0 * (interval / 2.0 + lag) / mtbf_s,
                "restore_pct": 100.0 * restore_s / mtbf_s,
                "waste_pct": 100.0 * waste,
                "storage_duty_pct": min(100.0, 100.0 * row["persist_s"] / (interval + stall)),
                "gpu_hours_lost_per_day": waste * gpus * 24.0,
                "checkpoints_per_day": DAY_S / (interval + stall),
            }
        )
    advice = pd.DataFrame(rows, columns=ADVICE_COLUMNS)
    advice.attrs.update(
        gpus=gpus,
        job_mtbf_hours=mtbf_s / HOUR_S,
        mtbf_source="given" if job_mtbf_hours is not None else MTBF_SOURCE,
        method=method,
        restore_s=restore_s,
        **source,
    )
    return advice


#: A strategy's measured overhead as its table shows it: ``(pct, lo, hi)`` of ``overhead_ci_pct``.
Overhead = tuple[float, float, float]


def table_order(a: Overhead | None, b: Overhead | None) -> int:
    """What a results table shows of two strategies' overheads: -1 when ``a``'s 95 % interval
    lies wholly below ``b``'s, +1 when wholly above, 0 when they overlap or one was not measured."""
    if a is None or b is None or not all(math.isfinite(v) for v in (*a[1:], *b[1:])):
        return 0
    return -1 if a[2] < b[1] else 1 if a[1] > b[2] else 0


def _overhead_text(overhead: Overhead) -> str:
    return f"{overhead[0]:+.1f} % [{overhead[1]:+.1f}, {overhead[2]:+.1f}]"


def compare_modes(advice: pd.DataFrame, table: Mapping[str, Overhead] | None = None) -> list[str]:
    """Why the best async strategy of an :func:`advise` table wins or loses against the best sync
    one, as a sentence (none when a mode is missing). With ``table`` (each strategy's measured
    overhead), the sentence ranks them only as that table does: where the measured overheads do
    not differ, or differ the other way, it says so instead of the model's ranking."""
    rows = advice.to_dict("records")
    sync = [r for r in rows if r["mode"] == "sync"]
    asyn = [r for r in rows if r["mode"] == "async"]
    if not sync or not asyn:
        return []
    a = min(asyn, key=lambda r: float(r["waste_pct"]))
    s = min(sync, key=lambda r: float(r["waste_pct"]))
    diff = float(a["gpu_hours_lost_per_day"]) - float(s["gpu_hours_lost_per_day"])

    def part(name: str) -> str:
        return f"{float(a[name]):.3f} % against {float(s[name]):.3f} %"

    costs = (
        f"stalls {part('checkpoint_pct')}, drag of the background write {part('drag_pct')}, "
        f"rework {part('rework_pct')} (the async rework includes its {float(a['lag_s']):.3g} s "
        f"lag: a failure before the write is durable falls back one checkpoint)"
    )
    order = 0 if diff == 0 else 1 if diff > 0 else -1
    mine, theirs = (table.get(a["strategy"]), table.get(s["strategy"])) if table is not None else (None, None)
    shown = table_order(mine, theirs)
    if table is not None and shown != order:
        verdict = (
            "do not differ measurably"
            if shown == 0
            else f"put {a['strategy']} {'above' if shown > 0 else 'below'} {s['strategy']}"
        )
        measured = (
            f"the measured overheads, {_overhead_text(mine)} % against {_overhead_text(theirs)} %, {verdict}"
            if mine is not None and theirs is not None
            else "their overheads were not both measured"
        )
        text = (
            f"{a['strategy']} (async) against {s['strategy']} (sync): {measured}, so this run does "
            f"not say which loses less time, whatever the model's {costs}"
        )
    else:
        text = (
            f"{a['strategy']} (async) loses {abs(diff):.1f} GPU-hours a day "
            f"{'more' if diff > 0 else 'less'} than {s['strategy']} (sync): {costs}"
        )
        if diff > 0:
            text += "; here the background write costs more than the stall it hides"
    text += (
        f". Restoring after each failure ({float(a['restore_s']):.0f} s) costs every strategy "
        f"the same {float(a['restore_pct']):.3f} % of the {float(a['waste_pct']):.3f} % lost."
    )
    return [text]


def waste_curve(advice: pd.DataFrame, intervals: Sequence[float] | None = None) -> pd.DataFrame:
    """Expected waste (%) against interval per row of :func:`advise`'s table (columns ``strategy,
    interval_s, waste_pct``); by default 120 log-spaced intervals around the advised ones."""
    if intervals is None:
        low = max(float(advice["interval_s"].min()) / 10.0, 1e-3)
        high = max(float(advice["interval_s"].max()) * 10.0, low * 10.0)
        intervals = [low * (high / low) ** (i / 119) for i in range(120)]
    rows = [
        (
            row["strategy"],
            tau,
            100.0
            * expected_waste(
                tau,
                row["cost_s"],
                row["job_mtbf_h"] * HOUR_S,
                lag_s=row["lag_s"],
                restore_s=row["restore_s"],
            ),
        )
        for row in advice.to_dict("records")
        for tau in intervals
    ]
    return pd.DataFrame(rows, columns=["strategy", "interval_s", "waste_pct"])
