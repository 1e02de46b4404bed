"""nbckpt as Lightning's checkpoint IO: asynchronous saves behind ``ModelCheckpoint``.

>>> from nbckpt.integrations.lightning import NbckptCheckpointIO
>>> trainer = Trainer(plugins=[NbckptCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

Lightning names checkpoints by path (``epoch=3-step=40.ckpt``, ``last.ckpt``) and keeps its own
top-k. Each path becomes a small JSON *pointer* naming a step of one nbckpt directory,
``.nbckpt/`` beside the pointers; the pointer is written once that step has committed, so
``fit(ckpt_path="last")`` never finds a name for a checkpoint that is not durable.

One ``ModelCheckpoint`` event is one write. With ``save_last=True`` Lightning saves twice per event
(the top-k name, then ``last``), changing ``last_model_path`` in between. A save whose tensors are
those of the step written last (storage and version counter) is not written again: its pointer
names that step and carries the plain values that differ, put back in place when it is loaded.
A step no pointer names any more (top-k removed it, ``last`` moved on) is deleted once no save is
in flight, so removal never waits for a background write.

``save_checkpoint`` returns once the state is copied into host memory; the write runs in the
background. ``teardown`` (the end of ``fit``) waits for every write and raises one that failed.
Under DDP only global rank 0 saves (Lightning calls the plug-in there alone); the directory is
opened rank-locally, and every rank reads checkpoints without a lock.

``Model.load_from_checkpoint(path)`` reads the file with ``torch.load`` and bypasses plug-ins:
use :func:`load_from_checkpoint` here (``load_from_checkpoint(Model, path)``), or turn a pointer
into a real Lightning checkpoint with :func:`nbckpt.integrations.export`.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .._errors import CheckpointError, ConfigError
from .._util import is_url
from ..engine import CheckpointConfig, Checkpointer, SaveHandle, SaveRecord
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
    """The step written last to a directory: what it holds (see :func:`_skeleton`), and references
    that keep its tensors alive, so their memory cannot be reused by new ones."""

    shape: Any
    scalars: dict[tuple[Key, ...], Any]
    keep: list[torch.Tensor]
    step: int


@dataclass
class _Root:
    """One nbckpt directory (``<checkpoint dir>/.nbckpt``) opened for writing by this process."""

    path: str
    ckpt: Checkpointer
    next_step: int
    handles: dict[int, SaveHandle] = field(default_factory=dict)
    written: _Written | None = None

    def idle(self) -> bool:
        return all(h.done() for h in self.handles.values())

    def alive(self, step: int) -> bool:
        """Whether ``step`` is committed, or being saved and not failed."""
        handle = self.handles.get(step)
        if handle is not None:
            return not (handle.done() and handle.error is not None)
        return step in self.ckpt.steps()


class NbckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously with nbckpt.

    ``mode="sync"`` makes every save durable before it returns. ``options`` are any other
    :class:`~nbckpt.CheckpointConfig` fields (``max_inflight``, ``writer_threads``, ``verify``,
    ...); ``ranks``, ``keep`` and ``read_only`` are decided here (rank-local, Lightning keeps its
    top-k, writing). Host memory: ``max_inflight`` copies of the checkpoint per checkpoint
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
        self._roots: dict[str, _Root] = {}
        self._records: list[SaveRecord] = []
        self._lock = threading.Condition()  # pointer bookkeeping only; never held across a save
        self._pending: dict[str, Pointer] = {}  # pointer files not yet written, by path
        self._errors: list[CheckpointError] = []
        _register_with_twin()

    # -- saving -------------------------------------------------------------------------------

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
        root = self._open(os.path.dirname(target))
        self._collect(root)
        keep: list[torch.Tensor] = []
        shape, scalars = _skeleton(checkpoint, keep)
        written, changed = root.written, None
        if written is not None and written.shape == shape and root.alive(written.step):
            changed = [(path, pair[1]) for path, pair in scalars.items() if written.scalars[path] != pair]
        if written is None or changed is None or len(changed) > _MAX_VALUES:  # a step of its own
            root.written = None  # drop the old references before copying the new state
            step = root.next_step
            root.next_step += 1
            root.handles[step] = root.ckpt.save(dict(checkpoint), step)
            written, changed = _Written(shape, scalars, keep, step), []
            root.written = written
        self._name(root, target, Pointer(root.path, written.step, tuple(changed)))

    def _name(self, root: _Root, target: str, pointer: Pointer) -> None:
        """Write the pointer file ``target`` once the step it names has committed."""
        with self._lock:
            self._pending[target] = pointer  # supersedes an earlier save to this name
        handle = root.handles.get(pointer.step)
        if handle is None or handle.done():
            self._write(target, pointer, handle)
        else:
            handle.committed.add_done_callback(lambda _: self._write(target, pointer, handle))

    def _write(self, target: str, pointer: Pointer, handle: SaveHandle | None) -> None:
        # Runs on nbckpt's committing thread, or on the caller's for a step already committed.
        with self._lock:
            try:
                if self._pending.get(target) != pointer:
                    return  # renamed or removed while the step was being written
                if handle is not None and handle.error is not None:
                    return  # the save's own error reaches the caller from the next call
                write_pointer(target, pointer, writer="nbckpt.integrations.lightning.NbckptCheckpointIO")
            except BaseException as exc:  # raised from the caller's next call, never lost here
                error = CheckpointError(f"writing the pointer {target} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._errors.append(error)
            finally:
                if self._pending.get(target) == pointer:
                    del self._pending[target]
                self._lock.notify_all()

    # -- removing -----------------------------------------------------------------------------

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the name ``path``; its step goes once no name is left on it and no save is in flight."""
        target = _local_path(path)
        with self._lock:
            self._pending.pop(target, None)
        if os.path.islink(target) or os.path.isfile(target):
            os.unlink(target)  # a pointer, Lightning's "last" link, or a file of an older run
        elif os.path.isdir(target):
            shutil.rmtree(target)
        root = self._roots.get(os.path.join(os.path.dirname(target), ROOT_NAME))
        if root is not None:
            self._collect(root)

    def _collect(self, root: _Root, *, force: bool = False) -> None:
        """Delete the steps of ``root`` that no pointer names, when no save is in flight
        (``Checkpointer.delete`` waits for saves in flight: that would stall training)."""
        if not (force or root.idle()):
            return
        root.handles = {s: h for s, h in root.handles.items() if not h.done()}
        with self._lock:  # pending first: a pointer written meanwhile is then seen on disk
            named = {p.step for p in self._pending.values() if p.root == root.path}
        named |= {p.step for _, p in pointers_in(os.path.dirname(root.path)) if p.root == root.path}
        for step in root.ckpt.steps():
            if step not in named:
                root.ckpt.delete(step)
        if root.written is not None and root.written.step not in named:
            root.written = None

    # -- loading ------------------------------------------------------------------------------

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint named ``path`` as Lightning's nested dict (tensors on CPU by default).

        A file that is not an nbckpt pointer (a checkpoint Lightning wrote itself) is loaded by
        Lightning's own ``TorchCheckpointIO``, so a run can resume from either.
        """
        target = _local_path(path)
        location = _map_location(map_location)
        with self._lock:
            pointer = self._pending.get(target)
        if pointer is None and os.path.isfile(target):
            pointer = read_pointer(target)
        if pointer is None and os.path.isdir(target):
            pointer = resolve(target)
        if pointer is None:  # a file Lightning wrote itself
            own = TorchCheckpointIO().load_checkpoint
            return own(target, map_location=map_location, weights_only=weights_only)
        root = self._roots.get(pointer.root)  # this process writes there: read through its Checkpointer
        return load_step(pointer, map_location=location, ckpt=root.ckpt if root is not None else None)

    # -- lifetime -----------------------------------------------------------------------------

    @property
    def records(self) -> list[SaveRecord]:
        """What each committed save cost (stall, persist time, bytes), in commit order."""
        return [*self._records, *(r for root in self._roots.values() for r in root.ckpt.records)]

    @property
    def host_bytes(self) -> int:
        """Host memory held for staging now (released by ``teardown``)."""
        return sum(root.ckpt.host_bytes for root in self._roots.values())

    def wait(self) -> None:
        """Block until every save in flight has committed and its name is written; raise a failure."""
        for root in list(self._roots.values()):
            root.ckpt.wait()
        late = self._drain()
        if late is not None:
            raise late
        self._raise_errors()

    def teardown(self) -> None:
        """Wait for every save and pointer, delete unnamed steps, release the directories and memory.

        Raises the first background error (a CheckpointError) once everything is closed.
        """
        errors: list[CheckpointError] = []
        for root in list(self._roots.values()):
            try:
                root.ckpt.wait()
            except CheckpointError as exc:
                errors.append(exc)
        late = self._drain()
        if late is not None:
            errors.append(late)
        for path, root in list(self._roots.items()):
            try:
                if not errors:
                    self._collect(root, force=True)
                self._records.extend(root.ckpt.records)
                root.ckpt.close()
            except CheckpointError as exc:
                errors.append(exc)
            finally:
                del self._roots[path]
        with self._lock:
            self._pending.clear()
            errors.extend(self._errors)
            self._errors.clear()
        if errors:
            raise errors[0]

    def _drain(self) -> CheckpointError | None:
        """Wait for the pointers of finished saves: the committing thread writes each right after
        its commit (or drops it, for a failed save), so none stays pending for long."""
        with self._lock:
            if self._lock.wait_for(lambda: not self._pending, timeout=60.0):
                return None
        return CheckpointError("pointer files were not written within 60 s of their commits")

    def _raise_errors(self) -> None:
        with self._lock:
            if not self._errors:
                return
            error = self._errors.pop(0)
        raise error

    def _open(self, directory: str) -> _Root:
        path = os.path.join(directory, ROOT_NAME)
        root = self._roots.get(path)
        if root is None:
            os.makedirs(directory, exist_ok=True)
            ckpt = Checkpointer(path, ranks="local", **self._options)
            root = _Root(path, ckpt, next_step=(ckpt.latest_step() or 0) + 1)
            self._roots[path] = root
            self._collect(root)  # steps of a killed run that no pointer ever named
        return root

    def __repr__(self) -> str:
        return f"NbckptCheckpointIO(mode={self._options['mode']!r}, directories={sorted(self._roots)})"


def load_from_checkpoint(cls: type[_T], path: str | os.PathLike[str], **kwargs: Any) -> _T:
    """``cls.load_from_checkpoint(path, **kwargs)`` for a path nbckpt saved (a pointer), or any other.

    Lightning's ``load_from_checkpoint`` reads the file with ``torch.load`` and never asks a
    plug-in; this loads the checkpoint the pointer names and hands it to Lightning's own
    loader, so hyperparameters, ``on_load_checkpoint`` and ``strict`` behave as usual.
    """
    loader: Callable[..., _T] | None = getattr(cls, "load_from_checkpoint", None)
    if loader is None:
        raise ConfigError(f"{cls.__name__} has no load_from_checkpoint (not a LightningModule or DataModule)")
    target = _local_path(path)
    if os.path.isfile(target) and read_pointer(target) is None:
        return loader(target, **kwargs)
    checkpoint = load(target)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
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


def _map_location(map_location: Any) -> str | torch.device | None:
    if map_location is None or callable(map_location):
        return None  # Lightning's default (lambda storage, loc: storage) keeps tensors on CPU
    if isinstance(map_location, (str, torch.device)):
        return map_location
    raise ConfigError(f"map_location must be a device or a device name, not {type(map_location).__name__}")


def _skeleton(checkpoint: Any, keep: list[torch.Tensor]) -> tuple[Any, dict[tuple[Key, ...], Any]]:
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
            keep.append(value)
            try:
                version, data = value._version, value.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # inference or wrapper tensors
                return object()
            layout = (value.storage_offset(), tuple(value.shape), value.stride(), value.dtype, value.device)
            return ("t", data, *layout, version)
        if type(value) in _SCALARS:
            if path is None:
                return (type(value), value)
            scalars[path] = (type(value), value)
            return "v"
        if isinstance(value, _PLAIN) or type(value).__module__ == "pathlib":
            return (type(value), value)
        if isinstance(value, Mapping):
            return ("d", tuple((k, shape(v, _sub(path, k), depth + 1)) for k, v in value.items()))
        if isinstance(value, list):
            return ("l", tuple(shape(v, _sub(path, i), depth + 1) for i, v in enumerate(value)))
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
