"""Transition shim: the engine moved to :mod:`nbckpt.engine` (removed with the package layout)."""

from .engine import CheckpointConfig, Checkpointer, SaveHandle, SaveRecord

__all__ = ["CheckpointConfig", "Checkpointer", "SaveHandle", "SaveRecord"]
