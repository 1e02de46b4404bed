"""Small jobs every layer needs, written once: units, counts, durations, paths.

The bottom of the package: it imports nothing from nbckpt but the errors.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._errors import ConfigError

__all__ = [
    "GB",
    "GIB",
    "MIB",
    "check_count",
    "check_path",
    "could_create",
    "format_bytes",
    "format_duration",
    "is_url",
    "parse_duration",
    "parse_value",
    "run_directory",
    "run_target",
    "writable_directory",
]

MIB = 1 << 20
GIB = 1 << 30
#: Decimal gigabyte: bandwidths and disk sizes are quoted in these.
GB = 10**9


def format_bytes(nbytes: float) -> str:
    """``1.2 GB`` style sizes (decimal units, like disks and bandwidths)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


#: Units a duration may be written in, in seconds ("500ms", "30s", "10min", "1.5h", "2 d").
_DURATION_UNITS = {
    "": 1.0,
    "ms": 1e-3,
    "s": 1.0,
    "sec": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "d": 86400.0,
}
_DURATION_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.ASCII | re.IGNORECASE)


def parse_value(text: str) -> Any:
    """A value typed on a command line (``-p KEY VALUE``, ``--option KEY=VALUE``): JSON where it
    parses (numbers, true/false, null, lists), else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_duration(value: str | float, name: str = "duration") -> float:
    """Seconds in ``value``: a positive number of seconds, or text such as ``30s``, ``10min``,
    ``1h``, ``1.5 h`` or ``90`` (plain seconds); ConfigError in one line otherwise."""
    seconds: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.fullmatch(value)):
        unit = _DURATION_UNITS.get(match[2].lower())
        seconds = float(match[1]) * unit if unit is not None else None
    if seconds is None or not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(
            f"{name} must be a positive number of seconds or a duration such as 30s, 10min or 1h, "
            f"not {value!r}"
        )
    return seconds


def format_duration(seconds: float) -> str:
    """``0.2 s``, ``45 s``, ``10 min``, ``1.5 h``: how a duration reads in a status line."""
    for unit, scale in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def check_count(value: Any, name: str, *, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` if it is an integer in ``[minimum, maximum]``, else ConfigError naming ``name``."""
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = (
            f"an integer from {minimum} to {maximum}"
            if maximum is not None
            else ("a positive integer" if minimum == 1 else f"an integer >= {minimum}")
        )
        raise ConfigError(f"{name} must be {bound}, not {value!r}")
    return value


def check_flag(value: Any, name: str) -> bool:
    """``value`` if it is True or False (``verify="no"`` would be taken as true), else ConfigError."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, not {value!r}")
    return value


def check_options(value: Any, name: str) -> dict[str, Any]:
    """``value`` as fsspec's keyword arguments: a dict whose keys are names, else ConfigError."""
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a dict, not {type(value).__name__}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise ConfigError(f"{name} must have option names as keys, not {key!r}")
    return value


def check_path(path: Any, what: str) -> str:
    """``path`` as text if it can name a file or directory (a local path or a URL); else a
    one-line ConfigError naming ``what`` (the OS raises a bare ValueError for a NUL)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{what} must be a path, not {type(path).__name__} {repr(path)[:80]}")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise ConfigError(f"{what} {text!r} holds a NUL character, which no path can")
    if not text.removeprefix("file://").strip():
        raise ConfigError(
            f"{what} {text!r} names no directory"
            + ("; a file:// URL needs a path (file:///data/run1)" if text.startswith("file://") else "")
        )
    return text


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for fsspec URLs such as ``s3://bucket/run``; ``file://`` counts as local."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def could_create(path: str) -> str | None:
    """Why no directory can be made at local ``path`` (its nearest existing part is a file, or
    not writable), or None. Nothing is created: a check at set-up leaves nothing behind."""
    existing = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
    while not os.path.lexists(existing):  # the nearest part that exists: the save creates the rest
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def writable_directory(path: str | os.PathLike[str], what: str = "directory") -> Path:
    """Create ``path`` (and parents) if needed and prove a file can be written there; else a
    one-line ConfigError naming ``what`` (a directory created here is removed again)."""
    target = Path(check_path(path, what).removeprefix("file://")).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{what} {target} is not writable (it is a file, not a directory)")
    missing = _first_missing(target)
    try:
        target.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(prefix=".nbckpt-probe-", dir=target).close()
    except OSError as exc:
        if missing is not None and missing.exists():
            shutil.rmtree(missing, ignore_errors=True)
        raise ConfigError(f"{what} {target} is not writable ({exc.strerror or exc})") from None
    return target


def _first_missing(target: Path) -> Path | None:
    """The outermost of ``target`` and its parents that does not exist (None: ``target`` does)."""
    if target.exists():
        return None
    missing = target
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    return missing


@contextmanager
def run_target(directory: str, what: str) -> Iterator[None]:
    """A run's target ``directory`` (a path, or a URL left as it is): proved writable first,
    created if missing, so that a bad one is one line before anything starts (before torchrun
    and its ranks). What was created for it (parents too) is removed again after, when the run
    did not finish or left no file there (its checkpoints removed, as without ``--keep``)."""
    made = None if is_url(directory) else _first_missing(Path(directory.removeprefix("file://")).expanduser())
    if not is_url(directory):
        writable_directory(directory, what)
    try:
        yield
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if made is not None and not any(files for _, _, files in os.walk(made)):
        shutil.rmtree(made, ignore_errors=True)


def run_directory(workdir: str | os.PathLike[str], prefix: str = "run-") -> Path:
    """A new, empty directory inside ``workdir`` (created if needed) for one run of a notebook,
    so that re-running it never meets the checkpoints of an earlier run."""
    root = writable_directory(workdir, "workdir")
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))
