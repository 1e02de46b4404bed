"""Exceptions raised by nbckpt; every one derives from :class:`NbckptError`."""

from __future__ import annotations

import errno

__all__ = ["CheckpointError", "ConfigError", "NbckptError", "describe_error"]


class NbckptError(Exception):
    """Base class of every error nbckpt raises on purpose."""


class CheckpointError(NbckptError):
    """A checkpoint could not be saved, committed, verified or restored.

    Errors from background work (staging, persisting, committing) are re-raised
    as this type from the next ``save``, ``wait`` or ``close``, with the
    original exception chained as ``__cause__``.
    """


class ConfigError(NbckptError, ValueError):
    """An argument or parameter given by the user is invalid."""


def describe_error(exc: BaseException) -> str:
    """One line for an error, digging through DCP's wrapper (a BaseException) to the root cause."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    root = exc
    while root.__cause__ is not None and not isinstance(root, OSError):
        root = root.__cause__
    if isinstance(root, OSError) and root.errno is not None:
        name = errno.errorcode.get(root.errno, str(root.errno))
        where = f" ({root.filename})" if root.filename else ""
        return f"{root.strerror} [{name}]{where}"
    text = f"{type(root).__name__}: {root}".strip()
    return text.splitlines()[0] if text else type(root).__name__
