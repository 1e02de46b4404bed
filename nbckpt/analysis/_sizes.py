"""How big a checkpoint is: :func:`checkpoint_gb` from a parameter count.

What a checkpoint costs a job on many ranks is measured, not projected from one rank: ``nbckpt
bench --ranks 1,2,4`` on a node, ``torchrun``/``srun`` on a cluster, the curve from
:func:`nbckpt.analysis.scaling_table`.
"""

from __future__ import annotations

from .._errors import ConfigError
from .._util import GB

__all__ = ["checkpoint_gb"]


def checkpoint_gb(params: float, bytes_per_param: float = 16.0) -> float:
    """Checkpoint size in GB: model and AdamW state are about 16 bytes per parameter in mixed
    precision (bf16 weights 2, fp32 master 4, two fp32 moments 8, plus 2 of slack)."""
    if params <= 0 or bytes_per_param <= 0:
        raise ConfigError("params and bytes_per_param must be > 0")
    return params * bytes_per_param / GB
