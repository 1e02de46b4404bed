"""The Lab's runs: a comparison (or a probe) in a worker thread, its updates applied by one
updater thread, Stop and Kernel > Interrupt ending it after the current step, and the results and
timeline state the updates build. No widget here: :class:`._lab.Lab` lays out the controls and
shows the updates (its ``_apply``), and this class never reads a widget.

The worker only queues events, results and log lines; the updater applies them every
``refresh_s`` seconds, so widgets change on one thread only while a job runs.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
import traceback
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import pandas as pd

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import could_create, is_url, writable_directory

if TYPE_CHECKING:
    from ..bench import Comparison

__all__ = ["LOG_LINES", "LabRun", "Settings", "check_target", "error_line", "route_interrupts"]

_log = logging.getLogger("nbckpt")

#: Log lines the lab keeps (the oldest are dropped).
LOG_LINES = 500
# A quick probe: enough to see the write rate and the stream count that helps.
_PROBE_MB, _PROBE_STREAMS = 32.0, (1, 2, 4)

def check_target(path: str) -> None:
    """ConfigError when ``path`` cannot hold checkpoints (URLs are not checked). Nothing is
    created: a lab that is only validated leaves no directory behind."""
    if not path.strip():
        raise ConfigError("the target path is empty")
    if is_url(path):
        return
    reason = could_create(path)
    if reason is not None:
        raise ConfigError(f"target {path} is not usable: {reason}")


def error_line(exc: BaseException) -> str:
    """One line for an error that ended a run."""
    if isinstance(exc, ConfigError):
        text = f"Cannot run: {exc}"
    elif isinstance(exc, CheckpointError):
        text = f"Checkpoint failed: {exc}"
    elif isinstance(exc, OSError):
        text = f"Storage error: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    else:
        text = f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"
    return " ".join(text.split())


# Kernel > Interrupt is a SIGINT. While a cell runs, ipykernel makes it a KeyboardInterrupt
# (Lab.wait catches it); while the kernel is idle it ignores it, so a run in the lab's threads
# would never hear of it. The handler below (installed once) tells the lab that ran last, then
# calls the one it replaced. ipykernel swaps handlers around each message it handles and puts
# back ``kernel.saved_sigint_handler`` after it: inside one (a cell, a click), ours goes there.
_previous_sigint: Any = signal.SIG_IGN
_interrupted: weakref.WeakMethod[Callable[[], None]] | None = None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if (note := _interrupted() if _interrupted is not None else None) is not None:
        note()
    if callable(_previous_sigint):
        _previous_sigint(signum, frame)


def route_interrupts(note: Callable[[], None]) -> None:
    """Every SIGINT from now on calls ``note`` (a bound method, held weakly) first. It must take
    no lock: a signal handler runs between two bytecodes of the main thread, which may hold any.
    Only the main thread can do this; where SIGINT ends the process, nothing changes."""
    global _previous_sigint, _interrupted
    _interrupted = weakref.WeakMethod(note)
    if threading.current_thread() is not threading.main_thread():
        return
    from IPython import get_ipython

    kernel: Any = getattr(get_ipython(), "kernel", None)  # type: ignore[no-untyped-call]
    inside = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
              and hasattr(kernel, "saved_sigint_handler"))
    current = kernel.saved_sigint_handler if inside else signal.getsignal(signal.SIGINT)
    if current is _on_sigint or current in (signal.SIG_DFL, None):
        return
    _previous_sigint = current
    if inside:
        kernel.saved_sigint_handler = _on_sigint
    else:
        signal.signal(signal.SIGINT, _on_sigint)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What one run uses, read from the controls once (workers never read a widget)."""

    directory: str
    names: tuple[str, ...]
    steps: int
    every: int
    repeats: int
    preset: str | None
    size_mb: float | None
    device: str

    @property
    def runs(self) -> int:
        return (len(self.names) + ("none" not in self.names)) * self.repeats


class LabRun(ABC):
    """A lab's jobs and what they leave (``comparison``, ``error``, ``stopped``, ``interrupted``,
    ``log_lines``). Subclasses show them: :meth:`_apply` (a batch of updates, on the updater
    thread), :meth:`_set_busy` and :meth:`_show_log`."""

    def __init__(self, *, refresh_s: float, compute_ms: float, warmup: bool, json_path: str | None) -> None:
        self.refresh_s, self.compute_ms, self.warmup = refresh_s, compute_ms, warmup
        self.json_path = json_path
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
        self.interrupted = False  # stopped by Kernel > Interrupt (SIGINT), not by Stop
        self.log_lines: deque[str] = deque(maxlen=LOG_LINES)
        self._settings: Settings | None = None
        self._results: dict[str, dict[str, Any]] = {}  # each strategy's latest run, for the table
        self._lanes: dict[str, tuple[int, list[pd.DataFrame]]] = {}  # the timeline's origin, rows
        self._finished: set[str] = set()  # strategies whose run ended: their next events restart
        self._runs_done = 0
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._job = ""
        self._interrupt_noted = False  # set by the SIGINT handler; the updater acts on it
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()

    @property
    def running(self) -> bool:
        """A run or probe is going on (or its last updates are being applied)."""
        return any(thread.is_alive() for thread in self._threads)

    @property
    def closed(self) -> bool:
        """Closed by :meth:`close` (or replaced by a newer Lab): it runs nothing any more."""
        return self._closed.is_set()

    def stop(self) -> None:
        """End the run after the current step; saves in flight still commit (none half-written)."""
        self._request_stop("stop requested")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run (or probe) and its last update are done; False on timeout.
        Ctrl-C (Kernel > Interrupt) while it waits stops the run, as Stop does, and is raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for thread in list(self._threads):
                if thread is not threading.current_thread():
                    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self._interrupt()
            raise
        return not self.running

    def _request_stop(self, why: str, *, interrupted: bool = False) -> None:
        if self._job != "run" or not self.running or self._stop.is_set():
            return
        self.interrupted = interrupted  # before the stop: the run's end reads it
        self._stop.set()
        self._post("log", f"{why}: finishing the current step and saves in flight")

    def _note_interrupt(self) -> None:
        self._interrupt_noted = True  # by the SIGINT handler: no lock; the updater stops the run

    def _interrupt(self) -> None:
        self._interrupt_noted = False
        self._request_stop("interrupted (Kernel > Interrupt)", interrupted=True)

    def _begin(self, settings: Settings) -> None:
        """No results, lanes, error or log lines: a clean slate for a run of ``settings``."""
        self._settings, self.comparison, self.error = settings, None, None
        self.stopped = self.interrupted = False
        self._results.clear()
        self._lanes.clear()
        self._finished.clear()
        self._runs_done = 0
        self.log_lines.clear()

    @abstractmethod
    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """Show a batch of updates, in the order they were posted (the updater thread calls it)."""

    @abstractmethod
    def _set_busy(self, busy: bool) -> None:
        """Turn the controls off while a job runs, on after it."""

    @abstractmethod
    def _show_log(self) -> None:
        """Show ``log_lines``."""

    # -- worker side (never touches a widget) -------------------------------------------------

    def _post(self, kind: str, item: Any) -> None:
        self._queue.put((kind, item))

    def _start(self, name: str, job: Callable[[], None]) -> None:
        self._job = name
        self._stop.clear()
        self._interrupt_noted = False
        self._queue = queue.Queue()
        self._set_busy(True)

        def work() -> None:
            try:
                job()
            except BaseException as exc:
                if not isinstance(exc, NbckptError | OSError):  # expected ones need no traceback
                    self._post("log", traceback.format_exc())
                self._post("error", exc)
            finally:
                self._post("finished", None)

        updater = threading.Thread(target=self._update_loop, args=(self._queue,),
                                   name="nbckpt-lab-updater", daemon=True)
        worker = threading.Thread(target=work, name="nbckpt-lab-worker", daemon=True)
        self._threads = [worker, updater]
        updater.start()
        worker.start()

    def _experiment(self, settings: Settings) -> None:
        from ..bench import compare, make_workload

        workload = make_workload(settings.preset, settings.size_mb, settings.device,
                                 compute_ms=self.compute_ms)
        comparison = compare(
            workload, list(settings.names), settings.directory, steps=settings.steps,
            every=settings.every, repeats=settings.repeats,
            warmup=self.warmup, stop=self._stop, progress=lambda line: self._post("log", line),
            on_event=lambda event: self._post("event", event),
            on_result=lambda name, metrics: self._post("result", (name, metrics)),
        )
        if self.json_path is not None:
            comparison.to_json(self.json_path)
            self._post("log", f"results written to {self.json_path}")
        self.stopped = self._stop.is_set()
        self.comparison = comparison
        self._post("done", comparison)

    def _probe(self, target: str) -> None:
        from ..bench import probe

        if not is_url(target):
            writable_directory(target, "target")  # the lab writes there anyway
        self._post("probe", probe(target, size_mb=_PROBE_MB, streams=_PROBE_STREAMS).summary())

    # -- updater side (the only thread that changes widgets while a job runs) -----------------

    def _update_loop(self, source: queue.Queue[tuple[str, Any]]) -> None:
        finished = False
        while not finished:
            if self._interrupt_noted:
                self._interrupt()
            batch: list[tuple[str, Any]] = []
            deadline = time.monotonic() + self.refresh_s
            while not finished:
                try:
                    batch.append(source.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
                finished = batch[-1][0] == "finished"
            if self.closed:  # drain the queue; the widgets may be gone from the page
                for kind, item in batch:
                    if kind == "error":
                        _log.warning("nbckpt: the closed lab's %s failed: %s", self._job, error_line(item))
                continue
            try:
                self._apply(batch)
            except Exception as exc:  # the widgets may be what failed: say so outside them too
                _log.warning("nbckpt: the lab could not show an update: %s: %s", type(exc).__name__, exc)
                self.log_lines.append(traceback.format_exc())
                self._show_log()
        if not self.closed:
            self._set_busy(False)
