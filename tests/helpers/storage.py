"""Stand between the engine and every file it creates: hold writes back, slow them, or fail them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from nbckpt.engine._faults import armed


class Throttle:
    """Holds the next save's file writes back, or slows each one (a slow target)."""

    def __init__(self, root: str = "") -> None:
        self.root = root  # only files under it: a writer thread another test left running goes on
        self.entered = threading.Event()  # a save has started writing files
        self.release = threading.Event()  # writes may go on
        self.release.set()
        self.delay_s = 0.0  # per file written: a slow target
        self.fail: Callable[[str], BaseException | None] = lambda name: None

    def hold(self) -> None:
        """Hold back the writes of the next save; ``entered`` tells when it has reached them."""
        self.entered.clear()
        self.release.clear()

    @contextmanager
    def released_after(self) -> Iterator[None]:
        """Writes held (``hold``) inside the block are released on leaving it, also by a failed
        assertion (a Checkpointer closed after it would otherwise wait for them for ever)."""
        try:
            yield
        finally:
            self.release.set()

    def reached(self, location: str, name: str) -> None:
        """The engine is about to create file ``name`` of a step at ``location`` (the fault seam
        ``store.sink``): hold it, slow it or fail it as the test said."""
        if not os.fspath(location).startswith(self.root):
            return
        self.entered.set()
        # Held until the test (or, at the latest, this fixture's teardown) releases it: never
        # by a clock, which a loaded machine outruns (the held save failed before the test
        # looked at it, and the test read a failed save as a finished one).
        self.release.wait()
        time.sleep(self.delay_s)  # the slow target itself, not synchronisation
        error = self.fail(name)
        if error is not None:
            raise error


@pytest.fixture
def throttle(tmp_path: Any) -> Any:
    gate = Throttle(os.fspath(tmp_path))
    with armed("store.sink", gate.reached):
        yield gate
        gate.release.set()  # never leave a writer thread stuck
