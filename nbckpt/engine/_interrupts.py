"""Sections a Ctrl-C must not cut in two: loading a restored state into the caller's objects (half
loaded is worse than not at all), and asking torch.save for a blob's framing (its zip writer,
cut mid-record, raises a second, unrelated error from its own clean-up)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["deferred_interrupt"]


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block is over, then deliver
    it as the handler in place would have (a KeyboardInterrupt, by default). Only the main thread
    receives signals; elsewhere the block just runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught and callable(previous):
        previous(signal.SIGINT, caught[0])
