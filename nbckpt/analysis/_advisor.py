"""How often to checkpoint (Young/Daly) and what checkpointing would cost at scale.

Both work from measured costs, one row per strategy as in ``Comparison.results``: the stall
the training loop saw per checkpoint, the time until the checkpoint was durable
(``persist_s``), and the **drag**: loop time lost per checkpoint beyond the stall, while the
background write competes with training for the host (``drag_s``; on a GPU node the PyTorch
blog on cached save plans reports a background save of about 436 s before its fixes and about
67 s after, for Llama3-70B on 1856 H200 GPUs).

The interval model is first-order (Young 1974, Daly 2006), valid while the cost and the interval
are small against the MTBF. With per-checkpoint cost ``C = stall + drag``, interval ``tau``
(training time between checkpoints) and job MTBF ``M``, the fraction of time lost is::

    waste(tau) = C / tau + (tau / 2 + lag + R) / M

``C / tau`` is the stall and drag; each failure (rate ``1 / M``) loses on average half an
interval of work, the restore time ``R``, and for async checkpoints the ``lag`` between the
snapshot and the moment it is durable (a failure in that window falls back to the previous
checkpoint). ``lag`` and ``R`` do not depend on ``tau``, so Young's ``sqrt(2 C M)`` is the
optimum; Daly's expansion refines it. With one save in flight an async interval shorter than
the persist time would make the next save wait, so the advised interval is never shorter than
``lag``. The **storage duty cycle** is the share of time the storage is busy writing this job's
checkpoints, ``persist / (tau + stall)``: what the job takes from storage others share.

The assumptions the report and notebook 07 share are :data:`DEFAULTS` (stated where they are
used). The job MTBF is a node MTBF divided by the nodes; the default node MTBF comes from
Llama 3's report (419 unexpected interruptions in 54 days on 16,384 GPUs, 8 per node:
:func:`node_mtbf_hours`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeAlias

import pandas as pd

from .._errors import ConfigError
from .._util import GB
from ._reference import load_published

__all__ = [
    "ADVICE_COLUMNS",
    "DEFAULTS",
    "PROJECTION_COLUMNS",
    "SHARDING",
    "AdvisorDefaults",
    "Cost",
    "advise",
    "checkpoint_gb",
    "cluster_mtbf_s",
    "compare_modes",
    "expected_waste",
    "measured_costs",
    "measurements",
    "mlperf_checkpoint_sizes",
    "node_mtbf_hours",
    "project_scale",
    "waste_curve",
    "young_daly_interval",
]

HOUR_S = 3600.0
DAY_S = 86400.0


def node_mtbf_hours(
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
    if not (count > 0 and span > 0 and fleet > 0 and gpus_per_node >= 1):
        raise ConfigError("interruptions, days, gpus and gpus_per_node must be > 0")
    return span * 24.0 * (fleet / gpus_per_node) / count


#: How the projection places the state on ranks: ``full`` (FSDP/ZeRO-3: split evenly, no
#: replica, every rank writes its shard) or ``replicated`` (DDP: every rank holds the whole
#: state and one rank writes it, as notebook 05 shows).
SHARDING = ("full", "replicated")


@dataclass(frozen=True)
class AdvisorDefaults:
    """The one set of assumptions the report and notebook 07 use (their parameter cells
    repeat these values, and a test keeps them equal)."""

    mtbf_hours: float = float(round(node_mtbf_hours()))
    """Node MTBF, hours: Llama 3's 419 interruptions in 54 days on 16,384 GPUs (8 per node)."""
    gpus: int = 1024
    """GPUs of the job advised for (an assumption, not this machine)."""
    gpus_per_node: int = 8
    restore_s: float = 120.0
    """Restart and load time after a failure (an assumption; measure yours)."""
    storage_gbs: float = 100.0
    """Aggregate write bandwidth of the storage in the projection, GB/s (an assumption)."""
    d2h_gbs: float = 52.8
    """Per-rank device-to-host staging rate in the projection: nvbandwidth's H100
    ``device_to_host_memcpy_sm``, an SM-kernel copy; torch's tensor copies use the copy
    engines, which that source does not measure."""
    gpu_memory_gb: float = 80.0
    """GPU memory per rank (H100 80GB): more state per rank than this cannot exist."""
    interval_s: float = 1800.0
    """Checkpoint interval the projected overhead is computed for."""
    sharding: str = "full"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULTS = AdvisorDefaults()

#: Columns :func:`advise` returns.
ADVICE_COLUMNS = [
    "strategy", "mode", "stall_s", "drag_s", "cost_s", "persist_s", "lag_s", "restore_s",
    "cluster_mtbf_h", "interval_s", "bound", "checkpoint_pct", "drag_pct", "rework_pct",
    "restore_pct", "waste_pct", "storage_duty_pct", "gpu_hours_lost_per_day",
    "checkpoints_per_day",
]

#: Columns :func:`project_scale` returns.
PROJECTION_COLUMNS = [
    "kind", "strategy", "mode", "model", "checkpoint_gb", "ranks", "sharding", "per_rank_gb",
    "feasible", "note", "stage_gbs", "rank_write_gbs", "aggregate_gbs", "limited_by", "stall_s",
    "drag_s", "persist_s", "backpressure_s", "interval_s", "storage_duty_pct", "overhead_pct",
]

Measured: TypeAlias = pd.DataFrame | Mapping[str, tuple[float, ...]]


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
    drag_s: float = 0.0


def measured_costs(results: Measured) -> list[Cost]:
    """:func:`measurements` as a list of :class:`Cost`."""
    return [
        Cost(str(r["strategy"]), str(r["mode"]),
             *(float(r[k]) for k in ("stall_s", "persist_s", "lag_s", "drag_s")))
        for r in measurements(results).to_dict("records")
    ]


def measurements(results: Measured) -> pd.DataFrame:
    """Normalise measured costs to columns ``strategy, mode, stall_s, persist_s, lag_s, drag_s``.

    ``results`` is ``Comparison.results`` (``stall_mean_s``, ``persist_s``, ``drag_s``; an optional
    ``mode`` column of ``"sync"``/``"async"``) or a mapping ``strategy -> (stall_s, persist_s)``
    or ``(stall_s, persist_s, drag_s)``. Rows without a checkpoint (the ``none`` baseline) and
    partial rows (a stopped run) are dropped. Without a ``mode`` column a strategy counts as async
    when its persist time exceeds its stall (the write went on after the loop resumed). A drag
    below 0 is measurement noise and counts as 0; no drag column means 0.
    """
    if isinstance(results, pd.DataFrame):
        stall_column = "stall_mean_s" if "stall_mean_s" in results.columns else "stall_s"
        missing = {"strategy", stall_column} - set(results.columns)
        if missing:
            raise ConfigError(
                f"results need columns strategy and stall_mean_s (or stall_s); missing {sorted(missing)}"
            )

        def column(name: str) -> Any:
            return pd.to_numeric(results[name] if name in results.columns else 0.0, errors="coerce")

        frame = pd.DataFrame(
            {
                "strategy": results["strategy"].astype(str),
                "stall_s": pd.to_numeric(results[stall_column], errors="coerce"),
                "persist_s": column("persist_s"),
                "drag_s": column("drag_s"),
            }
        )
        if "mode" in results.columns:
            frame["mode"] = results["mode"].astype(str)
        if "checkpoints" in results.columns:
            frame = frame[pd.to_numeric(results["checkpoints"], errors="coerce").fillna(0) > 0]
        if "partial" in results.columns:
            frame = frame[~results.loc[frame.index, "partial"].fillna(False).astype(bool)]
    else:
        rows = []
        for name, values in results.items():
            numbers = [float(v) for v in values]
            if len(numbers) not in (2, 3):
                raise ConfigError(f"{name}: give (stall_s, persist_s) or (stall_s, persist_s, drag_s)")
            rows.append((name, *numbers[:2], numbers[2] if len(numbers) == 3 else 0.0))
        frame = pd.DataFrame(rows, columns=["strategy", "stall_s", "persist_s", "drag_s"])
    frame = frame[(frame["strategy"] != "none") & frame["stall_s"].notna()].copy()
    if frame.empty:
        raise ConfigError("no strategy with a measured checkpoint stall (only 'none' or empty results)")
    if (frame["stall_s"] < 0).any():
        raise ConfigError("measured stall times must be >= 0 seconds")
    frame["persist_s"] = frame["persist_s"].fillna(0.0)
    frame["drag_s"] = frame["drag_s"].fillna(0.0).clip(lower=0.0)
    if "mode" not in frame.columns:
        frame["mode"] = (frame["persist_s"] > frame["stall_s"]).map({True: "async", False: "sync"})
    elif not frame["mode"].isin(["sync", "async"]).all():
        raise ConfigError(f"mode must be 'sync' or 'async', got {sorted(set(frame['mode']))}")
    frame["lag_s"] = frame["persist_s"].where(frame["mode"] == "async", 0.0)
    columns = ["strategy", "mode", "stall_s", "persist_s", "lag_s", "drag_s"]
    return frame[columns].reset_index(drop=True)


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
    sharding: str = "full",
    gpu_memory_gb: float | None = DEFAULTS.gpu_memory_gb,
    drag_fraction: float | None = None,
) -> pd.DataFrame:
    """Project stall, drag, storage load and overhead of each measured strategy to bigger models.

    A projection, not a measurement (column ``kind`` and ``attrs["projection"]`` say so). Inputs:
    ``results`` measured on one rank with a checkpoint of ``nbytes`` bytes; ``models`` maps a name
    to a checkpoint size in GB (default: MLPerf Storage sizes for 8B, 70B and 405B); ``sharding``
    (:data:`SHARDING`) places the state on ``ranks``; ``storage_gbs`` is the aggregate bandwidth of
    the storage (for example a FlashBlade's).

    - per rank: ``size / ranks`` (``full``) or ``size`` (``replicated``). A configuration whose
      state per rank exceeds ``gpu_memory_gb`` cannot exist: its row has ``feasible`` False, a
      ``note`` saying why, and no numbers.
    - writers: every rank (``full``) or one (``replicated``); the write runs at
      ``min(storage_gbs, writers * rank_write)``, ``rank_write`` defaulting to the measured rate.
    - sync: the loop waits for the write. async: the loop waits for the copy to host,
      ``per rank / stage_gbs`` (``d2h_gbs``, default the measured ``nbytes / stall``), the write
      runs behind; when it outlasts the interval the next save waits (``backpressure_s``).
    - drag: ``drag_fraction * persist`` for async strategies, the fraction defaulting to the
      measured ``drag_s / persist_s`` (0 to 1); a CPU measurement where training and the write
      share the cores overstates what a GPU node sees.
    - ``storage_duty_pct = 100 * persist / (interval + stall)``;
      ``overhead_pct = 100 * (stall + backpressure + drag) / interval_s``.
    """
    if nbytes <= 0:
        raise ConfigError(f"nbytes (size of the measured checkpoint) must be > 0, got {nbytes}")
    for name, value in (("storage_gbs", storage_gbs), ("interval_s", interval_s),
                        ("d2h_gbs", d2h_gbs), ("rank_write_gbs", rank_write_gbs),
                        ("gpu_memory_gb", gpu_memory_gb)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if drag_fraction is not None and not 0 <= drag_fraction <= 1:
        raise ConfigError(f"drag_fraction must be between 0 and 1, got {drag_fraction}")
    if sharding not in SHARDING:
        raise ConfigError(f"sharding must be one of {', '.join(SHARDING)}, not {sharding!r}")
    rank_counts = [ranks] if isinstance(ranks, int) else list(ranks)
    if not rank_counts or min(rank_counts) < 1:
        raise ConfigError(f"ranks must be integers >= 1, got {ranks}")
    sizes = dict(models) if models is not None else {
        name: gb for name, gb in mlperf_checkpoint_sizes().items() if name in ("8B", "70B", "405B")
    }
    if not sizes or min(sizes.values()) <= 0:
        raise ConfigError("models must map names to checkpoint sizes > 0 GB")
    measured_gb = nbytes / GB
    nan = math.nan
    rows: list[dict[str, Any]] = []
    for row in measured_costs(results):
        if row.stall_s <= 0 or (row.mode == "async" and row.persist_s <= 0):
            raise ConfigError(f"strategy {row.strategy!r} has no measured time to project from")
        is_async = row.mode == "async"
        stage_gbs = (d2h_gbs or measured_gb / row.stall_s) if is_async else nan
        write_gbs = rank_write_gbs or measured_gb / (row.persist_s if is_async else row.stall_s)
        if not is_async:
            fraction = 0.0
        elif drag_fraction is not None:
            fraction = drag_fraction
        else:
            fraction = min(max(row.drag_s / row.persist_s, 0.0), 1.0)
        for model, size_gb in sizes.items():
            for count in rank_counts:
                per_rank = size_gb / count if sharding == "full" else size_gb
                base = {
                    "kind": "projection", "strategy": row.strategy, "mode": row.mode,
                    "model": model, "checkpoint_gb": size_gb, "ranks": count,
                    "sharding": sharding, "per_rank_gb": per_rank, "interval_s": interval_s,
                    "stage_gbs": stage_gbs, "rank_write_gbs": write_gbs,
                }
                if gpu_memory_gb is not None and per_rank > gpu_memory_gb:
                    rows.append({
                        **base, "feasible": False,
                        "note": (f"cannot exist: {per_rank:.1f} GB of checkpointed state per rank "
                                 f"exceeds {gpu_memory_gb:g} GB of GPU memory"),
                        "aggregate_gbs": nan, "limited_by": "", "stall_s": nan, "drag_s": nan,
                        "persist_s": nan, "backpressure_s": nan, "storage_duty_pct": nan,
                        "overhead_pct": nan,
                    })
                    continue
                writers = count if sharding == "full" else 1
                aggregate = min(storage_gbs, writers * write_gbs)
                persist = size_gb / aggregate
                if is_async:
                    stall = per_rank / stage_gbs
                    backpressure = max(persist - interval_s, 0.0)
                    limited_by = "storage" if backpressure > 0 else "staging"
                else:
                    stall, backpressure = persist, 0.0
                    limited_by = "storage" if storage_gbs <= writers * write_gbs else "ranks"
                drag = fraction * persist
                duty = min(100.0, 100.0 * persist / (interval_s + stall + backpressure))
                rows.append({
                    **base, "feasible": True, "note": "", "aggregate_gbs": aggregate,
                    "limited_by": limited_by, "stall_s": stall + backpressure, "drag_s": drag,
                    "persist_s": persist, "backpressure_s": backpressure,
                    "storage_duty_pct": duty,
                    "overhead_pct": 100.0 * (stall + backpressure + drag) / interval_s,
                })
    projection = pd.DataFrame(rows, columns=PROJECTION_COLUMNS)
    projection.attrs.update(
        projection=True,
        storage_gbs=storage_gbs,
        measured_bytes=nbytes,
        sharding=sharding,
        gpu_memory_gb=gpu_memory_gb,
        note=("projection from rates measured on one rank, not a measurement; state "
              + ("split evenly over the ranks, every rank writing its shard"
                 if sharding == "full" else "replicated on every rank, one rank writing it")),
    )
    return projection
