"""Stand between the engine and every file it creates: hold writes back, slow them, or fail them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from nbckpt.engine._store import LocalStore


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

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = LocalStore.sink
        throttle = self

        def sink(store: LocalStore, location: str, name: str) -> Any:
            if not os.fspath(location).startswith(throttle.root):
                return original(store, location, name)
            throttle.entered.set()
            # Held until the test (or, at the latest, this fixture's teardown) releases it: never
            # by a clock, which a loaded machine outruns (the held save failed before the test
            # looked at it, and the test read a failed save as a finished one).
            throttle.release.wait()
            time.sleep(throttle.delay_s)  # the slow target itself, not synchronisation
            error = throttle.fail(name)
            if error is not None:
                raise error
            return original(store, location, name)

        monkeypatch.setattr(LocalStore, "sink", sink)


@pytest.fixture
def throttle(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> Any:
    gate = Throttle(os.fspath(tmp_path))
    gate.install(monkeypatch)
    yield gate
    gate.release.set()  # never leave a writer thread stuck
