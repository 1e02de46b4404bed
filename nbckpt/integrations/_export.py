"""``export``: one checkpoint step as a single ``torch.load``-able file, values included."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._errors import ConfigError
from ._common import atomic_torch_save, load

__all__ = ["export"]


def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    map_location: str | torch.device | None = None,
) -> str:
    """Write the checkpoint ``source`` names as one nested dict to ``out`` with ``torch.save``.

    ``source`` is a step directory (``run1/step-000120``) or a pointer file nbckpt wrote for a
    framework (a Lightning ``.ckpt``). The result is what ``torch.load(out)`` gives: modules and
    optimizers as state dicts (with ``param_groups``), tensors on CPU (or ``map_location``), and
    every plain value the checkpoint holds, so a Lightning pointer exported this way is a real
    Lightning checkpoint (``Model.load_from_checkpoint(out)``). Every block is verified while it
    is read; ``out`` is replaced atomically. Returns ``out`` as an absolute path.
    """
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).strip():
        raise ConfigError(f"out must be a file path, not {out!r}")
    target = os.path.abspath(os.fspath(out))
    if os.path.isdir(target):
        raise ConfigError(f"out {out} is a directory; name the file to write")
    if not os.path.isdir(os.path.dirname(target)):
        raise ConfigError(f"the directory of {out} does not exist")
    state: dict[str, Any] = load(source, map_location=map_location)
    atomic_torch_save(state, target)
    return target
