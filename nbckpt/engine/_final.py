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
from typing import Any, TypeAlias

from .._errors import ConfigError
from .._util import parse_duration

__all__ = ["Snapshot", "check_arguments", "check_signals", "final_save", "install", "uninstall"]

_log = logging.getLogger("nbckpt")

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
    """Run ``save(snapshot())`` (a synchronous save, then a wait for everything in flight)
    within ``timeout_s``; log what happened and return that line, and whether it ended in time.

    ``save`` gets None when there is nothing new to save: it waits for the saves in flight.
    """
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
                outcome.append(f"did not commit within {timeout_s:g} s; the previous checkpoint stays")
            what = "nothing new to save; the saves in flight" if taken is None else (
                f"final save of step {taken[1]}")
            line = f"{what} {outcome[0]}"
    _log.warning("nbckpt: %s: %s", reason, line)
    return line, ended


def _save_for(save: Callable[[Taken], None], taken: Taken, outcome: list[str]) -> None:
    try:
        save(taken)
        outcome.append("committed")
    except BaseException as exc:
        outcome.append(f"failed: {exc}")


#: The Checkpointer's side of a signal: ``(snapshot, timeout_s, signum, again)`` runs the final
#: save and returns True, or returns False when the signal came inside one of its calls (then
#: ``again`` runs once that call returns).
OnSignal = Callable[[Snapshot, float, int, Callable[[], None]], bool]


def on_signal(
    final: weakref.WeakMethod[OnSignal],
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
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


Installed = dict[int, tuple[Callable[..., None], Any]]


def install(final: OnSignal, snapshot: Snapshot, signals: tuple[signal.Signals, ...],
            timeout_s: float) -> Installed:
    """Make each of ``signals`` run ``final`` (a Checkpointer's bound method, held weakly) first;
    what is needed to put them back."""
    installed: Installed = {}
    for signum in signals:
        previous = signal.getsignal(signum)
        handler = partial(on_signal, weakref.WeakMethod(final), snapshot, timeout_s, previous)  # type: ignore[arg-type]
        signal.signal(signum, handler)
        installed[signum] = (handler, previous)
    return installed


def uninstall(installed: Installed) -> None:
    """Put back the handlers ``install`` replaced, where its own are still the ones installed
    (one installed later on top of it stays, and still chains to it)."""
    for signum, (handler, previous) in installed.items():
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous)
