"""What the Lab's runs need besides widgets: the target check, one-line errors, and Kernel >
Interrupt routed to the lab that runs."""

from __future__ import annotations

import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from .._errors import CheckpointError, ConfigError
from .._util import could_create, is_url

__all__ = ["check_target", "error_line", "route_interrupts"]


def check_target(path: str) -> None:
    """ConfigError when ``path`` cannot hold checkpoints (URLs are not checked). Nothing is
    created: a lab that is only validated leaves no directory behind."""
    if not path.strip():
        raise ConfigError("the target path is empty")
    if not is_url(path) and (reason := could_create(path)) is not None:
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
    inside = signal.getsignal(signal.SIGINT) is signal.default_int_handler and hasattr(
        kernel, "saved_sigint_handler"
    )
    current = kernel.saved_sigint_handler if inside else signal.getsignal(signal.SIGINT)
    if current is _on_sigint or current in (signal.SIG_DFL, None):
        return
    _previous_sigint = current
    if inside:
        kernel.saved_sigint_handler = _on_sigint
    else:
        signal.signal(signal.SIGINT, _on_sigint)
