"""Stand between the engine and every file it creates: hold writes back, slow them, or fail them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from nbckpt.engine._store import LocalStore


class Throttle:
    """Holds the next save's file writes back, or slows each one (a slow target)."""

    def __init__(self) -> None:
        self.entered = threading.Event()  # a save has started writing files
        self.release = threading.Event()  # writes may go on
        self.release.set()
        self.delay_s = 0.0  # per file written: a slow target
        self.fail: Callable[[str], BaseException | None] = lambda name: None

    def hold(self) -> None:
        """Hold back the writes of the next save; ``entered`` tells when it has reached them."""
        self.entered.clear()
        self.release.clear()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = LocalStore.sink
        throttle = self

        def sink(store: LocalStore, location: str, name: str) -> Any:
            throttle.entered.set()
            assert throttle.release.wait(60), "the test never released the writes"
            time.sleep(throttle.delay_s)  # the slow target itself, not synchronisation
            error = throttle.fail(name)
            if error is not None:
                raise error
            return original(store, location, name)

        monkeypatch.setattr(LocalStore, "sink", sink)


@pytest.fixture
def throttle(monkeypatch: pytest.MonkeyPatch) -> Any:
    gate = Throttle()
    gate.install(monkeypatch)
    yield gate
    gate.release.set()  # never leave a writer thread stuck
