"""Every private name of DCP's checkpoint process nbckpt touches, in one place (checked with
torch 2.13 and 2.14).

torch's checkpoint process sets its root logger to INFO and logs every request at INFO on
stderr (a notebook shows each line). nbckpt starts that process with a target of its own that
lowers the level to WARNING inside the child only, then runs torch's loop; the swap of the
target lasts from nbckpt's save call until the spawn is over. :func:`missing` (tested) names
what a torch release changed; :func:`quiet_spawn` is then a no-op (the process logs at INFO).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["missing", "quiet_spawn"]

_SPAWN_LOCK = threading.Lock()


def _warning_logger(rank: int) -> None:
    """Stands in for DCP's ``_init_logger`` in the checkpoint process: warnings and errors only."""
    logging.basicConfig(
        level=logging.WARNING,
        force=True,
        format=f"[{rank}] %(asctime)s - %(name)s - %(levelname)s - %(message)s",
    )


def _quiet_checkpoint_process(pg_init_info: Any, parent_conn: Any) -> None:
    """The spawned checkpoint process's target (importable, so ``spawn`` can pickle it)."""
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._init_logger = _warning_logger  # type: ignore[attr-defined]  # this child only
    # Ctrl-C in a terminal, or a Jupyter kernel's interrupt and shutdown, signal the whole process
    # group: the writer would die mid-checkpoint with a traceback. Its parent ends it instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    executor._AsyncCheckpointProcess._checkpointing_subprocess(pg_init_info, parent_conn)


def quiet_spawn() -> Callable[[], None]:
    """Make the next spawn of DCP's checkpoint process quiet; returns the undo (idempotent).

    A no-op where the process already runs or torch's internals differ from torch 2.13's.
    """
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return lambda: None
    holder = getattr(executor, "_AsyncCheckpointProcess", None)
    original = holder.__dict__.get("_checkpointing_subprocess") if holder is not None else None
    if getattr(executor, "_CHECKPOINT_PROCESS", True) is not None or not isinstance(original, staticmethod):
        return lambda: None
    quiet = staticmethod(_quiet_checkpoint_process)
    with _SPAWN_LOCK:
        holder._checkpointing_subprocess = quiet  # type: ignore[union-attr]

    def undo() -> None:
        with _SPAWN_LOCK:
            if holder.__dict__.get("_checkpointing_subprocess") is quiet:  # type: ignore[union-attr]
                holder._checkpointing_subprocess = original  # type: ignore[union-attr]

    return undo


def missing() -> list[str]:
    """The private names of ``torch.distributed.checkpoint._async_process_executor`` that
    :func:`quiet_spawn` relies on and this torch lacks (none: all is well)."""
    try:
        from torch.distributed.checkpoint import _async_process_executor as executor
    except ImportError:
        return [f"torch {torch.__version__}: torch.distributed.checkpoint._async_process_executor"]
    holder = getattr(executor, "_AsyncCheckpointProcess", None)
    found = {
        "_init_logger": callable(getattr(executor, "_init_logger", None)),
        "_CHECKPOINT_PROCESS": hasattr(executor, "_CHECKPOINT_PROCESS"),
        "_AsyncCheckpointProcess._checkpointing_subprocess": holder is not None
        and isinstance(holder.__dict__.get("_checkpointing_subprocess"), staticmethod),
    }
    return [f"torch {torch.__version__}: {name}" for name, ok in found.items() if not ok]
