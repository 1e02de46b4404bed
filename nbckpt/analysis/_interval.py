"""How often to checkpoint: the Young/Daly interval and the time it loses.

The model is first-order (Young 1974, Daly 2006), valid while the cost and the interval are
small against the MTBF. With per-checkpoint cost ``C = stall + drag`` (:mod:`._costs`),
interval ``tau`` (training time between checkpoints) and job MTBF ``M``, the fraction of time
lost is::

    waste(tau) = C / tau + (tau / 2 + lag + R) / M

``C / tau`` is the stall and drag; each failure (rate ``1 / M``) loses on average half an
interval of work, the restore time ``R``, and for async checkpoints the ``lag`` between the
snapshot and the moment it is durable (a failure in that window falls back to the previous
checkpoint). ``lag`` and ``R`` do not depend on ``tau``, so Young's ``sqrt(2 C M)`` is the
optimum; Daly's expansion refines it. With one save in flight an async interval shorter than
the persist time would make the next save wait, so the advised interval is never shorter than
``lag``. The **storage duty cycle** is the share of time the storage is busy writing this job's
checkpoints, ``persist / (tau + stall)``: what the job takes from storage others share.

The job MTBF is a node MTBF divided by the nodes; the default node MTBF comes from Llama 3's
report (419 unexpected interruptions in 54 days on 16,384 GPUs, 8 per node:
:func:`node_mtbf_hours`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from .._errors import ConfigError
from .._util import check_count
from ._costs import Measured, measured_costs
from ._reference import load_published

__all__ = [
    "ADVICE_COLUMNS",
    "advise",
    "cluster_mtbf_s",
    "compare_modes",
    "expected_waste",
    "node_mtbf_hours",
    "waste_curve",
    "young_daly_interval",
]

HOUR_S = 3600.0
DAY_S = 86400.0


def node_mtbf_hours(
    *,
    interruptions: float | None = None,
    days: float | None = None,
    gpus: float | None = None,
    gpus_per_node: int = 8,
) -> float:
    """Mean hours between failures of one node, from a fleet's interruption count.

    Defaults: Llama 3's pre-training (``published.json``, anchor ``llama3_interruptions``):
    ``54 days * 24 h * (16384 / 8) nodes / 419 = 6334.6 h`` per 8-GPU node. Every unexpected
    interruption counts (Meta attributes about 78 % of them to hardware).
    """
    values = load_published()["anchors"]["llama3_interruptions"]["values"]
    count = float(values["unexpected_interruptions"]["value"]) if interruptions is None else interruptions
    span = float(values["days"]["value"]) if days is None else days
    fleet = float(values["gpus"]["value"]) if gpus is None else gpus
    check_count(gpus_per_node, "gpus_per_node")
    if not (count > 0 and span > 0 and fleet > 0):
        raise ConfigError("interruptions, days and gpus must be > 0")
    return span * 24.0 * (fleet / gpus_per_node) / count


#: Columns :func:`advise` returns.
ADVICE_COLUMNS = [
    "strategy", "mode", "stall_s", "drag_s", "cost_s", "persist_s", "lag_s", "restore_s",
    "cluster_mtbf_h", "interval_s", "bound", "checkpoint_pct", "drag_pct", "rework_pct",
    "restore_pct", "waste_pct", "storage_duty_pct", "gpu_hours_lost_per_day",
    "checkpoints_per_day",
]


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
    interval_s: float,
    cost_s: float,
    mtbf_s: float,
    *,
    lag_s: float = 0.0,
    restore_s: float = 0.0,
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


def cluster_mtbf_s(mtbf_hours: float, gpus: int, gpus_per_node: int = 8) -> float:
    """MTBF of the whole job: one node's MTBF divided by the number of nodes it uses."""
    if not mtbf_hours > 0:
        raise ConfigError(f"mtbf_hours must be > 0, got {mtbf_hours}")
    check_count(gpus, "gpus")
    check_count(gpus_per_node, "gpus_per_node")
    nodes = math.ceil(gpus / gpus_per_node)
    return mtbf_hours * HOUR_S / nodes


def advise(
    results: Measured,
    *,
    mtbf_hours: float,
    gpus: int = 8,
    gpus_per_node: int = 8,
    restore_s: float = 0.0,
    method: str = "daly",
) -> pd.DataFrame:
    """The best checkpoint interval per strategy and what it costs (columns :data:`ADVICE_COLUMNS`).

    ``mtbf_hours`` is the mean time between failures of one node; the job's MTBF is that divided
    by its nodes (``ceil(gpus / gpus_per_node)``). ``bound`` says what set the interval:
    the Young/Daly optimum for ``cost = stall + drag``, or the persist time of an async save
    (one save in flight). The lost time splits into ``checkpoint_pct`` (stalls), ``drag_pct``,
    ``rework_pct`` (half an interval plus the lag per failure) and ``restore_pct``;
    ``storage_duty_pct`` is the share of time the storage spends writing this job's checkpoints.
    ``gpu_hours_lost_per_day = waste * gpus * 24``. The report and notebook 07 pass
    :data:`DEFAULTS`.
    """
    if restore_s < 0:
        raise ConfigError(f"restore_s must be >= 0, got {restore_s}")
    mtbf_s = cluster_mtbf_s(mtbf_hours, gpus, gpus_per_node)
    rows: list[dict[str, Any]] = []
    for row in measured_costs(results):
        cost = row.stall_s + row.drag_s
        optimum = young_daly_interval(cost, mtbf_s, method)
        interval = max(optimum, row.lag_s)
        if interval <= 0:
            raise ConfigError(f"strategy {row.strategy!r} has zero stall and zero persist time")
        waste = expected_waste(interval, cost, mtbf_s, lag_s=row.lag_s, restore_s=restore_s)
        rows.append(
            {
                "strategy": row.strategy,
                "mode": row.mode,
                "stall_s": row.stall_s,
                "drag_s": row.drag_s,
                "cost_s": cost,
                "persist_s": row.persist_s,
                "lag_s": row.lag_s,
                "restore_s": restore_s,
                "cluster_mtbf_h": mtbf_s / HOUR_S,
                "interval_s": interval,
                "bound": method if optimum >= row.lag_s else "persist",
                "checkpoint_pct": 100.0 * row.stall_s / interval,
                "drag_pct": 100.0 * row.drag_s / interval,
                "rework_pct": 100.0 * (interval / 2.0 + row.lag_s) / mtbf_s,
                "restore_pct": 100.0 * restore_s / mtbf_s,
                "waste_pct": 100.0 * waste,
                "storage_duty_pct": min(100.0, 100.0 * row.persist_s / (interval + row.stall_s)),
                "gpu_hours_lost_per_day": waste * gpus * 24.0,
                "checkpoints_per_day": DAY_S / (interval + row.stall_s),
            }
        )
    advice = pd.DataFrame(rows, columns=ADVICE_COLUMNS)
    advice.attrs.update(
        mtbf_hours=mtbf_hours, gpus=gpus, gpus_per_node=gpus_per_node, method=method,
        nodes=math.ceil(gpus / gpus_per_node), restore_s=restore_s,
    )
    return advice


def compare_modes(advice: pd.DataFrame) -> list[str]:
    """Sentences that explain, from an :func:`advise` table, why the best async strategy wins
    or loses against the best sync one (empty when one of the two modes is missing)."""
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

    text = (f"{a['strategy']} (async) loses {abs(diff):.1f} GPU-hours a day "
            f"{'more' if diff > 0 else 'less'} than {s['strategy']} (sync): stalls "
            f"{part('checkpoint_pct')}, drag of the background write {part('drag_pct')}, rework "
            f"{part('rework_pct')} (the async rework includes its {float(a['lag_s']):.3g} s lag: a "
            f"failure before the write is durable falls back one checkpoint)")
    if diff > 0:
        text += "; here the background write costs more than the stall it hides"
    text += (f". Restoring after each failure ({float(a['restore_s']):.0f} s) costs every strategy "
             f"the same {float(a['restore_pct']):.3f} % of the {float(a['waste_pct']):.3f} % lost.")
    return [text]


def waste_curve(advice: pd.DataFrame, intervals: Sequence[float] | None = None) -> pd.DataFrame:
    """Expected waste (%) against interval for each row of :func:`advise`'s table.

    Columns ``strategy, interval_s, waste_pct``. By default 120 intervals spaced evenly in log
    from a tenth of the smallest advised interval to ten times the largest.
    """
    missing = {"strategy", "stall_s", "lag_s", "restore_s", "cluster_mtbf_h", "interval_s"} - set(
        advice.columns
    )
    if missing:
        raise ConfigError(f"advice table lacks columns {sorted(missing)}: build it with advise()")
    if intervals is None:
        low = max(float(advice["interval_s"].min()) / 10.0, 1e-3)
        high = max(float(advice["interval_s"].max()) * 10.0, low * 10.0)
        intervals = [low * (high / low) ** (i / 119) for i in range(120)]
    rows = [
        (
            str(row["strategy"]),
            tau,
            100.0 * expected_waste(
                tau,
                float(row["stall_s"]) + float(row.get("drag_s", 0.0) or 0.0),
                float(row["cluster_mtbf_h"]) * HOUR_S,
                lag_s=float(row["lag_s"]),
                restore_s=float(row["restore_s"]),
            ),
        )
        for row in advice.to_dict("records")
        for tau in intervals
    ]
    return pd.DataFrame(rows, columns=["strategy", "interval_s", "waste_pct"])
