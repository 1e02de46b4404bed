"""What a save gives back: a handle on its two phases, and the record of what it cost."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from .._errors import CheckpointError
from ._staging import Slot

__all__ = ["SaveHandle", "SaveRecord"]


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost. Times in seconds; ``stall_s`` is what the caller was blocked.

    ``cpu_s`` counts the CPU time of nbckpt's own threads for this save (copying, hashing,
    writing); the kernel's share of writing back pages after ``write`` returns is not in it.
    """

    step: int
    path: str
    bytes: int
    stall_s: float
    stage_s: float
    persist_s: float
    wait_s: float
    write_gbs: float
    cpu_s: float

    def to_dict(self) -> dict[str, Any]:
        """The record as plain values (for JSON and DataFrames)."""
        return asdict(self)


class SaveHandle:
    """One save in its two phases: ``staged`` (host copy done) and ``committed`` (durable)."""

    def __init__(self, step: int, nbytes: int, seq: int, *, reported: bool) -> None:
        self.step = step
        self.bytes = nbytes
        self.seq = seq
        self.staged: Future[None] = Future()
        self.committed: Future[SaveRecord] = Future()
        self.phase = "staging"
        self.stall_s = 0.0
        self.stage_s = 0.0
        self.wait_s = 0.0
        self.reported = reported
        self.slot: Slot | None = None
        self.returned = threading.Event()
        """Set once ``save`` has returned: ``stall_s`` is final."""

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self.committed.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied; required before mutating it with ``overlap=True``."""
        self._result(self.staged, timeout)

    def wait(self, timeout: float | None = None) -> SaveRecord:
        """Block until committed; raises :class:`CheckpointError` if the save failed."""
        record: SaveRecord = self._result(self.committed, timeout)
        return record

    def _result(self, future: Future[Any], timeout: float | None) -> Any:
        try:
            return future.result(timeout)
        except CheckpointError:
            self.reported = True
            raise

    @property
    def error(self) -> BaseException | None:
        """The CheckpointError of a failed save; None while running or after success."""
        return self.committed.exception() if self.committed.done() else None

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} {self.phase}>"
