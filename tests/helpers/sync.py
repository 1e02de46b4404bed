"""Synchronisation helpers for tests: wait on conditions, never on the clock alone; press Ctrl-C
once the main thread waits."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest


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


@contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread, as in a terminal or a notebook."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def press_ctrl_c_once_blocked(saving: threading.Event) -> None:
    """From another thread: once a save is writing and the main thread waits, send SIGINT.
    Waits for both without a clock (a timeout ran out on a loaded machine and pressed early)."""
    armed = threading.Event()

    def press() -> None:
        saving.wait()
        armed.wait()  # not while the main thread still waits in Thread.start() for this thread
        until(main_thread_blocked, timeout=math.inf)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    threading.Thread(target=press, daemon=True).start()
    armed.set()
