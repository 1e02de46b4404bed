"""What every integration shares: naming a checkpoint, reading one back or exporting it as one
file, writing a file whole.

A checkpoint is named by its step directory (``run1/step-000120``), or by a *pointer*: the small
file a framework finds at the path it asked to save to (Lightning's ``epoch=3-step=40.ckpt``
names ``.nbckpt/step-000003`` beside it), written only once that step has committed. A pointer
is a regular file, as a framework's own checkpoint is, that ``torch.load`` refuses with a
message naming what reads it (see :func:`pointer_bytes`; the layout is in docs/format.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .._errors import CheckpointError, ConfigError
from ..engine import Checkpointer, SaveHandle
from ..engine._internal import (
    POINTER_FORMAT,
    POINTER_LIMIT,
    parse_step,
    plain_dcp_steps,
    step_name,
    write_atomic,
)

__all__ = [
    "POINTER_ROOT",
    "STEP_DIR",
    "Holder",
    "atomic_torch_save",
    "close_held",
    "earlier_pointer",
    "export",
    "let_go",
    "load",
    "open_taking_over",
    "pointer_bytes",
    "read_pointer",
    "resolve",
    "running_elsewhere",
    "said_waited",
]

_log = logging.getLogger("nbckpt")


class Holder(Protocol):
    """An integration's object that holds a Checkpointer across a notebook's cells."""

    def _busy_thread(self) -> threading.Thread | None:
        """The thread training with it now, if not this one (None: it may be closed)."""

    def _let_go(self) -> None:
        """Close its Checkpointer (saves in flight commit); it opens again if used again."""


# By directory: the integration object of this process holding it (see open_taking_over).
_holders: dict[str, weakref.ref[Holder]] = {}
_holders_lock = threading.Lock()


def open_taking_over(owner: Holder, directory: str, open_: Callable[[], Checkpointer]) -> Checkpointer:
    """``open_()`` (a Checkpointer on ``directory``) for ``owner``. A cell run again makes a new
    callback while the old one, still bound, holds the directory: an earlier holder in this process
    is closed first (its saves in flight commit), unless it is training on another thread, which
    is a ConfigError naming it."""
    with _holders_lock:
        ref = _holders.get(directory)
        earlier = ref() if ref is not None else None
        if earlier is not None and earlier is not owner:
            kind = type(earlier).__name__
            thread = earlier._busy_thread()
            if thread is not None:
                raise ConfigError(
                    f"{directory} is in use by an earlier {kind} of this process, training on thread "
                    f"{thread.name!r}: let that training end (or stop it) first; one not training is "
                    "closed for the newer one"
                )
            try:
                earlier._let_go()
            except CheckpointError as exc:  # its own run's failure: that run is over
                _log.warning("nbckpt: the earlier %s on %s had failed: %s", kind, directory, exc)
            _log.info("nbckpt: closed the earlier %s on %s (its saves committed)", kind, directory)
        ckpt = open_()
        _holders[directory] = weakref.ref(owner)
    return ckpt


def running_elsewhere(thread: threading.Thread | None) -> threading.Thread | None:
    """``thread`` if it is not this one and still runs (a loop on a thread of its own); a loop
    in a cell, or one a Ctrl-C ended on this thread, is over when another cell runs."""
    if thread is None or thread is threading.current_thread() or not thread.is_alive():
        return None
    return thread


def close_held(ckpt: Checkpointer | None) -> None:
    """Close a holder's Checkpointer, if open (its saves in flight commit)."""
    if ckpt is not None:
        ckpt.close()


def let_go(owner: Holder, directory: str) -> None:
    """``owner`` no longer holds ``directory`` (it closed)."""
    with _holders_lock:
        ref = _holders.get(directory)
        if ref is not None and ref() in (owner, None):
            del _holders[directory]


#: A step directory: nbckpt's (``step-000120``) or plain DCP's as torchtitan names them (``step-120``).
STEP_DIR = re.compile(r"step-([0-9]{1,19})", re.ASCII)

#: The nbckpt directory beside a framework's pointers, which holds the steps they name.
POINTER_ROOT = ".nbckpt"
#: A pointer file's own format (its JSON line), and the most bytes one is read up to.
POINTER_FILE_FORMAT = "nbckpt-pointer/2"
_POINTER_FILE_LIMIT = 4096
#: The previous release's reservation of a name (a JSON file), settled like this one's.
_RESERVED_FORMAT = "nbckpt-reserved/1"
#: How a pointer file begins: torch's legacy-format magic number pickled (protocol 2, LONG1),
#: then the opening of a pickled str (BINUNICODE, a 4-byte length). ``torch.load`` of the file
#: (weights-only or not) reads the two and raises ``RuntimeError("Invalid protocol version:
#: <that str>")``: the str says what reads a pointer, and nothing else is ever unpickled.
_POINTER_HEAD = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little") + b".\x80\x02X"


def said_waited(handle: SaveHandle, max_inflight: int, warned: bool) -> bool:
    """Log, where the training log shows the stall, that a save waited for an earlier save's write
    (``max_inflight`` saves in flight: the backpressure ``SaveRecord.wait_s`` counts): a warning
    the first time (``warned`` False), then at INFO. Whether it said one."""
    if handle.wait_s == 0.0:  # no save was in flight
        return False
    _log.log(
        logging.INFO if warned else logging.WARNING,
        "nbckpt: the save of step %d waited %.2f s of its %.2f s stall for the write and fsync of "
        "the save before it (%d in flight at most, max_inflight): save less often, or "
        "max_inflight=%d for that many copies in host memory",
        handle.step,
        handle.wait_s,
        handle.stall_s,
        max_inflight,
        max_inflight + 1,
    )
    return True


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` of ``obj`` to ``path``, whole or not at all (over a full disk torch.save
    leaves half a file)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def pointer_bytes(step: int, committed: bool = True) -> bytes:
    """A pointer file naming ``step`` of :data:`POINTER_ROOT` beside it (``committed`` False: a
    *reservation*, the name taken by a save that has not committed yet): two pickles ``torch.load``
    reads and refuses with the second's message, then one line of JSON, what nbckpt reads."""
    where = f"{POINTER_ROOT}/{step_name(step)}"
    if committed:
        said = f"this file is not a torch checkpoint but an nbckpt pointer to {where} beside it"
    else:
        said = f"this name is reserved for the nbckpt checkpoint {where} beside it, not committed yet"
    said += (
        ": read it with nbckpt.integrations.lightning.load_checkpoint(path) or "
        "load_from_checkpoint(Model, path), or write a torch file of it with "
        "nbckpt.integrations.export(path, 'model.ckpt')"
    )
    text = said.encode()
    body = json.dumps({"format": POINTER_FILE_FORMAT, "step": step, "committed": committed})
    return _POINTER_HEAD + len(text).to_bytes(4, "little") + text + b".\n" + body.encode() + b"\n"


def read_pointer(path: str | os.PathLike[str]) -> tuple[int, bool] | None:
    """(step, committed) of the pointer file at ``path`` (or the one a symlink there leads to), or
    of a reservation the previous release wrote; None for anything else: no such name, a
    directory, a file someone else wrote (a framework's own checkpoint), a torn or foreign one.
    Reads at most 4 KiB and never unpickles. Any other OSError is raised: a name that cannot be
    read is no proof that it names no step (retention must not act on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO never blocks
    except (FileNotFoundError, IsADirectoryError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _POINTER_FILE_LIMIT + 1)  # a regular file: all of it up to that
    finally:
        os.close(fd)
    return _parsed_pointer(data) if len(data) <= _POINTER_FILE_LIMIT else None


def _parsed_pointer(data: bytes) -> tuple[int, bool] | None:
    """What :func:`read_pointer` gives for a file's whole ``data``."""
    if not data.startswith(_POINTER_HEAD):  # the previous release's reservation, or no pointer
        body = _json_object(data)
        step, committed = (
            (body.get("step"), False) if body and body.get("format") == _RESERVED_FORMAT else (None, None)
        )
    else:  # skip the message (its length, the text, the pickle's STOP) to the JSON line
        start = len(_POINTER_HEAD) + 4
        end = start + int.from_bytes(data[len(_POINTER_HEAD) : start], "little")
        body = _json_object(data[end + 2 :]) if data[end : end + 2] == b".\n" else None
        ours = body is not None and body.get("format") == POINTER_FILE_FORMAT
        step, committed = (body.get("step"), body.get("committed")) if body and ours else (None, None)
    if type(step) is not int or step < 0 or type(committed) is not bool:
        return None
    return step, committed


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(data)
    except ValueError:  # not JSON (UnicodeDecodeError is one)
        return None
    return body if isinstance(body, dict) else None


def earlier_pointer(path: str) -> tuple[str, int] | None:
    """The (nbckpt directory, step) that ``path`` names if it is a JSON pointer file of an earlier
    nbckpt (``nbckpt-pointer/1``: it named any directory, and could carry values the step lacks),
    else None."""
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    with open(path, "rb") as f:
        body = _json_object(f.read(POINTER_LIMIT + 1))
    root, step = (body.get("root"), body.get("step")) if body is not None else (None, None)
    if (
        body is None
        or body.get("format") != POINTER_FORMAT
        or not isinstance(root, str)
        or type(step) is not int
    ):
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), root)), step


def resolve(source: str | os.PathLike[str]) -> tuple[str, int]:
    """The nbckpt directory and step that ``source`` names: a step directory (``run1/step-000120``),
    one plain DCP wrote (that folder itself, whatever steps sit beside it), a pointer file (a
    Lightning ``.ckpt`` nbckpt saved), or a symlink to either (Lightning's ``save_last="link"``;
    the previous release's pointers were symlinks to their steps)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source must be a path, not {type(source).__name__}")
    path = os.path.realpath(source)
    if not os.path.exists(path):
        raise ConfigError(f"{source} does not exist")
    if not os.path.isdir(path):
        return _pointed(source, path)
    # A folder plain dcp.save wrote is read as a run of one step, itself: read from its run, a
    # step-2 would be found as step 2, which is the run's own step-000002 where there is one.
    plain = plain_dcp_steps(path, [])
    if plain:
        return path, next(iter(plain))
    step = parse_step(os.path.basename(path))
    if step is not None:
        return os.path.dirname(path), step
    raise ConfigError(
        f"{source} is a directory but not a checkpoint step (step-NNNNNN, or one plain DCP wrote); "
        "pass one of its steps"
    )


def _pointed(source: str | os.PathLike[str], path: str) -> tuple[str, int]:
    """The nbckpt directory and step the pointer file ``path`` (``source`` as the caller named it) names."""
    pointer = read_pointer(path)
    if pointer is None and earlier_pointer(path):  # its step stays readable as a step directory
        old = f"a pointer file of an earlier nbckpt ({POINTER_FORMAT})"
        raise ConfigError(f"{source} is {old}: read it with that version, or pass its step directory")
    if pointer is None:
        raise ConfigError(f"{source} is neither an nbckpt step directory nor a pointer to one")
    root, (step, committed) = os.path.join(os.path.dirname(path), POINTER_ROOT), pointer
    where = os.path.join(POINTER_ROOT, step_name(step))
    if not committed:
        raise ConfigError(
            f"{source} is reserved for {where}, whose save has not committed (in flight in another "
            "process, or cut short by a kill)"
        )
    if not os.path.isdir(os.path.join(root, step_name(step))):
        raise ConfigError(
            f"{source} is an nbckpt pointer to {where} beside it, which is not there (a copied pointer "
            "needs its .nbckpt folder: nbckpt.integrations.export writes a file that travels alone)"
        )
    return root, step


def load(source: str | os.PathLike[str], *, map_location: str | torch.device | None = None) -> dict[str, Any]:
    """The checkpoint ``source`` names (see :func:`resolve`) as one nested dict, like ``torch.load``:
    tensors on CPU (or ``map_location``), modules and optimizers as state dicts, values as saved.

    Opens the directory read-only (no lock, nothing written), so it is safe while another
    process saves into it.
    """
    root, step = resolve(source)
    with Checkpointer(root, read_only=True, ranks="local") as reader:
        return reader.load(step, map_location=map_location)


def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    map_location: str | torch.device | None = None,
) -> str:
    """Write the checkpoint ``source`` names (a step directory or a pointer to one) as one nested
    dict to ``out`` with ``torch.save``; return ``out`` as an absolute path.

    The result is what ``torch.load(out)`` gives: modules and optimizers as state dicts (with
    ``param_groups``), tensors on CPU (or ``map_location``), and every plain value the checkpoint
    holds, so a Lightning pointer exported this way is a real Lightning checkpoint
    (``Model.load_from_checkpoint(out)``). Every block is verified while it is read; ``out`` is
    replaced atomically.
    """
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).strip():
        raise ConfigError(f"out must be a file path, not {out!r}")
    target = os.path.abspath(os.fspath(out))
    if os.path.isdir(target):
        raise ConfigError(f"out {out} is a directory; name the file to write")
    if not os.path.isdir(os.path.dirname(target)):
        raise ConfigError(f"the directory of {out} does not exist")
    atomic_torch_save(load(source, map_location=map_location), target)
    return target
