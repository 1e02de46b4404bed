"""What every integration shares: naming a checkpoint (a step directory or a pointer file),
reading one back, and writing small files atomically.

A *pointer* is the small JSON file a framework sees at the path it asked to save to (Lightning's
``epoch=3-step=40.ckpt``): it names the nbckpt directory and step that hold the checkpoint,
and the plain values in which its checkpoint differs from that step's (``"values"``: Lightning's
second save of one event changes a string and nothing else). It is JSON, never a pickle, and
written only after the step it names has committed, so a pointer never names a checkpoint that
is not durable.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CheckpointError, ConfigError
from ..engine import Checkpointer
from ..engine._internal import POINTER_FORMAT, POINTER_LIMIT, write_atomic

__all__ = [
    "Key",
    "Pointer",
    "Scalar",
    "atomic_torch_save",
    "load",
    "load_step",
    "pointers_in",
    "read_pointer",
    "resolve",
    "write_pointer",
]

#: A step directory: nbckpt's (``step-000120``) or plain DCP's as torchtitan names them (``step-120``).
_STEP_DIR_RE = re.compile(r"step-([0-9]{1,19})", re.ASCII)
#: A key of a dict or an index of a list on the way to a value; a value that JSON keeps exactly.
Key = str | int
Scalar = str | int | float | bool | None
_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Pointer:
    """Where a named checkpoint lives: nbckpt directory ``root`` (absolute), step ``step``, and
    ``values``: (path, value) pairs that replace what the step holds at those paths."""

    root: str
    step: int
    values: tuple[tuple[tuple[Key, ...], Scalar], ...] = ()


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` of ``obj`` to ``path``, whole or not at all (over a full disk torch.save
    leaves half a file)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def write_pointer(path: str, pointer: Pointer, **info: Any) -> None:
    """Write the pointer file at ``path``; the root is stored relative to it when it is nearby,
    so a run directory can be moved or copied whole."""
    directory = os.path.dirname(path)
    root = os.path.relpath(pointer.root, directory)
    if root.startswith(".." + os.sep) or root == "..":
        root = pointer.root
    body = {"format": POINTER_FORMAT, "root": root, "step": pointer.step, **info}
    if pointer.values:
        body["values"] = [[list(path), value] for path, value in pointer.values]
    write_atomic(path, (json.dumps(body, indent=1) + "\n").encode())


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer in file ``path``, or None when the file is something else (a torch checkpoint).

    A file that says it is a pointer but is malformed is a CheckpointError, naming the file.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(POINTER_LIMIT + 1)
    except IsADirectoryError:
        return None
    if len(head) > POINTER_LIMIT or not head.lstrip().startswith(b"{"):
        return None
    try:
        body = json.loads(head)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("format") != POINTER_FORMAT:
        return None
    root, step = body.get("root"), body.get("step")
    if not isinstance(root, str) or not root or type(step) is not int or step < 0:
        raise CheckpointError(f"{path} is an nbckpt pointer without a valid root and step")
    values = _values(body.get("values", []))
    if values is None:
        raise CheckpointError(f"{path} is an nbckpt pointer with malformed values")
    return Pointer(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), root)), step, values)


def _values(raw: Any) -> tuple[tuple[tuple[Key, ...], Scalar], ...] | None:
    """A pointer's ``values`` as written by :func:`write_pointer`, or None when malformed."""
    if not isinstance(raw, list):
        return None
    out = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[0]):
            return None
        path, value = entry
        if not all(type(key) in (str, int) for key in path) or type(value) not in _SCALARS:
            return None
        out.append((tuple(path), value))
    return tuple(out)


def _apply_values(data: dict[str, Any], pointer: Pointer) -> dict[str, Any]:
    """``data`` (the step ``pointer`` names, loaded) with the pointer's values put in place."""
    for path, value in pointer.values:
        node: Any = data
        try:
            for key in path[:-1]:
                node = node[key]
            if not isinstance(node, (dict, list)):
                raise TypeError(f"a {type(node).__name__}")
            container: Any = node  # a dict by key or a list by index; a str key into a list raises
            container[path[-1]] = value
        except (KeyError, IndexError, TypeError) as exc:
            where = ".".join(map(str, path))
            raise CheckpointError(f"step {pointer.step} of {pointer.root} has no {where} ({exc})") from None
    return data


def pointers_in(directory: str) -> Iterator[tuple[str, Pointer]]:
    """Every pointer file (not a symlink to one) directly in ``directory``, whatever its name."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            try:
                pointer = read_pointer(entry.path)
            except (OSError, CheckpointError):
                continue  # removed meanwhile, or not ours to judge: never a reason to delete
            if pointer is not None:
                yield entry.path, pointer


def resolve(source: str | os.PathLike[str]) -> Pointer:
    """The nbckpt directory and step that ``source`` names: a step directory (``run1/step-000120``,
    or one plain DCP wrote), or a pointer file (a Lightning ``.ckpt`` written by nbckpt)."""
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"source must be a path, not {type(source).__name__}")
    path = os.path.abspath(os.fspath(source))
    name = os.path.basename(path.rstrip(os.sep))
    match = _STEP_DIR_RE.fullmatch(name)
    if os.path.isdir(path):
        if match is None and os.path.isfile(os.path.join(path, ".metadata")):
            return Pointer(path, 0)  # a directory plain dcp.save wrote, named otherwise: one step
        if match is None:
            raise ConfigError(
                f"{source} is a directory but not a checkpoint step (step-NNNNNN); pass one of its steps"
            )
        return Pointer(os.path.dirname(path.rstrip(os.sep)), int(match.group(1)))
    if not os.path.exists(path):
        raise ConfigError(f"{source} does not exist")
    pointer = read_pointer(path)
    if pointer is None:
        raise ConfigError(f"{source} is neither an nbckpt step directory nor an nbckpt pointer file")
    return pointer


def load(source: str | os.PathLike[str], *, map_location: str | torch.device | None = None) -> dict[str, Any]:
    """The checkpoint ``source`` names (see :func:`resolve`) as one nested dict, like ``torch.load``:
    tensors on CPU (or ``map_location``), modules and optimizers as state dicts, values as saved.

    Opens the directory read-only, so it is safe while another process saves into it.
    """
    return load_step(resolve(source), map_location=map_location)


def load_step(
    pointer: Pointer, *, map_location: str | torch.device | None = None, ckpt: Checkpointer | None = None
) -> dict[str, Any]:
    """The checkpoint ``pointer`` names: its step with its values applied, read through ``ckpt``
    or a read-only Checkpointer (no lock, nothing written)."""
    if ckpt is not None:
        return _apply_values(ckpt.load(pointer.step, map_location=map_location), pointer)
    with Checkpointer(pointer.root, read_only=True, ranks="local") as reader:
        return _apply_values(reader.load(pointer.step, map_location=map_location), pointer)
