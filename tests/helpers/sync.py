"""Synchronisation helpers for tests: wait on conditions, never on the clock alone."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def main_thread_blocked() -> bool:
    """Whether the main thread sits in a lock wait (threading.Condition.wait)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename == threading.__file__:
            return True
        frame = frame.f_back
    return False


def until(condition: Callable[[], bool], timeout: float = 30.0, poll_s: float = 0.001) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; return whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
