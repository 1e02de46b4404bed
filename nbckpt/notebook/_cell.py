"""What a magic's cell shows when the engine warns or fails: warnings that point at the user's
line, errors as one line (a UsageError for bad input, :class:`CheckpointFailed` otherwise)."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import IPython
from IPython.core.error import UsageError

from .._errors import CheckpointError, ConfigError, NbckptError

if TYPE_CHECKING:
    from types import FrameType

__all__ = ["CheckpointFailed", "Interrupted", "OneLineWarnings", "engine_call", "one_line", "reraise"]

# Frames in these are never "the user's code" that a warning should point at.
_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep
    for module in (sys.modules[__package__], IPython, contextlib)
)


class CheckpointFailed(CheckpointError):
    """A magic's save, wait or restore failed: one line in IPython, the engine's error its cause."""

    def _render_traceback_(self) -> list[str]:
        # IPython's hook for exceptions that format themselves (only UsageError itself, not a
        # subclass, gets IPython's short form)
        return [f"{type(self).__name__}: {self}"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in a magic's save or restore, shown as one line saying what was kept; still a
    KeyboardInterrupt (for ``except`` and the autosave's interrupt trigger)."""

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


def one_line(exc: BaseException) -> str:
    """An error's message on one line."""
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def reraise(exc: NbckptError) -> None:
    """An NbckptError as the one-line error a magic shows (ConfigError: the user's input)."""
    if isinstance(exc, ConfigError):
        raise UsageError(one_line(exc)) from exc
    raise CheckpointFailed(one_line(exc)) from exc


class OneLineWarnings:
    """``warnings.showwarning`` while the extension is loaded: nbckpt's warnings as their one line,
    without the cell's echo (IPython's ``run_line_magic(...)``, not what the user typed); other
    warnings as before."""

    def __init__(self, previous: Callable[..., None]) -> None:
        self.previous = previous

    def __call__(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if not text.startswith("nbckpt: "):
            self.previous(message, category, filename, lineno, file, line)
            return
        stream = file if file is not None else sys.stderr
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a closed stream, as warnings does
                stream.write(f"{category.__name__}: {one_line(Warning(text))}\n")


def _warn_at_cell(warning: Warning | str, user_globals: dict[str, Any]) -> None:
    """Issue ``warning`` as if the user's cell had (the line a reader can act on): the frame
    that runs in the notebook's namespace, else the first one outside nbckpt and IPython."""
    frame: FrameType | None = inspect.currentframe()
    level, fallback = 1, 0
    while frame is not None and frame.f_globals is not user_globals:
        if not fallback and not frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
            fallback = level
        frame = frame.f_back
        level += 1
    warnings.warn(warning, stacklevel=level if frame is not None else fallback or 2)


@contextlib.contextmanager
def engine_call(user_globals: Callable[[], dict[str, Any]]) -> Iterator[None]:
    """Around a call into the engine: its warnings move to the user's cell (whose namespace
    ``user_globals()`` gives), its errors become one line. (catch_warnings swaps process-wide
    state: only the magics use it, on the kernel's main thread, for one call.)"""
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield
    except NbckptError as exc:
        reraise(exc)
    finally:  # shown before the error, if there is one
        for record in caught:
            _warn_at_cell(record.message, user_globals())
