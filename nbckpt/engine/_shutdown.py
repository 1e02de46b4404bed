"""How a Checkpointer's life ends: the Checkpointers a process holds open (the one writing into a
directory, closing them all, closing each at exit so its saves in flight finish), and the final
save, synchronous and bounded in time, on a signal such as SIGTERM or a kernel's exit: one that
cannot commit in time is left on its daemon thread and never counts (the next open cleans up);
a process exiting with one still running ends, as it was ending, without the interpreter's teardown.
"""

from __future__ import annotations

import atexit
import builtins
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from functools import partial
from types import MethodType
from typing import Any, Generic, Protocol, TypeAlias, TypeVar, cast

from .._errors import CheckpointError, ConfigError
from .._util import is_url, parse_duration
from ._config import CheckpointConfig
from ._open_store import open_store
from ._ranks import Group
from ._store import Store
from ._workers import busy, settle, settle_all

__all__ = [
    "Deferral",
    "Snapshot",
    "check_arguments",
    "check_signals",
    "close_all",
    "ended_by",
    "final_save",
    "install",
    "register",
    "release",
    "release_later",
    "uninstall",
    "unregister",
    "wait_released",
    "writing_into",
]

_log = logging.getLogger("nbckpt")
_M = TypeVar("_M", bound=Callable[..., Any])


class _Open(Protocol):
    store: Store
    config: CheckpointConfig

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class _Stoppable(Protocol):
    def stop(self, wait: bool) -> None: ...


def release(store: Store, wait: bool, *parts: _Stoppable | None) -> None:
    """Stop the threads of ``parts`` and free the directory; ``wait`` for the threads to end (not
    from a finalizer, which may run on one of them: :func:`release_later`). Parts may be missing
    (a failed construction)."""
    for part in parts:
        if part is not None:
            part.stop(wait)
    store.unlock()


#: The releases of dropped Checkpointers still under way (:func:`release_later`), each with the
#: URL of its directory. Keyed by the release, not the directory: two Checkpointers dropped on one
#: directory are both waited for. Each entry is one dict operation, which the GIL keeps whole,
#: and a finalizer, which may run on a thread holding any lock, takes no lock to add one.
_RELEASING: dict[Future[None], str] = {}
#: The persist threads that ran those releases: each ends once its release is over.
_ENDING: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
# A forked child has none of the threads those wait for (nor their Checkpointers' work to do).
os.register_at_fork(after_in_child=_RELEASING.clear)
os.register_at_fork(after_in_child=_ENDING.clear)


def _key(store: Store) -> str:
    return os.path.realpath(store.url) if store.is_local else store.url


def release_later(
    store: Store, carry: Callable[[Callable[[], None]], None], *parts: _Stoppable | None, made_in: int
) -> None:
    """A dropped Checkpointer's release (its finalizer, on any thread, one of its own among them):
    handed to ``carry`` (the persist thread's queue: a finalizer can neither wait nor start a
    thread, which may deadlock inside ``Thread.start``), which stops the other threads once they
    finished what they were given (an upload to the mirror, a retention pass), then frees the
    directory. Freed at once, the next writer's clean-up removed the files an upload was still
    writing, and the two acted on the run at once. Nothing in a forked child (``made_in`` is the
    process that made it): its copy has none of those threads, and the lock is the parent's; the
    release counted there was never run, and the child's exit waited for it for ever."""
    if os.getpid() != made_in:
        return
    over: Future[None] = Future()
    _RELEASING[over] = _key(store)
    carry(partial(_release, store, parts, over))  # a SimpleQueue's put: safe in a finalizer


def _release(store: Store, parts: tuple[_Stoppable | None, ...], over: Future[None]) -> None:
    _ENDING.add(threading.current_thread())  # it ends after this job (release stops it)
    try:
        release(store, True, *parts)
    finally:
        _RELEASING.pop(over, None)
        over.set_result(None)


def _under_way(key: str | None = None) -> list[Future[None]]:
    """The releases under way (on ``key``'s directory only, where given)."""
    while True:
        try:  # a finalizer on another thread may add one while the entries are read: read again
            return [over for over, where in list(_RELEASING.items()) if key is None or where == key]
        except RuntimeError:
            continue


def wait_released(store: Store, timeout_s: float) -> None:
    """Before a writer opens ``store``: the release of a Checkpointer of this process dropped
    unclosed on it is waited for (its threads finishing their work), so that the run is handed
    over, not taken from under them; a CheckpointError after ``timeout_s`` (an upload that never
    ends held the new writer for ever, on a thread where no Ctrl-C reaches it)."""
    pending = [over for over in _under_way(_key(store)) if not over.done()]
    if not pending:
        return
    _log.warning(
        "nbckpt: waiting for a Checkpointer of this process that was dropped unclosed on %s "
        "to finish its work (its saves' uploads, its retention)",
        store.url,
    )
    deadline = time.monotonic() + timeout_s
    if not all(settle(over, max(0.0, deadline - time.monotonic())) for over in pending):
        raise CheckpointError(
            f"a Checkpointer of this process dropped unclosed on {store.url} is still finishing "
            f"its work (an upload to its mirror, a retention pass) after {timeout_s:g} s (timeout_s); "
            "close() a Checkpointer before making another, or open again once its work is over"
        )


def _finish_releases() -> None:
    """At exit, the releases of dropped Checkpointers under way end first, and the persist
    thread that ran each: left running on their daemon threads as the interpreter's teardown
    began, one freeing a save's staging memory aborted the process (``terminate called without an
    active exception``, SIGABRT: a thread taking the GIL during the teardown is ended by
    ``pthread_exit``, whose unwinding cannot pass torch's C++ destructors), and their uploads
    were cut short. Registered at import, so it runs after every Checkpointer's own close at
    exit (atexit runs the last registered first); a Ctrl-C there ends the process too."""
    try:
        if _under_way():
            _log.warning("nbckpt: finishing the work of Checkpointers dropped unclosed before exit")
        while pending := _under_way():  # one may be dropped as another ends
            settle_all(pending)
        for thread in list(_ENDING):
            thread.join()
    except KeyboardInterrupt:
        ended_by(signal.SIGINT)
        raise
    finally:
        _leave_running_work()


atexit.register(_finish_releases)


#: The threads of final saves that did not end in time (:func:`final_save`), left running.
_LEFT: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
#: How the process was ending, where nbckpt saw it (a signal, or an exit status), latest last.
_ENDED_BY: list[tuple[signal.Signals | None, int]] = []


def ended_by(signum: signal.Signals | None, code: int = 1) -> None:
    """Note how the process is ending: by ``signum`` (a Ctrl-C during the exit's wait), or with
    ``code`` (an earlier signal handler's SystemExit)."""
    _ENDED_BY.append((signum, 128 + signum if signum is not None else code))


def _exit_status() -> tuple[signal.Signals | None, int]:
    """How the process was ending: by an uncaught KeyboardInterrupt (which CPython turns into
    SIGINT after its teardown), as nbckpt saw it end (:func:`ended_by`), or an uncaught
    exception's 1; 1 where nothing says (work that did not end, a final save among it, failed)."""
    # Set by CPython for the exception that ends a script; IPython sets it for every cell's
    # error, which never ends the kernel (a cell stopped long before its shutdown is no Ctrl-C).
    last = None if getattr(builtins, "__IPYTHON__", False) else getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        return signal.SIGINT, 128 + signal.SIGINT
    if last is None and _ENDED_BY:
        return _ENDED_BY[-1]
    return None, 1


def _leave_running_work() -> None:
    """At exit, after everything else of nbckpt's: a final save that did not end in time still
    runs on its daemon thread, or a worker its job (a Checkpointer whose close at exit a Ctrl-C
    cut short, one a final save left unclosed), and the interpreter's teardown under it aborted
    the process where it freed or copied a tensor (``terminate called without an active
    exception``, SIGABRT and a core dump, not the signal's own status: a thread taking the GIL
    during the teardown is ended by ``pthread_exit``, whose unwinding cannot pass torch's C++
    frames). The process ends here instead, as it was ending (the signal's status), its logs and
    output flushed; what was left never counts (the next open cleans it up)."""
    if not (busy() or any(thread.is_alive() for thread in list(_LEFT))):
        return
    signum, code = _exit_status()
    _log.warning(
        "nbckpt: a save that did not end (a final save out of time, a close cut short) still "
        "runs; the process ends now (%s), without the interpreter's teardown",
        f"by {signum.name}" if signum is not None else f"exit status {code}",
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with suppress(AttributeError, OSError, ValueError):  # closed or replaced by the caller
            stream.flush()
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)  # delivered to this thread before it returns: the process ends
    os._exit(code)


_OPEN: weakref.WeakSet[_Open] = weakref.WeakSet()
_EXITS: weakref.WeakKeyDictionary[_Open, Callable[[], None]] = weakref.WeakKeyDictionary()
_FINALIZERS: weakref.WeakKeyDictionary[_Open, multiprocessing.util.Finalize] = weakref.WeakKeyDictionary()
#: Where the close at exit runs among multiprocessing's finalizers: before a Pool's (15) and the
#: other priority-0-or-more ones, whose threads and processes a save in flight does not need.
EXIT_PRIORITY = 20


class WeakBound(Generic[_M]):
    """A bound method held weakly: its object by a plain weak reference, its function strongly
    (a class's function outlives its objects). Not :class:`weakref.WeakMethod`, whose callback
    can run during the interpreter's teardown after the WeakMethod itself is gone and print
    ``Exception ignored in: ... AttributeError: 'NoneType' object has no attribute '_alive'``
    at the exit of a script that installed a final save."""

    __slots__ = ("_func", "_obj")

    def __init__(self, method: _M) -> None:
        bound: Any = method
        self._obj = weakref.ref(bound.__self__)  # no callback: nothing runs when it dies
        self._func = bound.__func__

    def __call__(self) -> _M | None:
        """The bound method, or None once its object is gone."""
        obj = self._obj()
        return None if obj is None else cast(_M, MethodType(self._func, obj))


def register(ckpt: _Open, at_exit_method: Callable[[], None]) -> None:
    """Count ``ckpt`` as open, and run ``at_exit_method`` (its bound method, held weakly) at
    exit unless it is closed or dropped before."""
    _OPEN.add(ckpt)
    method = WeakBound(at_exit_method)

    def at_exit() -> None:
        bound = method()
        if bound is not None:
            bound()

    _EXITS[ckpt] = at_exit
    atexit.register(at_exit)
    # A multiprocessing child (Lightning's ddp_fork in a notebook) leaves by os._exit once its
    # target returns, running multiprocessing's finalizers but never atexit's: the close is one
    # of those too. Where both run (a parent's exit) the second finds the Checkpointer closed.
    finalizer = multiprocessing.util.Finalize(None, at_exit, exitpriority=EXIT_PRIORITY)
    _FINALIZERS[ckpt] = finalizer
    # Unregistered when dropped too: a notebook that opens many readers keeps no dead entries
    # in atexit's list nor multiprocessing's.
    weakref.finalize(ckpt, _forget, at_exit, finalizer).atexit = False


def _forget(at_exit: Callable[[], None], finalizer: multiprocessing.util.Finalize) -> None:
    atexit.unregister(at_exit)
    finalizer.cancel()


def unregister(ckpt: _Open) -> None:
    _OPEN.discard(ckpt)
    at_exit = _EXITS.pop(ckpt, None)
    finalizer = _FINALIZERS.pop(ckpt, None)
    if at_exit is not None:
        atexit.unregister(at_exit)
    if finalizer is not None:
        finalizer.cancel()


def writing_into(directory: str | os.PathLike[str]) -> _Open | None:
    """The open Checkpointer of this process that writes into ``directory`` (on a local
    directory: the one holding its lock), or None."""
    wanted = open_store(os.fspath(directory)).url
    if not is_url(wanted):
        wanted = os.path.realpath(wanted)  # a symlink or a relative path to the run is the run
    for ckpt in list(_OPEN):
        url = ckpt.store.url if is_url(ckpt.store.url) else os.path.realpath(ckpt.store.url)
        if url == wanted and not ckpt.closed and not ckpt.config.read_only:
            return ckpt
    return None


def close_all() -> list[str]:
    """Close every Checkpointer of this process (a notebook's lost handles); return their
    directories. Background errors are logged, not raised: this is the way out of a stuck session."""
    closed = []
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except CheckpointError as exc:
            _log.warning("nbckpt: %s", exc)
        closed.append(ckpt.store.url)
    return closed


Taken: TypeAlias = "tuple[Mapping[str, Any], int] | None"
#: Gives the ``(state, step)`` to save when the time comes, or None when there is nothing new.
Snapshot = Callable[[], Taken]


def check_arguments(snapshot: Any, timeout_s: Any) -> float:
    """Checked when the final save is set up, not when the signal comes: ``timeout_s`` in seconds."""
    if not callable(snapshot):
        raise ConfigError(
            f"snapshot must be a function returning (state, step) or None, not {type(snapshot).__name__}"
        )
    return parse_duration(timeout_s, "timeout_s")


def check_signals(signals: Any) -> tuple[signal.Signals, ...]:
    """``signals`` (signals, their numbers or names such as ``"SIGTERM"``) as signals a handler
    can be installed for; ConfigError naming the first that is not one."""
    if not isinstance(signals, (tuple, list)) or not signals:
        raise ConfigError(f"signals must be a tuple of signals such as (signal.SIGTERM,), not {signals!r}")
    checked = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                found = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            elif isinstance(item, int) and not isinstance(item, bool):
                found = signal.Signals(item)
            else:
                raise TypeError(item)
        except (KeyError, ValueError, TypeError):
            raise ConfigError(
                f"signals: {item!r} is not a signal (such as signal.SIGTERM or 'SIGTERM')"
            ) from None
        if found in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"signals: {found.name} cannot be caught, so no final save can run on it")
        checked.append(found)
    return tuple(checked)


def _is_state_and_step(taken: Any) -> bool:
    return isinstance(taken, (tuple, list)) and len(taken) == 2 and isinstance(taken[0], Mapping)


def final_save(
    save: Callable[[Taken], None], snapshot: Snapshot, timeout_s: float, reason: str
) -> tuple[str, bool]:
    """Run ``save(snapshot())`` (a synchronous save, then a wait for everything in flight; None:
    nothing new) within ``timeout_s``; log what happened, return that line and whether it ended."""
    ended = True
    try:
        taken = snapshot()
    except Exception as exc:
        line = f"no final save, the snapshot failed: {exc}"
    else:
        if taken is not None and not _is_state_and_step(taken):
            line = f"no final save, the snapshot returned {repr(taken)[:80]}, not (state, step) or None"
        else:
            outcome: list[str] = []
            # On its own thread, so that the wait is bounded (another thread may hold the lock, or
            # the storage may hang); a daemon thread, so that it never keeps the process alive.
            saver = threading.Thread(target=_save_for, args=(save, taken, outcome), daemon=True)
            saver.start()
            saver.join(timeout_s)
            ended = not saver.is_alive()
            if not ended:
                _LEFT.add(saver)  # the exit must not tear the interpreter down under it
                outcome.append(f"did not commit within {timeout_s:g} s; the previous checkpoint stays")
            what = (
                "nothing new to save; the saves in flight"
                if taken is None
                else (f"final save of step {taken[1]}")
            )
            line = f"{what} {outcome[0]}"
    _log.warning("nbckpt: %s: %s", reason, line)
    return line, ended


def _save_for(save: Callable[[Taken], None], taken: Taken, outcome: list[str]) -> None:
    try:
        save(taken)
        outcome.append("committed")
    except BaseException as exc:
        outcome.append(f"failed: {exc}")


class Deferral:
    """When a Checkpointer's final save runs, its signal handler running between any two
    bytecodes of the main thread: at once, or once the main thread leaves the Checkpointer call
    or the ``whole_step`` block the signal came in. With several ranks whose steps run in
    ``whole_step``, only at the end of a step, and on every rank at once: the ranks agree there
    whether any was signalled (a rank saving alone would wait for the others in its collectives
    while they wait for it in their training step's). A signal after the last step ends the
    process when the Checkpointer is closed, saving nothing more."""

    def __init__(self, group: Group) -> None:
        self._group = group
        self._depth = 0  # blocks the main thread is inside
        self._deferred: Callable[[], None] | None = None  # the handler's rest, waiting
        self._stepping = False  # whole_step was used: several ranks save at a step's end
        self._now = False  # the agreed moment: the handler saves
        self.save_here: Callable[[], object] | None = None  # a rank's final save, signalled or not
        self.done = False  # an agreed final save ran: a later signal saves nothing more
        self._saving = False  # a final save runs on this process
        self._held: list[Callable[[], None]] = []  # signals that came during it, waiting
        self._after = False  # the held signals go on: saving nothing

    @property
    def saves(self) -> bool:
        """Whether a signal handled now makes a final save."""
        return not (self.done or self._after)

    @contextmanager
    def final(self) -> Iterator[None]:
        """A final save (a signal's, another rank's, a kernel's exit). A signal that comes during
        it is held, and goes on once it ends, saving nothing: handled at once (the main thread
        waits for the save on another thread, between bytecodes), it began a second final save
        nested in the first, which waited for its lock, then saved the step again; with several
        ranks it waited alone for the others until the arrival deadline."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread
            return
        self._saving = True
        try:
            yield
        finally:
            self._saving, held, self._held = False, self._held, []
            self._after = True
            try:
                for again in held:
                    again()  # the signal's usual way out (by default: the process ends)
            finally:
                self._after = False

    def _agreeing(self) -> bool:
        return self._group.pg is not None and self._stepping and self.save_here is not None and not self.done

    def defers(self, again: Callable[[], None]) -> bool:
        """In the handler: True when the final save waits (``again`` runs it later)."""
        if self._saving:
            self._held.append(again)
            return True
        if self._now or not (self._depth or self._agreeing()):
            return False
        self._deferred = again
        return True

    @contextmanager
    def block(
        self,
        closed: Callable[[], bool],
        lock: AbstractContextManager[Any] | None = None,
        *,
        step: bool = False,
    ) -> Iterator[None]:
        """A Checkpointer call (inside ``lock``, taken first: a signal while another thread holds
        it is not deferred behind that thread's work) or, with ``step``, a training step."""
        lock = nullcontext() if lock is None else lock
        if threading.current_thread() is not threading.main_thread():
            with lock:  # signals reach only the main thread
                yield
            return
        self._stepping |= step
        ended = False
        try:
            with lock:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
            ended = True
        finally:  # even after an exception: the signal still ends the process
            if self._depth == 0:
                self._run(step and ended, closed())

    def _save_with_the_others(self, save: Callable[[], object]) -> None:
        """The final save another rank's signal asks of this one. A signal of this rank's own
        waits for it to end (as inside a call): handled at once, it ended the process in the
        middle of the save, and the other ranks' final save with it never committed."""
        self._depth += 1
        try:
            save()
        finally:
            self._depth -= 1

    def _run(self, step: bool, closed: bool) -> None:
        """``step``: a step ended (not by an exception: the other ranks are not here then)."""
        deferred = self._deferred
        agreed = self._agreeing() and not closed
        if agreed:
            if not step or not any(self._group.exchange(("whole_step",), lambda: deferred is not None)):
                return
            if deferred is None and self.save_here is not None:
                self.done = True  # every rank saves now, and once
                self._save_with_the_others(self.save_here)
                # A signal of this rank's own that came in the exchange or the save waited for
                # it: it ends the process now, not after one more step the others never join.
                deferred = self._deferred
                if deferred is None:
                    return  # not signalled here: go on
        if deferred is not None:
            self._deferred, self._now = None, True
            try:
                deferred()
            finally:
                self._now, self.done = False, self.done or agreed


#: The Checkpointer's side of a signal: ``(snapshot, timeout_s, signum, again)`` runs the final
#: save and returns True, or returns False when the signal came inside one of its calls (then
#: ``again`` runs once that call returns).
OnSignal = Callable[[Snapshot, float, int, Callable[[], None]], bool]


def on_signal(
    final: WeakBound[OnSignal],
    snapshot: Snapshot,
    timeout_s: float,
    previous: Any,
    signum: int,
    frame: Any,
) -> None:
    """The signal handler of :meth:`Checkpointer.save_on_signal` (runs on the main thread)."""
    deferred = False
    try:
        method = final()  # None once the Checkpointer is gone: the signal just goes on
        again = partial(on_signal, final, snapshot, timeout_s, previous, signum, frame)
        deferred = method is not None and not method(snapshot, timeout_s, signum, again)
    finally:  # whatever happened, the signal goes on to do what it did before (end the process)
        if not deferred:
            signal.signal(signum, previous)
            if callable(previous):
                try:
                    previous(signum, frame)
                except SystemExit as exc:  # the process's status, if it ends with a final save left
                    ended_by(None, _code_of(exc))
                    raise
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def _code_of(exc: SystemExit) -> int:
    """The exit status CPython gives ``exc`` (None: 0; a message: printed, 1)."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


Installed = dict[int, tuple[Callable[..., None], Any]]


def install(
    final: OnSignal, snapshot: Snapshot, signals: tuple[signal.Signals, ...], timeout_s: float
) -> Installed:
    """Make each of ``signals`` run ``final`` (a Checkpointer's bound method, held weakly) first;
    what is needed to put them back."""
    installed: Installed = {}
    for signum in signals:
        previous = signal.getsignal(signum)
        handler = partial(on_signal, WeakBound(final), snapshot, timeout_s, previous)
        signal.signal(signum, handler)
        installed[signum] = (handler, previous)
    return installed


def uninstall(installed: Installed) -> None:
    """Put back the handlers ``install`` replaced, where its own are still the ones installed
    (one installed later on top of it stays, and still chains to it)."""
    for signum, (handler, previous) in installed.items():
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous)
