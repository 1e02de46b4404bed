"""What checkpointing would cost at scale: costs measured on one rank projected to bigger models
and more ranks (:func:`project_scale`), a projection and labelled as one.

Per strategy, model size and rank count: the state per rank is ``size / ranks`` (``full``) or
``size`` (``replicated``); more than ``gpu_memory_gb`` cannot exist (``feasible`` False, a
``note``, no numbers). Every rank writes (``full``) or one does, at ``min(storage_gbs, writers *
measured rank rate)``. Sync: the loop waits for the write. Async: it waits for the copy to host
(``per rank / d2h_gbs``, default the measured rate) and, when the write outlasts the interval, for
the write (``backpressure_s``); the drag is the measured share ``drag_s / persist_s`` of the
write, which a CPU run overstates. ``overhead_pct = 100 * (stall + backpressure + drag) / interval``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from .._errors import ConfigError
from .._util import GB, check_count
from ._costs import Measured, measurements
from ._defaults import DEFAULTS
from ._reference import load_published

__all__ = ["PROJECTION_COLUMNS", "SHARDING", "checkpoint_gb", "mlperf_checkpoint_sizes", "project_scale"]

#: How the projection places the state on ranks: ``full`` (FSDP/ZeRO-3: split evenly, no
#: replica, every rank writes its shard) or ``replicated`` (DDP: every rank holds the whole
#: state and one rank writes it, as notebook 05 shows).
SHARDING = ("full", "replicated")

#: Columns :func:`project_scale` returns.
PROJECTION_COLUMNS = [
    "kind",
    "strategy",
    "mode",
    "model",
    "checkpoint_gb",
    "ranks",
    "sharding",
    "per_rank_gb",
    "feasible",
    "note",
    "stage_gbs",
    "rank_write_gbs",
    "aggregate_gbs",
    "limited_by",
    "stall_s",
    "drag_s",
    "persist_s",
    "backpressure_s",
    "interval_s",
    "storage_duty_pct",
    "overhead_pct",
]


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
    interval_s: float = DEFAULTS.interval_s,
    sharding: str = "full",
    gpu_memory_gb: float | None = DEFAULTS.gpu_memory_gb,
) -> pd.DataFrame:
    """Project stall, drag, storage load and overhead of each strategy, measured on one rank with a
    checkpoint of ``nbytes``, to ``models`` (name -> GB; default MLPerf Storage's 8B, 70B, 405B)
    on ``ranks`` against ``storage_gbs`` of aggregate bandwidth (the model: the module's doc)."""
    if nbytes <= 0:
        raise ConfigError(f"nbytes (size of the measured checkpoint) must be > 0, got {nbytes}")
    for name, value in (
        ("storage_gbs", storage_gbs),
        ("interval_s", interval_s),
        ("d2h_gbs", d2h_gbs),
        ("gpu_memory_gb", gpu_memory_gb),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
    if sharding not in SHARDING:
        raise ConfigError(f"sharding must be one of {', '.join(SHARDING)}, not {sharding!r}")
    rank_counts = [check_count(count, "ranks") for count in ([ranks] if isinstance(ranks, int) else ranks)]
    if not rank_counts:
        raise ConfigError(f"ranks must be integers >= 1, got {ranks}")
    sizes = (
        dict(models)
        if models is not None
        else {name: gb for name, gb in mlperf_checkpoint_sizes().items() if name in ("8B", "70B", "405B")}
    )
    if not sizes or min(sizes.values()) <= 0:
        raise ConfigError("models must map names to checkpoint sizes > 0 GB")
    measured_gb = nbytes / GB
    nan = math.nan
    rows: list[dict[str, Any]] = []
    for row in measurements(results).to_dict("records"):
        measured_stall, measured_persist = float(row["stall_s"]), float(row["persist_s"])
        is_async = row["mode"] == "async"
        if measured_stall <= 0 or (is_async and measured_persist <= 0):
            raise ConfigError(f"strategy {row['strategy']!r} has no measured time to project from")
        stage_gbs = (d2h_gbs or measured_gb / measured_stall) if is_async else nan
        write_gbs = measured_gb / (measured_persist if is_async else measured_stall)
        fraction = min(max(row["drag_s"] / measured_persist, 0.0), 1.0) if is_async else 0.0
        for model, size_gb in sizes.items():
            for count in rank_counts:
                per_rank = size_gb / count if sharding == "full" else size_gb
                base = {
                    "kind": "projection",
                    "strategy": row["strategy"],
                    "mode": row["mode"],
                    "model": model,
                    "checkpoint_gb": size_gb,
                    "ranks": count,
                    "sharding": sharding,
                    "per_rank_gb": per_rank,
                    "interval_s": interval_s,
                    "stage_gbs": stage_gbs,
                    "rank_write_gbs": write_gbs,
                }
                if gpu_memory_gb is not None and per_rank > gpu_memory_gb:
                    rows.append(
                        {  # the columns it lacks are NaN
                            **base,
                            "feasible": False,
                            "limited_by": "",
                            "note": (
                                f"cannot exist: {per_rank:.1f} GB of checkpointed state per rank "
                                f"exceeds {gpu_memory_gb:g} GB of GPU memory"
                            ),
                        }
                    )
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
                rows.append(
                    {
                        **base,
                        "feasible": True,
                        "note": "",
                        "aggregate_gbs": aggregate,
                        "limited_by": limited_by,
                        "stall_s": stall + backpressure,
                        "drag_s": drag,
                        "persist_s": persist,
                        "backpressure_s": backpressure,
                        "storage_duty_pct": duty,
                        "overhead_pct": 100.0 * (stall + backpressure + drag) / interval_s,
                    }
                )
    projection = pd.DataFrame(rows, columns=PROJECTION_COLUMNS)
    placement = (
        "split evenly over the ranks, every rank writing its shard"
        if sharding == "full"
        else "replicated on every rank, one rank writing it"
    )
    projection.attrs.update(
        projection=True,
        storage_gbs=storage_gbs,
        measured_bytes=nbytes,
        sharding=sharding,
        gpu_memory_gb=gpu_memory_gb,
        note=f"projection from rates measured on one rank, not a measurement; state {placement}",
    )
    return projection
