"""nbckpt as Lightning's checkpoint IO: asynchronous saves behind ``ModelCheckpoint``.

>>> from nbckpt.integrations.lightning import NbckptCheckpointIO
>>> trainer = Trainer(plugins=[NbckptCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

Each path Lightning saves to (``epoch=3-step=40.ckpt``, ``last.ckpt``) becomes a small JSON
*pointer* naming a step of one nbckpt directory, ``.nbckpt/`` beside it, written once that step has
committed: ``fit(ckpt_path="last")`` never finds a name for a checkpoint that is not durable.
One ``ModelCheckpoint`` event is one write: a save whose tensors are those of the step written
last (same storage and version counter: ``save_last`` saves the top-k state again) names that
step, its pointer carrying the plain values that differ. Retention is the engine's:
``keep=CustomSteps(<the steps the names point to>)``, applied after each commit and when a name
is removed. ``teardown`` waits for every write and raises one that failed. Under DDP only global
rank 0 saves (Lightning calls the plug-in there alone); every rank reads without a lock.

``Model.load_from_checkpoint(path)`` reads the file with ``torch.load`` and bypasses plug-ins:
use :func:`load_from_checkpoint` here, or :func:`nbckpt.integrations.export` for a real file.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .._errors import CheckpointError, ConfigError
from .._util import is_url
from ..engine import CheckpointConfig, Checkpointer, CustomSteps, SaveHandle, SaveRecord
from ._common import Key, Pointer, load, load_step, pointers_in, read_pointer, resolve, write_pointer

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
else:
    try:
        from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
    except ImportError:
        try:
            from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO
        except ImportError as exc:
            raise ImportError(
                "nbckpt.integrations.lightning needs Lightning: pip install 'nbckpt[lightning]'"
            ) from exc

__all__ = ["ROOT_NAME", "NbckptCheckpointIO", "load_from_checkpoint"]

ROOT_NAME = ".nbckpt"
"""The nbckpt directory beside a checkpoint directory's pointer files."""
_T = TypeVar("_T")
#: Options a Lightning run decides itself: which rank saves, what to keep, read or write.
_RESERVED = {"ranks", "keep", "read_only"}
#: More changed values than this and a save is written as a step of its own.
_MAX_VALUES = 64
_SCALARS = (str, int, float, bool, type(None))
_PLAIN = (bool, int, float, str, torch.dtype, torch.device)  # compared by value, never carried


@dataclass
class _Written:
    """The step written last to a directory: its save, what it holds (see :func:`_skeleton`), and
    its tensors, kept alive so that their memory cannot be reused by new ones."""

    handle: SaveHandle
    shape: Any
    scalars: dict[tuple[Key, ...], Any]
    tensors: list[torch.Tensor]


class NbckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously with nbckpt.

    ``mode="sync"`` makes every save durable before it returns. ``options`` are any other
    :class:`~nbckpt.CheckpointConfig` fields (``max_inflight``, ``writer_threads``, ``verify``,
    ...); ``ranks``, ``keep`` and ``read_only`` are decided here (rank-local, the steps Lightning's
    names point to, writing). Host memory: ``max_inflight`` copies of the checkpoint per checkpoint
    directory, held until ``teardown``.
    """

    def __init__(self, mode: str = "async", **options: Any) -> None:
        reserved = sorted(_RESERVED & set(options))
        if reserved:
            raise ConfigError(
                f"NbckptCheckpointIO decides {', '.join(reserved)} itself (rank 0 saves alone, "
                "ModelCheckpoint's save_top_k decides what to keep)"
            )
        options["mode"] = mode
        CheckpointConfig.build(None, **options)  # a bad option fails now, not in the middle of fit()
        self._options = options
        self._roots: dict[str, Checkpointer] = {}  # by nbckpt directory
        self._written: dict[str, _Written] = {}
        self._records: list[SaveRecord] = []
        self._lock = threading.Lock()  # pointer bookkeeping only; never held across a save
        self._pending: dict[str, tuple[Pointer, SaveHandle]] = {}  # pointers not yet written, by path
        self._errors: list[CheckpointError] = []
        _register_with_twin()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Start saving ``checkpoint`` under the name ``path``; returns once it is copied."""
        if storage_options is not None:
            kind = type(storage_options).__name__
            raise ConfigError(f"NbckptCheckpointIO takes no storage_options (got {kind}); pass options to it")
        if not isinstance(checkpoint, Mapping):
            raise ConfigError(f"checkpoint must be a dict, not {type(checkpoint).__name__}")
        target = _local_path(path)
        self._raise_errors()
        root = os.path.join(os.path.dirname(target), ROOT_NAME)
        ckpt = self._open(root)
        tensors: list[torch.Tensor] = []
        shape, scalars = _skeleton(checkpoint, tensors)
        last, changed = self._written.get(root), None
        if last is not None and last.shape == shape and not (last.handle.done() and last.handle.error):
            changed = [(path, pair[1]) for path, pair in scalars.items() if last.scalars[path] != pair]
        if last is None or changed is None or len(changed) > _MAX_VALUES:  # a step of its own
            step = (last.handle.step if last is not None else ckpt.latest_step() or 0) + 1
            self._written.pop(root, None)  # drop the old references before copying the new state
            last, changed = _Written(ckpt.save(dict(checkpoint), step), shape, scalars, tensors), []
            self._written[root] = last
        pending = (Pointer(root, last.handle.step, tuple(changed)), last.handle)
        with self._lock:
            self._pending[target] = pending  # supersedes an earlier save to this name
        if last.handle.done():
            self._write(target, pending)
            ckpt.retain()  # the step this name pointed to before may be free now
        else:
            last.handle.committed.add_done_callback(lambda _: self._write(target, pending))

    def _write(self, target: str, pending: tuple[Pointer, SaveHandle]) -> None:
        """Write the pointer file ``target`` of a finished save, if it is still the one to write:
        on nbckpt's committing thread (before its retention pass), or on the caller's."""
        with self._lock:
            if self._pending.get(target) is not pending:
                return  # written already, renamed or removed meanwhile
            del self._pending[target]
            try:
                if pending[1].error is None:  # a save's own error reaches the caller from nbckpt
                    write_pointer(target, pending[0], writer=f"{__name__}.NbckptCheckpointIO")
            except BaseException as exc:  # raised from the caller's next call, never lost here
                error = CheckpointError(f"writing the pointer {target} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._errors.append(error)

    def _named(self, root: str) -> set[int]:
        """The steps of ``root`` that a name points to (the retention policy's answer), pending
        names first: a pointer written meanwhile is then seen on disk."""
        with self._lock:
            named = {p.step for p, _ in self._pending.values() if p.root == root}
        return named | {p.step for _, p in pointers_in(os.path.dirname(root)) if p.root == root}

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the name ``path``; its step goes once no name is left on it (in the background)."""
        target = _local_path(path)
        with self._lock:
            self._pending.pop(target, None)
        if os.path.islink(target) or os.path.isfile(target):
            os.unlink(target)  # a pointer, Lightning's "last" link, or a file of an older run
        elif os.path.isdir(target):
            shutil.rmtree(target)
        ckpt = self._roots.get(os.path.join(os.path.dirname(target), ROOT_NAME))
        if ckpt is not None:
            ckpt.retain()

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint named ``path`` as Lightning's nested dict (tensors on CPU by default); a
        file Lightning wrote itself is loaded by its own ``TorchCheckpointIO``."""
        target = _local_path(path)
        with self._lock:
            pointer = self._pending[target][0] if target in self._pending else None
        if pointer is None and os.path.isfile(target) and read_pointer(target) is None:
            own = TorchCheckpointIO().load_checkpoint
            return own(target, map_location=map_location, weights_only=weights_only)
        pointer = pointer or resolve(target)  # a pointer file, or a step directory
        location = None if callable(map_location) else map_location  # Lightning's default: on CPU
        return load_step(pointer, map_location=location, ckpt=self._roots.get(pointer.root))

    @property
    def records(self) -> list[SaveRecord]:
        """What each committed save cost (stall, persist time, bytes), in commit order."""
        return [*self._records, *(r for ckpt in self._roots.values() for r in ckpt.records)]

    @property
    def host_bytes(self) -> int:
        """Host memory held for staging now (released by ``teardown``)."""
        return sum(ckpt.host_bytes for ckpt in self._roots.values())

    def wait(self) -> None:
        """Block until every save in flight has committed and its name is written; raise a failure."""
        errors = self._settle()
        if errors:
            raise errors[0]

    def teardown(self) -> None:
        """Wait for every save and pointer, release the directories and memory; raise the first
        background error (a CheckpointError) once everything is closed."""
        errors = self._settle()
        self._written.clear()
        for root, ckpt in list(self._roots.items()):
            try:
                self._records.extend(ckpt.records)
                ckpt.close()
            except CheckpointError as exc:
                errors.append(exc)
            finally:
                del self._roots[root]
        if errors:
            raise errors[0]

    def _settle(self) -> list[CheckpointError]:
        """Wait for the saves, write the pointers their callbacks have not written yet (the
        callbacks may run after the wait returns); every error so far, taken."""
        errors: list[CheckpointError] = []
        for ckpt in list(self._roots.values()):
            try:
                ckpt.wait()
            except CheckpointError as exc:
                errors.append(exc)
        with self._lock:
            pending = list(self._pending.items())
        for target, entry in pending:
            self._write(target, entry)
        with self._lock:
            errors.extend(self._errors)
            self._errors.clear()
        return errors

    def _raise_errors(self) -> None:
        with self._lock:
            error = self._errors.pop(0) if self._errors else None
        if error is not None:
            raise error

    def _open(self, root: str) -> Checkpointer:
        ckpt = self._roots.get(root)
        if ckpt is None:
            os.makedirs(os.path.dirname(root), exist_ok=True)
            policy = CustomSteps(lambda: self._named(root))
            ckpt = self._roots[root] = Checkpointer(root, ranks="local", keep=policy, **self._options)
            ckpt.retain()  # steps of a killed run that no pointer ever named
        return ckpt

    def __repr__(self) -> str:
        return f"NbckptCheckpointIO(mode={self._options['mode']!r}, directories={sorted(self._roots)})"


def load_from_checkpoint(cls: type[_T], path: str | os.PathLike[str], **kwargs: Any) -> _T:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a path nbckpt saved (a pointer), or any other.

    Lightning's ``load_from_checkpoint`` reads the file with ``torch.load`` and never asks a
    plug-in; this hands the checkpoint the pointer names to Lightning's own loader, so
    hyperparameters, ``on_load_checkpoint`` and ``strict`` behave as usual.
    """
    loader: Callable[..., _T] | None = getattr(cls, "load_from_checkpoint", None)
    if loader is None:
        raise ConfigError(f"{cls.__name__} has no load_from_checkpoint (not a LightningModule or DataModule)")
    target = _local_path(path)
    if os.path.isfile(target) and read_pointer(target) is None:
        return loader(target, **kwargs)
    buffer = io.BytesIO()
    torch.save(load(target), buffer)
    buffer.seek(0)
    # These bytes were pickled a line above from values nbckpt decoded as JSON: nothing foreign
    # is unpickled, and weights_only would refuse saved hyperparameters such as a Namespace.
    return loader(buffer, weights_only=False, **kwargs)


def _local_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a file path, not {type(path).__name__}")
    text = os.fspath(path)
    if is_url(text):
        raise ConfigError(
            f"NbckptCheckpointIO writes local or NFS directories; {text} is a URL "
            "(save to a mounted path, or use nbckpt.Checkpointer with the URL directly)"
        )
    return os.path.abspath(text.removeprefix("file://"))


def _skeleton(checkpoint: Any, tensors: list[torch.Tensor]) -> tuple[Any, dict[tuple[Key, ...], Any]]:
    """What a checkpoint holds, in two parts: its shape, comparable with ``==`` (keys, lengths,
    tensors by storage, place and version counter: an in-place update bumps it), and its plain
    scalars by path, the values a pointer can carry. Anything else never compares equal, so a
    doubt always costs a save, never a stale checkpoint."""
    scalars: dict[tuple[Key, ...], Any] = {}

    def shape(value: Any, path: tuple[Key, ...] | None, depth: int) -> Any:
        # path is None under a key JSON cannot name: a scalar there is part of the shape.
        if depth > 64:
            return object()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            try:
                version, data = value._version, value.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # inference or wrapper tensors
                return object()
            layout = (value.storage_offset(), value.shape, value.stride(), value.dtype, value.device)
            return ("t", data, *layout, version)
        if type(value) in _SCALARS and path is not None:
            scalars[path] = (type(value), value)
            return "v"
        if isinstance(value, _PLAIN) or type(value).__module__ == "pathlib":
            return (type(value), value)
        if isinstance(value, (Mapping, list)):
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            return (type(value) is list, tuple((k, shape(v, _sub(path, k), depth + 1)) for k, v in items))
        if isinstance(value, tuple):  # not assignable in place: its scalars are shape
            return ("u", tuple(shape(v, None, depth + 1) for v in value))
        return object()

    return shape(checkpoint, (), 0), scalars


def _sub(path: tuple[Key, ...] | None, key: Any) -> tuple[Key, ...] | None:
    return (*path, key) if path is not None and type(key) in (str, int) else None


def _register_with_twin() -> None:
    """Lightning ships under two names (``lightning`` and ``pytorch_lightning``), each with its
    own ``CheckpointIO`` class; register with the other one too when it is loaded, so either
    Trainer accepts the plug-in."""
    for module in ("lightning.fabric.plugins", "lightning_fabric.plugins"):
        loaded = sys.modules.get(module)
        other = getattr(loaded, "CheckpointIO", None) if loaded is not None else None
        if other is not None and other is not CheckpointIO and not issubclass(NbckptCheckpointIO, other):
            other.register(NbckptCheckpointIO)
