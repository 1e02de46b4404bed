"""The one set of assumptions the report and notebook 07 advise with (:data:`DEFAULTS`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DEFAULTS", "AdvisorDefaults"]


@dataclass(frozen=True, kw_only=True)
class AdvisorDefaults:
    """The assumptions the report and notebook 07 use (a test keeps their parameter cells equal)."""

    gpus: int = 1024
    """GPUs of the job advised for (an assumption, not this machine)."""
    job_mtbf_hours: float | None = None
    """The job's MTBF, hours; None: Meta's fit for ``gpus`` (the engine's ``job_mtbf_s``: 7.9 h
    at 1,024 GPUs, Kokolis et al., HPCA 2025)."""
    restore_s: float = 120.0
    """Restart and load time after a failure (an assumption; measure yours)."""
    storage_gbs: float = 100.0
    """Aggregate write bandwidth of the storage in the projection, GB/s (an assumption)."""
    d2h_gbs: float = 52.8
    """Per-rank staging rate in the projection: nvbandwidth's H100 SM-kernel copy (torch's tensor
    copies use the copy engines, which it does not measure)."""
    gpu_memory_gb: float = 80.0
    """GPU memory per rank (H100 80GB): more state per rank than this cannot exist."""
    interval_s: float = 1800.0
    """Checkpoint interval the projected overhead is computed for."""
    sharding: str = "full"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULTS = AdvisorDefaults()
