"""Exceptions raised by nbckpt; every one derives from :class:`NbckptError`."""

from __future__ import annotations

import errno
import importlib.util

__all__ = ["EXTRAS", "CheckpointError", "ConfigError", "NbckptError", "describe_error", "require_extra"]


class NbckptError(Exception):
    """Base class of every error nbckpt raises on purpose."""


class CheckpointError(NbckptError):
    """A checkpoint could not be saved, committed, verified or restored (a failure in the
    background is raised from the next ``save``, ``wait`` or ``close``, its cause chained)."""


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


#: What each face beyond the core (the engine) needs: (the extra that installs it, the modules it
#: imports). The bench and the analysis read and write pandas frames for the notebook faces.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "nbckpt.bench": ("notebook", ("pandas",)),
    "nbckpt.analysis": ("notebook", ("pandas",)),
    "nbckpt.notebook": (
        "notebook",
        ("pandas", "plotly", "IPython", "ipywidgets", "anywidget", "papermill", "nbconvert"),
    ),
    "Timeline.to_pandas": ("notebook", ("pandas",)),
    "an s3:// directory": ("s3", ("fsspec", "s3fs")),
}


def require_extra(face: str) -> None:
    """ImportError in one line naming the extra to install when a module ``face`` needs is missing
    (checked with ``find_spec`` before the face imports anything, rather than a deep
    ``ModuleNotFoundError``)."""
    extra, modules = EXTRAS[face]
    if any(importlib.util.find_spec(module) is None for module in modules):
        raise ImportError(f"{face} needs the {extra!r} extra: pip install 'nbckpt[{extra}]'")
