"""What every integration shares: naming a checkpoint, reading one back or exporting it as one
file, writing a file whole.

A checkpoint is named by its step directory (``run1/step-000120``), or by a symlink to one: the
*pointer* a framework finds at the path it asked to save to (Lightning's ``epoch=3-step=40.ckpt``
links to ``.nbckpt/step-000003``), made only once that step has committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import torch

from .._errors import ConfigError
from ..engine import Checkpointer, SaveHandle
from ..engine._internal import POINTER_FORMAT, POINTER_LIMIT, parse_step, plain_dcp_steps, write_atomic

__all__ = ["STEP_DIR", "atomic_torch_save", "earlier_pointer", "export", "load", "resolve", "said_waited"]

_log = logging.getLogger("nbckpt")

#: A step directory: nbckpt's (``step-000120``) or plain DCP's as torchtitan names them (``step-120``).
STEP_DIR = re.compile(r"step-([0-9]{1,19})", re.ASCII)


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


def earlier_pointer(path: str) -> tuple[str, int] | None:
    """The (nbckpt directory, step) that ``path`` names if it is a JSON pointer file of an earlier
    nbckpt (pointers are symlinks now), else None."""
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    with open(path, "rb") as f:
        head = f.read(POINTER_LIMIT + 1)
    try:
        body = json.loads(head)
        root, step = body["root"], body["step"]
    except (ValueError, TypeError, KeyError):  # not JSON (a torch file), or not a pointer
        return None
    if body.get("format") != POINTER_FORMAT or not isinstance(root, str) or type(step) is not int:
        return None
    return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), root)), step


def resolve(source: str | os.PathLike[str]) -> tuple[str, int]:
    """The nbckpt directory and step that ``source`` names: a step directory (``run1/step-000120``),
    one plain DCP wrote (that folder itself, whatever steps sit beside it), or a symlink to one
    (a Lightning ``.ckpt`` nbckpt saved)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source must be a path, not {type(source).__name__}")
    path = os.path.realpath(source)
    if not os.path.exists(path):
        raise ConfigError(f"{source} does not exist")
    if earlier_pointer(path):  # its step stays readable as a step directory
        old = f"a pointer file of an earlier nbckpt ({POINTER_FORMAT})"
        raise ConfigError(f"{source} is {old}: read it with that version, or pass its step directory")
    if not os.path.isdir(path):
        raise ConfigError(f"{source} is neither an nbckpt step directory nor a pointer to one")
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
