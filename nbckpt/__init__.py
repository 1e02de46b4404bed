"""nbckpt: see and fix what checkpointing costs a PyTorch training run.

The engine's face is :class:`Checkpointer`. Above it, in layers that import only downwards:
``nbckpt.bench`` (workloads, strategies side by side, floors, the storage probe),
``nbckpt.analysis`` (advisor, published figures, conclusions), ``nbckpt.notebook`` (magics:
``%load_ext nbckpt``, the lab, figures, the report), ``nbckpt.integrations`` (Lightning,
Hugging Face) and ``nbckpt.cli``. See docs/architecture.md; docs/api.md lists the public names.

``import nbckpt`` imports the engine alone, which is all the core install (``pip install
nbckpt``) carries; each face above it is imported when used and needs its extra
(``nbckpt[notebook]``, ``[s3]``, ``[lightning]``, ``[hf]``).
"""

from __future__ import annotations

import logging
from typing import Any

from ._errors import CheckpointError, ConfigError, NbckptError
from ._util import run_directory
from ._version import __version__
from .engine import (
    AnyOf,
    BestN,
    CheckpointConfig,
    Checkpointer,
    CustomSteps,
    Event,
    EveryNSteps,
    LatestN,
    RetentionPolicy,
    SaveHandle,
    SaveRecord,
    SaveSchedule,
    Timeline,
    close_all,
)

# Background events (a failed delete, a final save on SIGTERM) go to this logger. A library
# leaves the choice of where they go to the application: without a handler of the
# application's own they stay quiet (``%load_ext nbckpt`` shows them in the notebook).
logging.getLogger("nbckpt").addHandler(logging.NullHandler())

# ``load_ipython_extension`` and ``unload_ipython_extension`` are IPython's hooks for
# ``%load_ext nbckpt``, not names to call: they stay out of ``__all__``.

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "ConfigError",
    "CustomSteps",
    "Event",
    "EveryNSteps",
    "LatestN",
    "NbckptError",
    "RetentionPolicy",
    "SaveHandle",
    "SaveRecord",
    "SaveSchedule",
    "Timeline",
    "__version__",
    "close_all",
    "run_directory",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext nbckpt``: register the ``%ckpt_*`` magics (IPython is imported only now)."""
    from .notebook._magics import load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext nbckpt``: wait for saves in flight, release directories, drop the magics."""
    from .notebook._magics import unload

    unload(ipython)
