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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULTS = AdvisorDefaults()
