"""Transition shim: moved to :mod:`nbckpt.engine` (removed with the package layout)."""

from .engine._state import flatten

__all__ = ["flatten"]
