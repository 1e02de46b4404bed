"""The one set of assumptions the report and notebook 07 advise with (:data:`DEFAULTS`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ._interval import node_mtbf_hours

__all__ = ["DEFAULTS", "AdvisorDefaults"]


@dataclass(frozen=True, kw_only=True)
class AdvisorDefaults:
    """The assumptions the report and notebook 07 use (a test keeps their parameter cells equal)."""

    mtbf_hours: float = float(round(node_mtbf_hours()))
    """Node MTBF, hours: Llama 3's 419 interruptions in 54 days on 16,384 GPUs (8 per node)."""
    gpus: int = 1024
    """GPUs of the job advised for (an assumption, not this machine)."""
    gpus_per_node: int = 8
    restore_s: float = 120.0
    """Restart and load time after a failure (an assumption; measure yours)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


DEFAULTS = AdvisorDefaults()
