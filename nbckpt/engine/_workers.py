"""Background threads the engine owns (ordered workers, a small pool for file I/O), and the
sections of the main thread a Ctrl-C must not cut in two. Not ``ThreadPoolExecutor``: it refuses
work once the interpreter starts shutting down, just when a save in flight must still finish;
daemon threads, so a hung write never blocks the exit forever either.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from .._errors import ConfigError

__all__ = [
    "SIGNAL_CHECK_S",
    "Backlog",
    "Pool",
    "Worker",
    "balance",
    "deferred_interrupt",
    "lower_priority",
    "refuse_waits",
    "run_all",
    "settle",
    "settle_all",
    "worker_thread",
]

T = TypeVar("T")

#: The longest the main thread blocks in one lock wait for background work. CPython runs a
#: signal's handler between bytecodes: a Ctrl-C that lands after the last check and before the
#: lock wait starts does not interrupt it, and an untimed wait never returns to notice it (the test
#: that presses Ctrl-C once the main thread waits hung so, 1 run in 15 under load).
SIGNAL_CHECK_S = 0.2
# Which engine worker runs on this thread (a save's callbacks and the timeline's listeners run on
# them): the Checkpointer's calls that wait for background work refuse to run there.
_here = threading.local()
#: The workers running a job now: the exit must not tear the interpreter down under one
#: (:func:`busy`). One set operation each, which the GIL keeps whole.
_BUSY: set[Worker] = set()
# A child of os.fork has none of the parent's threads: a job running there at the fork is not
# running in the child, whose exit (a script's 0) would otherwise end as one left running (1).
os.register_at_fork(after_in_child=_BUSY.clear)


def settle(future: Future[Any], timeout: float | None = None) -> bool:
    """Wait until ``future`` is done, at most ``timeout`` seconds (None: no limit); whether it is.
    On the main thread the wait returns every :data:`SIGNAL_CHECK_S` to let a Ctrl-C through."""
    if threading.current_thread() is not threading.main_thread():
        return bool(futures_wait([future], timeout).done)
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    while not future.done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        futures_wait([future], min(left, SIGNAL_CHECK_S))
    return True


def busy() -> bool:
    """Whether one of the engine's workers is running a job (a save's persist, an upload)."""
    return bool(_BUSY)


def worker_thread() -> str | None:
    """The name of the engine's worker thread this runs on (a save's callbacks, a timeline
    listener, a retention policy run there); None on any other thread (the caller's own)."""
    name: str | None = getattr(_here, "name", None)
    return name


def refuse_waits(call: str) -> None:
    """ConfigError if this is an engine worker's thread: ``call`` would wait there for work that
    thread (or one waiting for it) does, and never return."""
    thread = worker_thread()
    if thread is not None:
        raise ConfigError(
            f"{call} cannot be called on nbckpt's thread {thread}, where a save's callbacks and "
            "timeline listeners run: it waits for work that thread does; call it from a thread of "
            "your own (steps, latest_step, has_step, manifest, verify, load and records work there)"
        )


class Worker:
    """One daemon thread running jobs in order, ``nice`` steps below the caller's priority."""

    def __init__(self, name: str, *, nice: int = 0) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(nice, ready), name=name, daemon=True)
        self._thread.start()
        ready.wait()  # the priority is in place before anything can look at the thread

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self, nice: int, ready: threading.Event) -> None:
        _here.name = self.name
        if nice:
            lower_priority(nice)
        ready.set()
        while (job := self._jobs.get()) is not None:
            _BUSY.add(self)
            # Jobs report their own errors on their futures; the thread must outlive any of them.
            with contextlib.suppress(BaseException):
                job()
            del job  # an idle worker must not keep the last job's Checkpointer alive
            _BUSY.discard(self)

    def stop(self, wait: bool = True) -> None:
        self._jobs.put(None)
        # Wait for the thread to end: one still unwinding while the interpreter finalizes
        # (close() at exit) aborts the process ("terminate called without an active exception").
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


class Backlog:
    """Jobs for one :class:`Worker`, counted from when they are promised (a job may be queued
    later: retention's pass after a commit is reported) until they are over; :meth:`wait` returns
    once none is left. Each job is a future, waited for by :func:`settle` as everything the
    engine waits for in the background is (saves in flight: through their handles)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._pending: set[Future[None]] = set()

    def promise(self, job: Callable[[], None]) -> Callable[[], None]:
        """Count ``job`` now; the returned function queues it (call it once)."""
        over: Future[None] = Future()
        with self._lock:
            self._pending.add(over)

        def run() -> None:
            try:
                job()
            finally:
                with self._lock:
                    self._pending.discard(over)
                over.set_result(None)

        return partial(self._worker.submit, run)

    def submit(self, job: Callable[[], None]) -> None:
        self.promise(job)()

    def wait(self) -> None:
        """Block until every job promised so far (and any promised meanwhile) is over."""
        while True:
            with self._lock:
                pending = next(iter(self._pending), None)
            if pending is None:
                return
            settle(pending)


class Pool:
    """``size`` workers taking jobs in turn; ``submit`` returns the job's future."""

    def __init__(self, size: int, name: str, *, nice: int = 0) -> None:
        self._workers = [Worker(f"{name}-{i}", nice=nice) for i in range(size)]
        self._next = itertools.cycle(self._workers)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        with self._lock:
            worker = next(self._next)
        worker.submit(run)
        return future

    def stop(self, wait: bool = True) -> None:
        for worker in self._workers:
            worker.stop(wait)


def lower_priority(nice: int) -> None:
    """Make the calling thread ``nice`` steps less urgent (Linux, where each thread has its own
    priority; elsewhere setpriority would change the whole process, so nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):  # a sandbox that forbids it: run at the caller's priority
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))


def settle_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for every one of ``futures`` to end, whatever becomes of the others."""
    for future in futures:
        settle(future)


def run_all(pool: Pool, jobs: Sequence[Callable[[], Any]], started: Sequence[Future[Any]] = ()) -> list[Any]:
    """Run ``jobs`` in parallel beside those ``started`` before; wait for every one (none keeps
    going on memory or files the caller is about to drop), then raise the first error or return
    the results in order, the started ones' first."""
    futures = [*started, *(pool.submit(job) for job in jobs)]
    settle_all(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
    return [future.result() for future in futures]


def balance(items: Sequence[T], count: int, size: Callable[[T], int]) -> list[list[T]]:
    """``items`` split over ``count`` threads or files of similar total ``size`` (the largest item
    to the lightest group first), each group in the items' order; empty groups are left out."""
    sizes = [0] * count
    groups: list[list[T]] = [[] for _ in range(count)]
    placed = {}
    for index in sorted(range(len(items)), key=lambda i: -size(items[i])):
        placed[index] = min(range(count), key=lambda g: (sizes[g], g))
        sizes[placed[index]] += size(items[index])
    for index, item in enumerate(items):
        groups[placed[index]].append(item)
    return [group for group in groups if group]


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until it is over, then deliver it as
    the handler in place would have: for loading a restored state into the caller's objects (half
    loaded is worse than not at all), torch.save's framing (its zip writer, cut mid-record,
    raises an unrelated error) and the bench's start of torchrun (cut before its launch is held,
    torchrun runs on unseen). Only the main thread receives signals; elsewhere the block runs."""
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
