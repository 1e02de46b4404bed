"""nbckpt as Lightning's checkpoint IO: asynchronous saves behind ``ModelCheckpoint``.

>>> trainer = Trainer(plugins=[NbckptCheckpointIO()], callbacks=[ModelCheckpoint(save_last=True)])
>>> trainer.fit(model, ckpt_path="last")

Each path Lightning saves to (``epoch=3-step=40.ckpt``, ``last.ckpt``) becomes a *pointer*: a
small regular file naming a step of one nbckpt directory, ``.nbckpt/`` beside it, written once
that step has committed, so ``fit(ckpt_path="last")`` never finds a checkpoint that is not
durable. A new name exists from the moment ``save_checkpoint`` accepts the save (a
*reservation*: the same small file marked not committed, which the pointer replaces), because
``ModelCheckpoint`` picks its ``-vN`` names by what exists: a name still missing while its save
was in flight was handed out again, and the save it named lost. A save equal to the step written
last (``save_last`` saves the top-k state again) writes nothing and points to that step. The
engine's retention keeps the steps the pointers name. Under DDP only global rank 0 saves
(Lightning calls the plug-in there alone); every rank reads without a lock. A
``trainer.save_checkpoint`` outside a run (after ``fit``: no teardown follows it) is durable when
it returns and leaves no thread behind.

``Model.load_from_checkpoint(path)`` reads the file with ``torch.load`` and bypasses plug-ins (on
a pointer, torch raises a message naming these): use :func:`load_from_checkpoint` here, or
:func:`nbckpt.integrations.export` for a real file.

To save when a save schedule says (the interval this run's measured save costs advise) instead of
every N steps: ``ScheduledCheckpoint(SaveSchedule(mtbf="8h"), dirpath=..., save_last=True)`` in
place of ``ModelCheckpoint``, with this plug-in.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import itertools
import os
import shutil
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from .._errors import CheckpointError, ConfigError
from .._util import is_url
from ..engine import CheckpointConfig, Checkpointer, CustomSteps, SaveHandle, SaveRecord, SaveSchedule
from ..engine._internal import Interval, Pacer, version_of, write_atomic
from ._common import POINTER_ROOT, STEP_DIR, earlier_pointer, load, pointer_bytes, read_pointer, said_waited

try:
    from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
except ImportError:
    try:  # pytorch_lightning alone: the same classes, as lightning_fabric
        from lightning_fabric.plugins import CheckpointIO, TorchCheckpointIO  # type: ignore[assignment]
    except ImportError as exc:
        message = "nbckpt.integrations.lightning needs Lightning: pip install 'nbckpt[lightning]'"
        raise ImportError(message) from exc

try:
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.states import TrainerStatus
except ImportError:  # pytorch_lightning alone
    from pytorch_lightning.callbacks import ModelCheckpoint  # type: ignore[no-redef,assignment]
    from pytorch_lightning.trainer.states import TrainerStatus  # type: ignore[no-redef,assignment]

__all__ = [
    "ROOT_NAME",
    "CheckpointNotFound",
    "NbckptCheckpointIO",
    "ScheduledCheckpoint",
    "load_checkpoint",
    "load_from_checkpoint",
]

ROOT_NAME = POINTER_ROOT
"""The nbckpt directory beside a checkpoint directory's pointers."""
_T = TypeVar("_T")
#: Options a Lightning run decides itself: which rank saves, what to keep, read or write.
_RESERVED = {"ranks", "keep", "read_only"}
#: Compared by value; anything else but tensors and containers never compares equal.
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
#: The ending of a pointer being made (a name Lightning never looks for).
_TEMPORARY = ".nbckpt-tmp"
#: Lightning's two package names (see _register_with_twin).
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
#: Hyperparameter classes Lightning records by class (``hparams_type`` beside Hydra/OmegaConf
#: hyperparameters): a checkpoint names them by qualified name, and only these are imported back.
_HPARAMS_TYPES = {
    "omegaconf.dictconfig.DictConfig": ("omegaconf", "DictConfig"),
    "omegaconf.listconfig.ListConfig": ("omegaconf", "ListConfig"),
}
#: The plug-ins of this process, for :func:`load_from_checkpoint` of a name still reserved.
_LIVE: weakref.WeakSet[NbckptCheckpointIO] = weakref.WeakSet()


class CheckpointNotFound(ConfigError, FileNotFoundError):
    """``fit(ckpt_path=...)`` named no checkpoint (a ``FileNotFoundError``, as Lightning's own IO)."""


class NbckptCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves asynchronously with nbckpt (``mode="sync"``: durable
    on return). ``options`` are other :class:`~nbckpt.CheckpointConfig` fields (``max_inflight``,
    ``writer_threads``, ...). Host memory: ``max_inflight`` copies of the checkpoint per checkpoint
    directory, held until ``teardown``.
    """

    def __init__(self, mode: str = "async", **options: Any) -> None:
        reserved = sorted(_RESERVED & set(options))
        if reserved:
            raise ConfigError(
                f"NbckptCheckpointIO decides {', '.join(reserved)} itself (rank 0 saves alone, "
                "ModelCheckpoint's save_top_k decides what to keep)"
            )
        self._config = CheckpointConfig.build(None, mode=mode, **options)  # fails now, not mid-fit()
        self._start()

    def _start(self) -> None:
        """What a plug-in holds while it saves: none of it travels with a copy (see __getstate__)."""
        self._roots: dict[str, Checkpointer] = {}  # by nbckpt directory
        # By nbckpt directory: what the step written last holds (see _fingerprint), its save, and
        # its tensors, kept alive so that their memory cannot be reused by new ones.
        self._written: dict[str, tuple[Any, SaveHandle, list[torch.Tensor]]] = {}
        self._records: list[SaveRecord] = []
        self._lock = threading.Lock()  # pointer bookkeeping only; never held across a save
        self._pending: dict[str, SaveHandle] = {}  # pointers not made yet, by path
        self._errors: list[CheckpointError] = []
        self._warned_wait = False  # a save waited for the one before it: said as a warning once
        _register_with_twin()
        _LIVE.add(self)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``ddp_spawn`` pickles the Trainer to each process, ``copy.deepcopy(trainer)``,
        ``torch.save(trainer)``) is a new plug-in with the same options: open directories,
        threads and saves in flight stay with the original."""
        return {"_config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._config = state["_config"]
        self._start()

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
        if _called_by_async_io():
            raise ConfigError(
                "NbckptCheckpointIO saves asynchronously itself: pass it to the Trainer as it is, not "
                "wrapped in AsyncCheckpointIO (which copies every checkpoint again, removes top-k names "
                "before their saves and never tears the plug-in down)"
            )
        with self._lock:
            if self._errors:
                raise self._errors.pop(0)
        checkpoint = _portable(checkpoint)
        root = os.path.join(os.path.dirname(target), ROOT_NAME)
        ckpt = self._open(root)
        tensors: list[torch.Tensor] = []
        held = _fingerprint(checkpoint, tensors, 0)
        last = self._written.get(root)
        if last is None or last[0] != held or last[1].error is not None:  # a step of its own
            step = (last[1].step if last is not None else ckpt.latest_step() or 0) + 1
            self._written.pop(root, None)  # drop the old references before copying the new state
            last = self._written[root] = (held, ckpt.save(dict(checkpoint), step), tensors)
            self._warned_wait |= said_waited(last[1], self._config.max_inflight, self._warned_wait)
        handle = last[1]
        with self._lock:
            self._pending[target] = handle  # supersedes an earlier save to this name
            if not os.path.lexists(target):  # a name in use keeps its old pointer until the commit
                _point(target, handle.step, committed=False)
        # On nbckpt's committing thread before its retention pass, or here and now when committed.
        handle.committed.add_done_callback(lambda _: self._link(target, handle))
        if handle.done():
            ckpt.retain()  # the step this name pointed to before may be free now
        if _outside_a_run():
            self.teardown()  # no fit's teardown follows to finish it (and end nbckpt's threads)

    def _link(self, target: str, handle: SaveHandle) -> None:
        """Make the pointer ``target`` of a finished save, if that is still its save."""
        with self._lock:
            if self._pending.get(target) is not handle:
                return  # made already, saved again or removed meanwhile
            del self._pending[target]
            if handle.error is not None:  # a save's own error reaches the caller from nbckpt
                if read_pointer(target) == (handle.step, False):
                    os.unlink(target)  # the name it reserved was never a checkpoint
                return
            try:
                _point(target, handle.step)
            except BaseException as exc:  # raised from the caller's next call, never lost here
                error = CheckpointError(f"making the pointer {target} failed: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
                self._errors.append(error)

    def settle(self, target: str) -> None:
        """Wait until the save ``target`` names, if it is one of this plug-in's in flight, has
        committed and made its pointer (raise its failure)."""
        with self._lock:
            handle = self._pending.get(target)
        if handle is not None:
            try:
                handle.wait()
            finally:
                self._link(target, handle)

    def _named(self, root: str) -> set[int]:
        """The steps of ``root`` a pointer names (the retention policy's answer), pending pointers
        first: one made meanwhile is then seen on disk. Lightning's own ``last`` link names a
        name (seen itself); a file that is no pointer names nothing. A name that cannot be read
        raises, and the retention pass deletes nothing."""
        directory = os.path.dirname(root)
        with self._lock:
            named = {h.step for target, h in self._pending.items() if os.path.dirname(target) == directory}
        for entry in os.scandir(directory):
            if not entry.name.endswith(_TEMPORARY) and not entry.is_symlink():
                pointer = read_pointer(entry.path)  # None once removed meanwhile
                named.update(pointer[:1] if pointer is not None else ())
        return named

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the name ``path``; its step goes once no name is left on it (in the background;
        at once in a folder this plug-in has not opened)."""
        target = _local_path(path)
        with self._lock:
            self._pending.pop(target, None)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # left at this name by an older run: removed whole, as Lightning does
        elif os.path.lexists(target):
            os.unlink(target)  # a pointer, Lightning's "last" link, or a file of an older run
        root = os.path.join(os.path.dirname(target), ROOT_NAME)
        ckpt = self._roots.get(root)
        if ckpt is not None:
            ckpt.retain()
        elif os.path.isdir(root):
            self._collect(root)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint named ``path`` as Lightning's nested dict (tensors on CPU by default), once
        the saves in flight have committed; a file Lightning wrote is read by its ``TorchCheckpointIO``."""
        target = _local_path(path)
        self.wait()
        if not os.path.lexists(target):  # Lightning's own IO's error, which its callers expect
            raise CheckpointNotFound(f"Checkpoint file not found: {os.fspath(path)}")
        if _lightnings_file(target):
            own = TorchCheckpointIO().load_checkpoint
            return own(target, map_location=map_location, weights_only=weights_only)
        location = None if callable(map_location) else map_location  # Lightning's default: on CPU
        return _revived(load(target, map_location=location))

    @property
    def records(self) -> list[SaveRecord]:
        """What each committed save cost (stall, persist time, bytes), in commit order."""
        return [*self._records, *(r for ckpt in self._roots.values() for r in ckpt.records)]

    @property
    def persisting(self) -> bool:
        """Whether a save is being written now (its steps are slowed by the write: the drag)."""
        return any(not written[1].done() for written in list(self._written.values()))

    @property
    def host_bytes(self) -> int:
        """Host memory held for staging now (released by ``teardown``)."""
        return sum(ckpt.host_bytes for ckpt in self._roots.values())

    def wait(self) -> None:
        """Block until every save in flight has committed and its name is made; raise a failure."""
        errors = self._settle()
        if errors:
            raise errors[0]

    def teardown(self) -> None:
        """Wait for every save and pointer, release the directories and memory; raise the first
        background error (a CheckpointError) once everything is closed."""
        errors = self._settle()
        self._written.clear()
        while self._roots:
            ckpt = self._roots.popitem()[1]
            self._records.extend(ckpt.records)
            try:
                ckpt.close()
            except CheckpointError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def _settle(self) -> list[CheckpointError]:
        """Wait for the saves, make the pointers their callbacks have not made yet (the callbacks
        may run after the wait returns); every error so far, taken."""
        errors: list[CheckpointError] = []
        for ckpt in list(self._roots.values()):
            try:
                ckpt.wait()
            except CheckpointError as exc:
                errors.append(exc)
        with self._lock:
            pending = list(self._pending.items())
        for target, handle in pending:
            self._link(target, handle)
        with self._lock:
            errors.extend(self._errors)
            self._errors.clear()
        return errors

    def _collect(self, root: str) -> None:
        """Delete now the steps of ``root`` that no name is left on, in a directory this plug-in
        has not opened: one another process wrote, as rank 0's forked worker does under
        ``ddp_fork`` (the final weights in a temporary ``.temp.ckpt``, which the main process loads
        and removes). Left there, each fit in a notebook kept a copy of the weights."""
        try:
            ckpt = Checkpointer(root, ranks="local", keep=CustomSteps(lambda: self._named(root)))
        except CheckpointError:  # another plug-in holds it: it collects them after its next commit
            return
        with ckpt:
            _settle_names(os.path.dirname(root), set(ckpt.steps()))  # what a killed run left
            ckpt.retain()  # the policy's answer, applied now: no commit comes here
            newest = ckpt.latest_step()
            if newest is not None and newest not in self._named(root):
                # Retention never deletes a run's newest step, and ddp_fork's temporary folder
                # holds that one: no run writes here, so removing its last name deletes it.
                ckpt.delete(newest)

    def _open(self, root: str) -> Checkpointer:
        if root not in self._roots:
            os.makedirs(os.path.dirname(root), exist_ok=True)
            keep = CustomSteps(lambda: self._named(root))
            ckpt = self._roots[root] = Checkpointer(root, config=self._config, ranks="local", keep=keep)
            # Under the directory's lock (taken by the open): no other plug-in names steps here.
            _settle_names(os.path.dirname(root), set(ckpt.steps()))
            ckpt.retain()  # steps of a killed run that no pointer ever named
        return self._roots[root]


def _point(target: str, step: int, *, committed: bool = True) -> None:
    """Make the name ``target`` a pointer file naming ``step`` of the nbckpt directory beside it
    (``committed`` False: a reservation of the name for it): a new file renamed over the old
    name, so that the name is the old pointer or the new, never none or half of one. A pointer is
    durable when this returns; a reservation is not fsynced (on the caller's thread it would add
    to the stall, and a reopened plug-in settles every one a crash left: :func:`_settle_names`)."""
    temporary = target + _TEMPORARY
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # left by a killed run
    if committed:
        write_atomic(target, pointer_bytes(step), temporary=temporary)
        return
    with open(temporary, "wb") as f:
        f.write(pointer_bytes(step, committed=False))
    os.replace(temporary, target)


def _portable(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with Hydra/OmegaConf hyperparameters as plain containers (interpolations
    kept as written) and the class Lightning records beside them as its qualified name, as
    Lightning's own older checkpoints have it."""
    out = dict(checkpoint)
    for key, value in checkpoint.items():
        if key.endswith("hparams_type") and isinstance(value, type):
            out[key] = f"{value.__module__}.{value.__qualname__}"
        elif type(value).__module__.startswith("omegaconf."):
            from omegaconf import OmegaConf  # present: the value is one of its containers

            out[key] = OmegaConf.to_container(value, resolve=False)
    return out


def _revived(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """What :func:`_portable` changed, back: the recorded class of an allow-listed name (with
    omegaconf missing, the name stays, which Lightning reads as a plain dict of hyperparameters)."""
    for key, value in checkpoint.items():
        if key.endswith("hparams_type") and isinstance(value, str) and value in _HPARAMS_TYPES:
            module, name = _HPARAMS_TYPES[value]
            with contextlib.suppress(ImportError):
                checkpoint[key] = getattr(importlib.import_module(module), name)
    return checkpoint


def _settle_names(directory: str, committed: set[int]) -> None:
    """Names an earlier run left in ``directory``, made what this one writes: a reservation a kill
    cut short becomes its pointer if the step committed, else goes; a pointer of an earlier
    release (a symlink into ``.nbckpt``, a JSON file) becomes a pointer file naming the same step,
    which retention then keeps; a pointer being made when a kill came goes."""
    real_root = os.path.realpath(os.path.join(directory, ROOT_NAME))
    for entry in os.scandir(directory):
        if entry.name.endswith(_TEMPORARY):
            os.unlink(entry.path)
            continue
        step, named = _earlier_name(entry.path, real_root)
        if step is not None and (named or step in committed):
            _point(entry.path, step)
        elif step is not None:
            os.unlink(entry.path)


def _earlier_name(path: str, real_root: str) -> tuple[int | None, bool]:
    """The step that the name ``path`` in ``real_root``'s directory holds for an earlier run, and
    whether it names it (an earlier release's pointer) or only reserves it; (None, False) for a
    pointer file of this release, Lightning's own files and links, or anything else."""
    if os.path.islink(path):  # the previous release's pointers: symlinks to their steps
        head, name = os.path.split(os.readlink(path))
        match = STEP_DIR.fullmatch(name)
        return (int(match.group(1)), True) if head == ROOT_NAME and match is not None else (None, False)
    old = earlier_pointer(path)  # the one before: JSON naming a directory and a step
    if old is not None:
        return (old[1], True) if os.path.realpath(old[0]) == real_root else (None, False)
    pointer = read_pointer(path)
    return (pointer[0], False) if pointer is not None and not pointer[1] else (None, False)


def _lightnings_file(path: str) -> bool:
    """Whether the name ``path`` is a file Lightning's own IO wrote: a file nbckpt did not."""
    return os.path.isfile(path) and read_pointer(path) is None and earlier_pointer(path) is None


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
    for plugin in list(_LIVE):  # a name saved a moment ago: its step first commits
        plugin.settle(target)
    if _lightnings_file(target):
        return loader(target, **kwargs)
    buffer = io.BytesIO()
    torch.save(load_checkpoint(target), buffer)
    buffer.seek(0)
    # These bytes were pickled a line above from values nbckpt decoded as JSON: nothing foreign
    # is unpickled, and weights_only would refuse saved hyperparameters such as a Namespace.
    return loader(buffer, weights_only=False, **kwargs)


def load_checkpoint(path: str | os.PathLike[str], map_location: Any | None = None) -> dict[str, Any]:
    """The checkpoint a name the plug-in saved holds, as ``torch.load`` gives a file Lightning
    wrote (tensors on CPU, or ``map_location``), once its save has committed."""
    target = _local_path(path)
    for plugin in list(_LIVE):
        plugin.settle(target)
    return _revived(load(target, map_location=map_location))


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


def _fingerprint(value: Any, tensors: list[torch.Tensor], depth: int) -> Any:
    """What a checkpoint holds, comparable with ``==``: keys and lengths, tensors by storage,
    place and version counter (an in-place update bumps it; each is appended to ``tensors``),
    plain values by value. Anything else never compares equal, so a doubt costs a save, never a
    stale checkpoint."""
    if depth > 64:
        return object()
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        try:
            version, data = version_of(value), value.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # wrapper tensors
            return object()
        if version is None:  # an inference tensor keeps no counter
            return object()
        return (data, value.storage_offset(), value.shape, value.stride(), value.dtype, value.device, version)
    if isinstance(value, _PLAIN) or type(value).__module__ == "pathlib":
        return (type(value), value)
    if isinstance(value, (Mapping, list, tuple)):
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        return (type(value), tuple((k, _fingerprint(v, tensors, depth + 1)) for k, v in items))
    return object()


def _called_by_async_io() -> bool:
    """Whether Lightning's ``AsyncCheckpointIO`` (either package name) made this call: its saving
    thread calls the plug-in from a function that holds the wrapper as ``self``, at any depth, as
    anything between them (a ``Mock(wraps=...)``, a user's logging wrapper) hides it otherwise."""
    return _caller_self(_loaded("AsyncCheckpointIO", "plugins.io"), callers=None) is not None


def _outside_a_run() -> bool:
    """Whether a Trainer made this call (``trainer.save_checkpoint``) while none of its runs
    (fit, validate, test, predict) is going on, so that no teardown will finish the save:
    after ``fit``, or from ``on_exception`` (the teardown that follows it finds nothing left)."""
    trainer = _caller_self(_loaded("Trainer", "trainer.trainer"))
    return trainer is not None and trainer.state.status != TrainerStatus.RUNNING


def _loaded(name: str, module: str) -> tuple[type, ...]:
    """The classes ``name`` of ``lightning.pytorch.<module>`` and ``pytorch_lightning.<module>``
    that are imported: a class never imported made no call, so nothing is imported here."""
    found = (getattr(sys.modules.get(f"{package}.{module}"), name, None) for package in _PACKAGES)
    return tuple(cls for cls in found if isinstance(cls, type))


def _caller_self(kinds: tuple[type, ...], callers: int | None = 3) -> Any:
    """The first ``self`` of one of ``kinds`` among the caller of the plug-in's method that asks
    (through one helper) and its next ``callers - 1`` callers (Lightning: the strategy, then the
    Trainer or the wrapper), or all of them (``None``), else None."""
    frame = inspect.currentframe() if kinds else None
    for _ in range(3):  # past this function, the helper and the plug-in's method
        frame = frame.f_back if frame is not None else None
    for _ in itertools.repeat(None) if callers is None else range(callers):
        if frame is None:
            break
        found = frame.f_locals.get("self")
        if isinstance(found, kinds):
            return found
        frame = frame.f_back
    return None


def _register_with_twin() -> None:
    """Lightning ships under two names (``lightning`` and ``pytorch_lightning``), each with its
    own ``CheckpointIO`` class; register with the other one too when it is loaded, so either
    Trainer accepts the plug-in."""
    for module in ("lightning.fabric.plugins", "lightning_fabric.plugins"):
        loaded = sys.modules.get(module)
        other = getattr(loaded, "CheckpointIO", None) if loaded is not None else None
        if other is not None and other is not CheckpointIO and not issubclass(NbckptCheckpointIO, other):
            other.register(NbckptCheckpointIO)


class ScheduledCheckpoint(ModelCheckpoint):  # type: ignore[misc]
    """``ModelCheckpoint`` that saves when ``schedule`` says a save is due, asked after every
    training batch: its first save at once, then every interval Young/Daly advises for the costs
    the :class:`NbckptCheckpointIO` measured in this run, never faster than its write persists.
    Rank 0 decides and every rank follows. ``options`` are ModelCheckpoint's (``dirpath``,
    ``save_last``, ``save_top_k``, ...), less the triggers it replaces; :attr:`save_interval`
    says why it chose its interval."""

    def __init__(self, schedule: SaveSchedule, **options: Any) -> None:
        triggers = sorted({"every_n_train_steps", "train_time_interval", "every_n_epochs"} & set(options))
        if triggers:
            raise ConfigError(f"ScheduledCheckpoint saves when its schedule says: drop {', '.join(triggers)}")
        if not isinstance(schedule, SaveSchedule):
            raise ConfigError(f"schedule must be a SaveSchedule (of an mtbf or gpus), not {schedule!r}")
        super().__init__(every_n_train_steps=1, **options)  # every batch: the schedule gates it
        self._pacer = Pacer(schedule)

    @property
    def save_interval(self) -> Interval | None:
        """The schedule's last decision: seconds between saves, and one line saying why."""
        return self._pacer.interval

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, NbckptCheckpointIO):
            raise ConfigError(
                "ScheduledCheckpoint measures what saves cost through nbckpt: "
                "pass plugins=[NbckptCheckpointIO()] to the Trainer"
            )
        if self._pacer.due(io.persisting, io.records, lambda: None, _FromRank0(trainer.strategy)):
            self._pacer.saved(time.monotonic())
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class _FromRank0:
    """What the schedule asks of a process group, through a Lightning strategy's broadcast."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self.pg = strategy if strategy.world_size > 1 else None  # None: one process, no collective

    def from_rank0(self, tag: Any, run: Callable[[], _T]) -> _T:
        result = run() if self._strategy.is_global_zero else None
        return cast(_T, self._strategy.broadcast(result, src=0))
