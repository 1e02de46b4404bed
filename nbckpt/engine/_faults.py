"""Fault injection for the reliability tests: once a test process calls ``arm(point)``, reaching
``point`` kills it (nothing is read from the environment). Points: ``after_data`` (files
written, no manifest), ``before_rename`` (manifest written, not renamed), ``after_swap`` and
``between_renames`` (a re-save's two ways of putting the new copy in place), ``during_delete``.
"""

from __future__ import annotations

import os
import signal

__all__ = ["arm", "hit"]

_armed: str | None = None


def arm(point: str | None) -> None:
    """Kill this process with SIGKILL when it reaches ``point`` (None: never)."""
    global _armed
    _armed = point


def hit(point: str) -> None:
    if point == _armed:
        os.kill(os.getpid(), signal.SIGKILL)
