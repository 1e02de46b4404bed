"""The final save: synchronous and bounded in time, for the ways a process ends (a signal such as
SIGTERM on preemption, a notebook kernel shutting down).

A final save that cannot commit in time is left running on its daemon thread while the process
ends: it never counts (the manifest is written last), so the previous checkpoint stays, and the
next open of the directory cleans up what it left. What happened is logged either way.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpointer import Checkpointer

__all__ = ["Snapshot", "final_save", "install", "uninstall"]

_log = logging.getLogger("nbckpt")

#: Gives the ``(state, step)`` to save when the time comes, or None when there is nothing new.
Snapshot = Callable[[], "tuple[Mapping[str, Any], int] | None"]


def final_save(ckpt: Checkpointer, snapshot: Snapshot, timeout_s: float, reason: str) -> str:
    """Save ``snapshot()`` synchronously within ``timeout_s``; log and return what happened.

    With nothing new to save, the saves in flight are waited for, within the same bound.
    """
    try:
        taken = snapshot()
    except Exception as exc:
        line = f"no final save, the snapshot failed: {exc}"
    else:
        outcome: list[str] = []
        # On its own thread, so that the wait is bounded (another thread may hold the lock, or
        # the storage may hang); a daemon thread, so that it never keeps the process alive.
        saver = threading.Thread(target=_save_for, args=(ckpt, taken, outcome), daemon=True)
        saver.start()
        saver.join(timeout_s)
        if saver.is_alive():
            # close() at exit would wait for it (its lock is held): it is left behind instead.
            ckpt._abandoned = True
            outcome.append(f"did not commit within {timeout_s:g} s; the previous checkpoint stays")
        if taken is None:
            line = f"nothing new to save; the saves in flight {outcome[0]}"
        else:
            line = f"final save of step {taken[1]} {outcome[0]}"
    _log.warning("nbckpt: %s: %s", reason, line)
    return line


def _save_for(ckpt: Checkpointer, taken: tuple[Mapping[str, Any], int] | None, outcome: list[str]) -> None:
    try:
        if taken is not None:
            state, step = taken
            ckpt.save(state, step, blocking=True, overwrite=True)
        ckpt.wait()  # and retention's deletes, so the exit leaves no half-deleted step behind
        outcome.append("committed")
    except BaseException as exc:
        outcome.append(f"failed: {exc}")


def on_signal(
    ref: weakref.ref[Checkpointer],
    snapshot: Snapshot,
    timeout_s: float,
    previous: Any,
    signum: int,
    frame: Any,
) -> None:
    """The signal handler of :meth:`Checkpointer.save_on_signal` (runs on the main thread)."""
    ckpt = ref()
    if ckpt is not None and ckpt._main_depth:  # interrupted inside a call: save once it returns
        ckpt._deferred = partial(on_signal, ref, snapshot, timeout_s, previous, signum, frame)
        return
    if ckpt is not None and not ckpt._closed:
        final_save(ckpt, snapshot, timeout_s, signal.Signals(signum).name)
    signal.signal(signum, previous)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        os.kill(os.getpid(), signum)


Installed = dict[int, tuple[Callable[..., None], Any]]


def install(ckpt: Checkpointer, snapshot: Snapshot, signals: tuple[signal.Signals, ...],
            timeout_s: float) -> Installed:
    """Make each of ``signals`` run a final save first; what is needed to put them back."""
    installed: Installed = {}
    for signum in signals:
        previous = signal.getsignal(signum)
        handler = partial(on_signal, weakref.ref(ckpt), snapshot, timeout_s, previous)
        signal.signal(signum, handler)
        installed[signum] = (handler, previous)
    return installed


def uninstall(installed: Installed) -> None:
    """Put back the handlers ``install`` replaced, where its own are still the ones installed
    (one installed later on top of it stays, and still chains to it)."""
    for signum, (handler, previous) in installed.items():
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous)
