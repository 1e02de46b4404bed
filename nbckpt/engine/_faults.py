"""Fault injection for the reliability tests: ``NBCKPT_CRASH_AT=point`` kills the process there.

Points: ``after_data`` (files written, no manifest), ``before_rename`` (manifest
written, not yet renamed into place), ``during_delete`` (retention half done).
"""

from __future__ import annotations

import os
import signal

__all__ = ["hit"]

_POINT = os.environ.get("NBCKPT_CRASH_AT", "")


def hit(point: str) -> None:
    if point == _POINT:
        os.kill(os.getpid(), signal.SIGKILL)
