"""nbckpt: see and fix what checkpointing costs a PyTorch training run.

The engine is :class:`Checkpointer`; experiments, figures, magics and widgets
are built on it (``nbckpt.experiment``, ``nbckpt.plots``, ``%load_ext nbckpt``,
``nbckpt.widgets``).
"""

from __future__ import annotations

from typing import Any

from ._errors import CheckpointError, ConfigError, NbckptError
from ._timeline import Event, Timeline
from ._util import run_directory
from .engine import CheckpointConfig, Checkpointer, SaveHandle, SaveRecord, close_all

__version__ = "0.1.0"

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "Event",
    "NbckptError",
    "SaveHandle",
    "SaveRecord",
    "Timeline",
    "__version__",
    "close_all",
    "load_ipython_extension",
    "run_directory",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbckpt``: register the ``%ckpt_*`` magics (IPython is imported only now)."""
    from .magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbckpt``: wait for saves in flight, release directories, drop the magics."""
    from .magics import unload

    unload(ipython)
