"""How often to checkpoint (Young/Daly) and what checkpointing would cost at scale.

Both work from measured costs: the stall the training loop saw per checkpoint and the time until
the checkpoint was durable (``persist_s``), one row per strategy, as in ``Comparison.results``.

The interval model is first-order (Young 1974, Daly 2006), valid while stall and interval are
small against the MTBF. With checkpoint cost ``C`` (the stall), interval ``tau`` (training time
between checkpoints) and cluster MTBF ``M``, the fraction of time lost is::

    waste(tau) = C / tau + (tau / 2 + lag + R) / M

``C / tau`` is the stall; each failure (rate ``1 / M``) loses on average half an interval of work,
the restore time ``R``, and for async checkpoints the ``lag`` between the snapshot and the moment
it is durable (a failure in that window falls back to the previous checkpoint). ``lag`` and ``R``
do not depend on ``tau``, so Young's ``sqrt(2 C M)`` is the optimum; Daly's expansion refines it.
With one save in flight (``max_inflight=1``) an async interval shorter than the persist time
would make the next save wait, so the advised interval is never shorter than ``lag``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import pandas as pd

from ._errors import ConfigError
from .reference import load_published

HOUR_S = 3600.0
DAY_S = 86400.0
GB = 1e9

#: Columns :func:`advise` returns.
ADVICE_COLUMNS = [
    "strategy", "mode", "stall_s", "persist_s", "lag_s", "restore_s", "cluster_mtbf_h",
    "interval_s", "bound", "checkpoint_pct", "rework_pct", "waste_pct",
    "gpu_hours_lost_per_day", "checkpoints_per_day",
]

#: Columns :func:`project_scale` returns.
PROJECTION_COLUMNS = [
    "kind", "strategy", "mode", "model", "checkpoint_gb", "ranks", "per_rank_gb", "stage_gbs",
    "rank_write_gbs", "aggregate_gbs", "limited_by", "stall_s", "persist_s", "backpressure_s",
    "interval_s", "overhead_pct",
]

Measured: TypeAlias = pd.DataFrame | Mapping[str, tuple[float, float]]


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


@dataclass(frozen=True)
class Cost:
    """Measured cost of one strategy's checkpoint (seconds)."""

    strategy: str
    mode: str
    stall_s: float
    persist_s: float
    lag_s: float


def measured_costs(results: Measured) -> list[Cost]:
    """:func:`measurements` as a list of :class:`Cost`."""
    return [
        Cost(str(r["strategy"]), str(r["mode"]), *(float(r[k]) for k in ("stall_s", "persist_s", "lag_s")))
        for r in measurements(results).to_dict("records")
    ]


def measurements(results: Measured) -> pd.DataFrame:
    """Normalise measured costs to columns ``strategy, mode, stall_s, persist_s, lag_s``.

    ``results`` is ``Comparison.results`` (``stall_mean_s``, ``persist_s``; an optional ``mode``
    column of ``"sync"``/``"async"``) or a mapping ``strategy -> (stall_s, persist_s)``. Rows
    without a checkpoint (the ``none`` baseline) are dropped. Without a ``mode`` column a strategy
    counts as async when its persist time exceeds its stall (the write went on after the loop
    resumed); a sync save persists inside its stall, so nothing is left to become durable.
    """
    if isinstance(results, pd.DataFrame):
        stall_column = "stall_mean_s" if "stall_mean_s" in results.columns else "stall_s"
        missing = {"strategy", stall_column} - set(results.columns)
        if missing:
            raise ConfigError(
                f"results need columns strategy and stall_mean_s (or stall_s); missing {sorted(missing)}"
            )
        frame = pd.DataFrame(
            {
                "strategy": results["strategy"].astype(str),
                "stall_s": pd.to_numeric(results[stall_column], errors="coerce"),
                "persist_s": pd.to_numeric(
                    results["persist_s"] if "persist_s" in results.columns else 0.0,
                    errors="coerce",
                ),
            }
        )
        if "mode" in results.columns:
            frame["mode"] = results["mode"].astype(str)
        if "checkpoints" in results.columns:
            frame = frame[pd.to_numeric(results["checkpoints"], errors="coerce").fillna(0) > 0]
    else:
        frame = pd.DataFrame(
            [(name, float(stall), float(persist)) for name, (stall, persist) in results.items()],
            columns=["strategy", "stall_s", "persist_s"],
        )
    frame = frame[(frame["strategy"] != "none") & frame["stall_s"].notna()].copy()
    if frame.empty:
        raise ConfigError("no strategy with a measured checkpoint stall (only 'none' or empty results)")
    if (frame["stall_s"] < 0).any():
        raise ConfigError("measured stall times must be >= 0 seconds")
    frame["persist_s"] = frame["persist_s"].fillna(0.0)
    if "mode" not in frame.columns:
        frame["mode"] = (frame["persist_s"] > frame["stall_s"]).map({True: "async", False: "sync"})
    elif not frame["mode"].isin(["sync", "async"]).all():
        raise ConfigError(f"mode must be 'sync' or 'async', got {sorted(set(frame['mode']))}")
    frame["lag_s"] = frame["persist_s"].where(frame["mode"] == "async", 0.0)
    return frame[["strategy", "mode", "stall_s", "persist_s", "lag_s"]].reset_index(drop=True)


def cluster_mtbf_s(mtbf_hours: float, gpus: int, gpus_per_node: int = 8) -> float:
    """MTBF of the whole job: one node's MTBF divided by the number of nodes it uses."""
    if not mtbf_hours > 0:
        raise ConfigError(f"mtbf_hours must be > 0, got {mtbf_hours}")
    if gpus < 1 or gpus_per_node < 1:
        raise ConfigError(f"gpus and gpus_per_node must be >= 1, got {gpus} and {gpus_per_node}")
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
    the Young/Daly optimum, or the persist time of an async save (one save in flight).
    ``gpu_hours_lost_per_day = waste * gpus * 24``.
    """
    if restore_s < 0:
        raise ConfigError(f"restore_s must be >= 0, got {restore_s}")
    mtbf_s = cluster_mtbf_s(mtbf_hours, gpus, gpus_per_node)
    rows: list[dict[str, Any]] = []
    for row in measured_costs(results):
        optimum = young_daly_interval(row.stall_s, mtbf_s, method)
        interval = max(optimum, row.lag_s)
        if interval <= 0:
            raise ConfigError(f"strategy {row.strategy!r} has zero stall and zero persist time")
        checkpoint = row.stall_s / interval
        waste = expected_waste(interval, row.stall_s, mtbf_s, lag_s=row.lag_s, restore_s=restore_s)
        rows.append(
            {
                "strategy": row.strategy,
                "mode": row.mode,
                "stall_s": row.stall_s,
                "persist_s": row.persist_s,
                "lag_s": row.lag_s,
                "restore_s": restore_s,
                "cluster_mtbf_h": mtbf_s / HOUR_S,
                "interval_s": interval,
                "bound": method if optimum >= row.lag_s else "persist",
                "checkpoint_pct": 100.0 * checkpoint,
                "rework_pct": 100.0 * (waste - checkpoint),
                "waste_pct": 100.0 * waste,
                "gpu_hours_lost_per_day": waste * gpus * 24.0,
                "checkpoints_per_day": DAY_S / (interval + row.stall_s),
            }
        )
    advice = pd.DataFrame(rows, columns=ADVICE_COLUMNS)
    advice.attrs.update(
        mtbf_hours=mtbf_hours, gpus=gpus, gpus_per_node=gpus_per_node, method=method,
        nodes=math.ceil(gpus / gpus_per_node),
    )
    return advice


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
                float(row["stall_s"]),
                float(row["cluster_mtbf_h"]) * HOUR_S,
                lag_s=float(row["lag_s"]),
                restore_s=float(row["restore_s"]),
            ),
        )
        for row in advice.to_dict("records")
        for tau in intervals
    ]
    return pd.DataFrame(rows, columns=["strategy", "interval_s", "waste_pct"])


def checkpoint_gb(params: float, bytes_per_param: float = 16.0) -> float:
    """Checkpoint size in GB: model and AdamW state are about 16 bytes per parameter in mixed
    precision (bf16 weights 2, fp32 master 4, two fp32 moments 8, plus 2 of slack)."""
    if params <= 0 or bytes_per_param <= 0:
        raise ConfigError("params and bytes_per_param must be > 0")
    return params * bytes_per_param / GB


def mlperf_checkpoint_sizes() -> dict[str, float]:
    """Checkpoint sizes (GB) of the MLPerf Storage v2.0 checkpointing benchmark, by model."""
    values = load_published()["anchors"]["mlperf_storage_checkpoint_sizes"]["values"]
    return {name: float(item["value"]) for name, item in values.items()}


def project_scale(
    results: Measured,
    *,
    nbytes: int,
    storage_gbs: float,
    models: Mapping[str, float] | None = None,
    ranks: int | Sequence[int] = (8, 64, 512),
    d2h_gbs: float | None = None,
    rank_write_gbs: float | None = None,
    interval_s: float = 1800.0,
) -> pd.DataFrame:
    """Project stall and overhead of each measured strategy to bigger models and more ranks.

    A projection, not a measurement (column ``kind`` and ``attrs["projection"]`` say so). Inputs:
    ``results`` measured on one rank with a checkpoint of ``nbytes`` bytes; ``models`` maps a name
    to a checkpoint size in GB (default: MLPerf Storage sizes for 8B, 70B and 405B); the state is
    sharded evenly over ``ranks``; ``storage_gbs`` is the aggregate bandwidth of the storage (for
    example a FlashBlade's).

    - sync: the loop waits for the write, ``stall = size / min(storage_gbs, ranks * rank_write)``,
      where ``rank_write`` defaults to the measured ``nbytes / stall``.
    - async: the loop waits for the copy to host, ``stall = size / ranks / stage_gbs``
      (``d2h_gbs``, for example 52.8 GB/s on an H100, defaults to the measured ``nbytes / stall``);
      the write runs behind, ``persist = size / min(storage_gbs, ranks * rank_write)`` with
      ``rank_write`` defaulting to the measured ``nbytes / persist``. When persist exceeds the
      interval the next save waits (one in flight): ``backpressure = persist - interval`` is added
      to the stall.
    - ``overhead_pct = 100 * stall / interval_s`` (time lost relative to training time).
    """
    if nbytes <= 0:
        raise ConfigError(f"nbytes (size of the measured checkpoint) must be > 0, got {nbytes}")
    for name, value in (("storage_gbs", storage_gbs), ("interval_s", interval_s),
                        ("d2h_gbs", d2h_gbs), ("rank_write_gbs", rank_write_gbs)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    rank_counts = [ranks] if isinstance(ranks, int) else list(ranks)
    if not rank_counts or min(rank_counts) < 1:
        raise ConfigError(f"ranks must be integers >= 1, got {ranks}")
    sizes = dict(models) if models is not None else {
        name: gb for name, gb in mlperf_checkpoint_sizes().items() if name in ("8B", "70B", "405B")
    }
    if not sizes or min(sizes.values()) <= 0:
        raise ConfigError("models must map names to checkpoint sizes > 0 GB")
    measured_gb = nbytes / GB
    rows: list[dict[str, Any]] = []
    for row in measured_costs(results):
        if row.stall_s <= 0 or (row.mode == "async" and row.persist_s <= 0):
            raise ConfigError(f"strategy {row.strategy!r} has no measured time to project from")
        is_async = row.mode == "async"
        stage_gbs = (d2h_gbs or measured_gb / row.stall_s) if is_async else math.nan
        write_gbs = rank_write_gbs or measured_gb / (row.persist_s if is_async else row.stall_s)
        for model, size_gb in sizes.items():
            for count in rank_counts:
                aggregate = min(storage_gbs, count * write_gbs)
                persist = size_gb / aggregate
                if is_async:
                    stall = size_gb / count / stage_gbs
                    backpressure = max(persist - interval_s, 0.0)
                    limited_by = "storage" if backpressure > 0 else "staging"
                else:
                    stall, backpressure = persist, 0.0
                    limited_by = "storage" if storage_gbs <= count * write_gbs else "ranks"
                rows.append(
                    {
                        "kind": "projection",
                        "strategy": row.strategy,
                        "mode": row.mode,
                        "model": model,
                        "checkpoint_gb": size_gb,
                        "ranks": count,
                        "per_rank_gb": size_gb / count,
                        "stage_gbs": stage_gbs,
                        "rank_write_gbs": write_gbs,
                        "aggregate_gbs": aggregate,
                        "limited_by": limited_by,
                        "stall_s": stall + backpressure,
                        "persist_s": persist,
                        "backpressure_s": backpressure,
                        "interval_s": interval_s,
                        "overhead_pct": 100.0 * (stall + backpressure) / interval_s,
                    }
                )
    projection = pd.DataFrame(rows, columns=PROJECTION_COLUMNS)
    projection.attrs.update(
        projection=True,
        storage_gbs=storage_gbs,
        measured_bytes=nbytes,
        note="projection from rates measured on one rank, not a measurement",
    )
    return projection
