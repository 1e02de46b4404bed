"""Fault injection for the reliability tests: once a test process calls ``arm(point)``, reaching
``point`` kills it.

Points: ``after_data`` (files written, no manifest), ``before_rename`` (manifest written, not yet
renamed into place), ``after_swap`` and ``between_renames`` (a re-save's two ways of putting the
new copy in place), ``during_delete`` (retention half done). Nothing is read from the
environment: a process is armed only by a test that says so.
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
