"""What a save gives back and leaves behind: a handle on its two phases, the record of what it
cost, and a thread-safe log of timed events (the data every timeline figure is drawn from)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, ConfigError, require_extra
from ._workers import refuse_waits, settle

if TYPE_CHECKING:
    import pandas as pd

    from ._staging import Slot

__all__ = ["Event", "SaveHandle", "SaveRecord", "Timeline", "events_to_pandas", "now_ns"]

EventListener = Callable[["Event"], None]
_log = logging.getLogger("nbckpt")


def now_ns() -> int:
    """The clock every event uses (monotonic, nanoseconds)."""
    return time.perf_counter_ns()


@dataclass(frozen=True)
class Event:
    """One phase with a start and an end on the :func:`now_ns` clock.

    Kinds: ``step`` (the runner's training step), ``stall`` (the loop blocked by a save),
    ``wait`` (backpressure), ``stage``, ``persist``, ``fsync``, ``commit``, ``delete``
    (retention), ``upload`` (to the mirror), ``restore``, ``error``.
    """

    kind: str
    start_ns: int
    end_ns: int
    step: int | None = None
    rank: int = 0
    bytes: int = 0
    thread: str = ""
    pid: int = 0
    label: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class Timeline:
    """Append-only event log; listeners are called on the thread that records."""

    def __init__(self, rank: int = 0, label: str = "") -> None:
        self.rank = rank
        self.label = label
        self.origin_ns = now_ns()
        self._events: list[Event] = []
        self._lock = threading.Lock()
        self._listeners: list[EventListener] = []

    def add_listener(self, listener: EventListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: EventListener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def record(
        self,
        kind: str,
        start_ns: int,
        end_ns: int | None = None,
        *,
        step: int | None = None,
        nbytes: int = 0,
        **detail: Any,
    ) -> Event:
        event = Event(
            kind=kind,
            start_ns=start_ns,
            end_ns=now_ns() if end_ns is None else end_ns,
            step=step,
            rank=self.rank,
            bytes=nbytes,
            thread=threading.current_thread().name,
            pid=os.getpid(),
            label=self.label,
            detail=detail,
        )
        with self._lock:
            self._events.append(event)
            listeners = list(self._listeners)
        for listener in listeners:
            # A broken listener (a live figure, a callback) must never break a save.
            try:
                listener(event)
            except Exception as exc:
                _log.warning("nbckpt: timeline listener %r failed: %s", listener, exc)
        return event

    def extend(self, events: list[Event]) -> None:
        with self._lock:
            self._events.extend(events)

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def to_pandas(self) -> pd.DataFrame:
        """One row per event; ``start_s``/``end_s`` are seconds since the timeline began."""
        return events_to_pandas(self.events, self.origin_ns)


_COLUMNS = [
    "kind",
    "label",
    "step",
    "rank",
    "start_s",
    "end_s",
    "duration_s",
    "bytes",
    "thread",
    "pid",
    "start_ns",
    "end_ns",
]


def events_to_pandas(events: Iterable[Event], origin_ns: int) -> pd.DataFrame:
    """One row per event; ``start_s``/``end_s`` are seconds since ``origin_ns``."""
    require_extra("Timeline.to_pandas")
    import pandas as pd

    rows = []
    for event in events:
        row = asdict(event)
        row.pop("detail")
        row["start_s"] = (event.start_ns - origin_ns) / 1e9
        row["end_s"] = (event.end_ns - origin_ns) / 1e9
        row["duration_s"] = event.duration_s
        rows.append(row)
    return pd.DataFrame(rows, columns=_COLUMNS)


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost, in seconds: ``stall_s`` the caller was blocked, ``cpu_s`` the
    CPU time of nbckpt's threads (copying, hashing, writing; not the kernel's page writeback)."""

    step: int
    path: str
    bytes: int
    stall_s: float
    stage_s: float
    persist_s: float
    wait_s: float
    write_gbs: float
    cpu_s: float
    bytes_written: int = 0
    """Bytes this rank wrote into the step's files (data, values, DCP metadata)."""
    bytes_skipped: int = 0
    """Bytes of this rank's files taken whole from the step before instead (``incremental``)."""

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
        self._result(self.staged, timeout, "wait_staged")

    def wait(self, timeout: float | None = None) -> SaveRecord:
        """Block until committed; raises :class:`CheckpointError` if the save failed. From a save's
        callback (nbckpt's thread), only a save already over: a later one would wait for ever."""
        record: SaveRecord = self._result(self.committed, timeout, "wait")
        return record

    def _result(self, future: Future[Any], timeout: float | None, call: str) -> Any:
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0
        ):
            raise ConfigError(f"timeout must be a number of seconds >= 0 or None, not {timeout!r}")
        if not future.done():
            refuse_waits(f"handle.{call}() of step {self.step}, not yet done,")
        try:
            settle(future, timeout)
            return future.result(0)  # TimeoutError if it is not done yet
        except CheckpointError:
            self.reported = True
            raise

    @property
    def error(self) -> BaseException | None:
        """The CheckpointError of a failed save; None while running or after success."""
        return self.committed.exception() if self.committed.done() else None

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} {self.phase}>"
