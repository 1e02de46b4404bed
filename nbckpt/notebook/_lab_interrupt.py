"""Kernel > Interrupt for the lab: the SIGINT reaches a run that goes on behind an idle kernel.

Jupyter interrupts a kernel with SIGINT. While a cell runs, ipykernel turns it into a
KeyboardInterrupt in that cell (``Lab.wait`` catches it); while the kernel is idle it ignores it
(``SIG_IGN``), so a lab running in its own threads would never hear of it. The handler installed
here (once per process) tells the lab that asked last, then does what the handler it replaced
did. It only calls the lab's ``note_interrupt``, which must take no lock: a signal handler runs
between two bytecodes of the main thread, which may hold any lock.

ipykernel swaps the handler around every message it handles (``pre_handler_hook`` saves the one
in place and installs ``default_int_handler``; ``post_handler_hook`` puts the saved one back), and
``Lab.run`` is called from inside such a message (a cell, a button's comm message). There the
handler goes where ipykernel restores from, ``kernel.saved_sigint_handler``.
"""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["route_interrupts"]

# The handler that was in place before ours: called after ours, so SIGINT still does what it did.
_previous: Any = signal.SIG_IGN
_target: weakref.WeakMethod[Callable[[], None]] | None = None


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    note = _target() if _target is not None else None
    if note is not None:
        note()
    if callable(_previous):
        _previous(signum, frame)


def _kernel_restoring_handlers() -> Any:
    """The ipykernel kernel when this runs inside one of its message handlers, else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    inside = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    return kernel if inside and hasattr(kernel, "saved_sigint_handler") else None


def route_interrupts(note: Callable[[], None]) -> None:
    """From now on, every SIGINT calls ``note`` (a bound method, held weakly; it must take no
    lock) before the handler that was in place. Only the main thread can do this; elsewhere, and
    where SIGINT has its default action (ending the process), nothing changes."""
    global _previous, _target
    _target = weakref.WeakMethod(note)
    if threading.current_thread() is not threading.main_thread():
        return
    kernel = _kernel_restoring_handlers()
    current = kernel.saved_sigint_handler if kernel is not None else signal.getsignal(signal.SIGINT)
    if current is _on_interrupt or current in (signal.SIG_DFL, None):
        return
    _previous = current
    if kernel is not None:
        kernel.saved_sigint_handler = _on_interrupt
    else:
        signal.signal(signal.SIGINT, _on_interrupt)
