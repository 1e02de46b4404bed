"""The one public face of the engine: :class:`Checkpointer`.

It owns the guards (one operation at a time, closed or not, argument checks) and the
lifetime (the directory lock, the threads, closing at exit or when dropped); the work is
done by the save pipeline (:mod:`._saver`) and the restorer (:mod:`._restorer`).

Longer than 400 lines because it is the whole public surface of the engine: every public
method is a short guard around a call into a component, with the docstring users read.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from .._errors import CheckpointError, ConfigError, NbckptError, describe_error
from .._util import is_url
from . import _final
from ._config import CheckpointConfig, Mode
from ._final import Snapshot
from ._handles import SaveHandle, SaveRecord
from ._lines import MAIN, Line, ancestry, discover, last_committed, lineage, on, start_branch, write_record
from ._mirror import Mirror, mirror_of
from ._ranks import Group, join
from ._reader import Readable
from ._restorer import Restorer
from ._retention import check_metrics
from ._saver import Saver
from ._store import Store, check_step, open_store, step_name
from ._timeline import Timeline
from ._workers import Pool

__all__ = ["Checkpointer", "close_all", "writer_of"]

_log = logging.getLogger("nbckpt")
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()


class Checkpointer:
    """Fast, atomic, resumable checkpoints of PyTorch state, in DCP's format.

    >>> ckpt = Checkpointer("data/checkpoints/run1", mode="async", keep=3)
    >>> h = ckpt.save({"model": model, "optim": opt, "step": step}, step=step)
    >>> ckpt.wait(); step = ckpt.restore({"model": model, "optim": opt})

    Safe to share between threads (operations run one at a time). Under ``torchrun`` every
    rank creates the Checkpointer and calls ``save`` and ``restore`` together, each with its
    own tensors (a key on several ranks is taken as replicated and written once); when one
    rank checkpoints alone, pass ``ranks="local"``.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, config: CheckpointConfig | None = None, **options: Any
    ) -> None:
        """``options`` are :class:`CheckpointConfig` fields (``mode="sync"``, ``keep=3``, ...);
        given with ``config``, they replace its fields."""
        self.config = CheckpointConfig.build(config, **options)
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise ConfigError(f"directory must be a non-empty path or URL, not {directory!r}")
        self.directory = os.fspath(directory)
        self.store: Store = open_store(self.directory, self.config.storage_options)
        mirror_root = self._mirror_target()  # a bad mirror is refused before anything is created
        ranks = join(self.config.ranks, self.config.timeout_s)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.timeline = Timeline(rank=self.rank, label=f"nbckpt-{self.config.mode}")
        self._lock = threading.RLock()  # one operation at a time, whichever thread calls
        self._main_depth = 0  # operations the main thread is inside (a signal may interrupt them)
        self._deferred: Callable[[], None] | None = None  # a final save waiting for one to end
        self._abandoned = False  # a final save did not end in time: the exit must not wait for it
        self._closed = False
        nonce, committed = ranks.caller.from_rank0(("open",), self._open_store)
        try:
            self._io = Pool(self.config.writer_threads, "nbckpt-io", nice=self.config.writer_nice)
            self._mirror = self._open_mirror(mirror_root, ranks.caller, nonce)
            uploads = self._mirror if self._mirror is not None and not self.config.read_only else None
            self._saver = Saver(self.config, self.store, ranks, self.timeline, self._io, nonce, committed,
                                uploads)
            self._ranks = ranks
            self.line_name = MAIN
            self._from_mirror: set[str] = set()  # lines only the mirror still holds (a lost disk)
            self._lines = self._discover()
            self._fork: tuple[str, int] | None = None  # (line, step) restored while newer steps exist
            self.restored_from: str | None = None
            """Where the last restore read its checkpoint: the run's directory, a parent line's, or
            the mirror's URL when the local copy was gone or damaged (None before a restore)."""
            line = self.config.line or ranks.caller.from_rank0(("line",), self._default_line)
            self._restorer = self._switch(line, stacklevel=4)
            if self._mirror is not None and self.rank == 0 and not self.config.read_only:
                self._mirror.resume(self._lines)  # what a crash kept from the mirror goes up now
        except BaseException:
            # The directory is locked and threads run: a failed construction gives all of it back.
            _release(self.store, getattr(self, "_saver", None), getattr(self, "_io", None), True,
                     getattr(self, "_mirror", None))
            raise
        _OPEN.add(self)
        # Unregistered by close() and when dropped: a notebook that opens many readers keeps no
        # dead entries in atexit's list.
        self._at_exit = partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        # A Checkpointer dropped without close() (a notebook cell run again) frees the directory.
        weakref.finalize(
            self, _release, self.store, self._saver, self._io, False, self._mirror
        ).atexit = False
        weakref.finalize(self, atexit.unregister, self._at_exit).atexit = False

    def _discover(self) -> dict[str, Line]:
        """The run's lines; with a mirror, also those only the mirror still holds (after the
        local disk was lost), so that a restore from the mirror goes on in the right line."""
        lines = discover(self.store)
        if self._mirror is not None:
            for name, line in self._mirror.lines().items():
                store = None if name in lines else self.store.child(name)
                if store is not None:
                    lines[name] = Line(name, store, line.parent, line.from_step)
                    self._from_mirror.add(name)
        return lines

    def _default_line(self) -> str:
        """The line committed to last: in the run's directory, else (a lost disk) on the mirror."""
        found = last_committed(self._lines)
        if found is None and self._mirror is not None:
            found = last_committed(on(self._lines, self._mirror.root))
        return found or MAIN

    def _switch(self, name: str, stacklevel: int = 5) -> Restorer:
        """Make line ``name`` the one saves go to and restores read from (its ancestors too)."""
        chain = ancestry(self._lines, name)
        names = lineage(self._lines, name)
        line = self._lines[name]
        if name != self.line_name:
            if not self.config.read_only and self.rank == 0:
                for missing in [n for n in names if n in self._from_mirror]:
                    write_record(self._lines[missing])  # the mirror's record, back in the run
                    self._from_mirror.discard(missing)
                recovered = line.store.recover()  # a branch's leftovers, as the main line's at open
                if recovered:
                    _said_cleaned(line.store.url, recovered, stacklevel)
            self._saver.follow(line.store)
        self.line_name = name
        stores: list[Readable] = list(chain)
        if self._mirror is not None:
            self._mirror.follow(name, [self._lines[n] for n in names])
            mirrored = on(self._lines, self._mirror.root)
            if name in mirrored:
                stores.extend(ancestry(mirrored, name))
                names = names + lineage(mirrored, name)
        self._chain = names  # the line each of ``stores`` belongs to
        return Restorer(stores, self._io, self._ranks.caller, self.timeline)

    def _branch_if_rewound(self) -> None:
        """Before the first save after restoring an older step: go on in a new line."""
        if self._fork is None:
            return
        parent, step = self._fork
        self._fork = None

        def start() -> str:
            return start_branch(self.store, self._lines, parent, step).name

        name = self._ranks.caller.from_rank0(("branch", step), start)
        self._lines = self._discover()
        self._restorer = self._switch(name)
        warnings.warn(
            f"nbckpt: step {step} was restored while newer steps exist; saves now go to a new line, "
            f"{name} ({self.store.url}/{name}), and the newer steps stay where they are",
            stacklevel=4,  # the caller of Checkpointer.save
        )

    def lines(self) -> dict[str, dict[str, Any]]:
        """The run's lines: each one's parent, the step it went on from, and its own steps."""
        return {
            name: {
                "parent": line.parent,
                "from_step": line.from_step,
                "steps": list(line.store.committed()),
                "current": name == self.line_name,
            }
            for name, line in discover(self.store).items()
        }

    def _mirror_target(self) -> Store | None:
        """The mirror's store, checked before anything is created: not a file, and neither the
        run's directory nor inside it nor holding it (retention and clean-up in one would delete
        the other's steps)."""
        if self.config.mirror is None:
            return None
        store = open_store(self.config.mirror, self.config.mirror_options, "mirror")
        run, mirror = self.store.url.rstrip("/"), store.url.rstrip("/")
        if store.is_local:
            if os.path.exists(mirror) and not os.path.isdir(mirror):
                raise ConfigError(f"mirror {mirror} is a file, not a directory")
            if self.store.is_local:
                run, mirror = os.path.realpath(run), os.path.realpath(mirror)
        if is_url(run) == is_url(mirror) and (
            run == mirror or mirror.startswith(run + "/") or run.startswith(mirror + "/")
        ):
            how = "is" if run == mirror else "is inside" if mirror.startswith(run + "/") else "holds"
            raise ConfigError(
                f"mirror {store.url} {how} the run's directory {self.store.url}; a mirror needs a "
                "place of its own (each one's retention and clean-up would delete the other's steps)"
            )
        return store

    def _open_mirror(self, store: Store | None, group: Group, nonce: str) -> Mirror | None:
        if store is None:
            return None
        writes = self.rank == 0 and not self.config.read_only
        mirror = Mirror(store, policy=self.config.retention, timeline=self.timeline, nonce=nonce,
                        writes=writes, nice=self.config.writer_nice)
        # The run a mirror belongs to: its directory as the file system knows it (a symlink or a
        # relative path to the same run is the same run), or its URL.
        run = os.path.realpath(self.store.url) if self.store.is_local else self.store.url
        try:
            if self.config.read_only:
                mirror.check(run)
            else:

                def prepare() -> None:
                    store.prepare()
                    mirror.claim(run)
                    for line in mirror.lines().values():
                        line.store.recover()  # uploads cut short never count; their remains go

                group.from_rank0(("open mirror",), prepare)
        except BaseException:
            mirror.stop(True)
            raise
        return mirror

    def _open_store(self) -> tuple[str, set[int]]:
        if self.config.read_only:
            return "", set(self.store.committed())
        self.store.prepare()
        owner = mirror_of(self.store)  # after prepare: it says best why a target is unusable
        if owner is not None:
            raise ConfigError(
                f"{self.store.url} is the mirror of the run {owner}; open it with read_only=True to "
                "read it, or name it as mirror= of that run"
            )
        self.store.lock()
        try:
            recovered = self.store.recover()
            committed = set(self.store.committed())
        except BaseException:
            self.store.unlock()  # a failed open must not hold the directory for the process's life
            raise
        if recovered:
            _said_cleaned(self.store.url, recovered, stacklevel=6)
        return uuid.uuid4().hex[:12], committed

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        overlap: bool = False,
        mode: Mode | None = None,
        capture_rng: bool | None = None,
        metrics: Mapping[str, float] | None = None,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; in async mode, return once the state is copied.

        ``mode`` and ``capture_rng`` override the config's for this save (``mode="sync"``: committed
        before it returns). With ``overlap=True`` it returns before the copy is done: call
        ``handle.wait_staged()`` (or ``ckpt.wait_staged()``) before the next optimizer step
        changes the parameters. ``metrics`` (name to number, such as ``{"val_loss": 0.31}``) are
        kept in the step's manifest for retention by :class:`BestN`. Saving a step that exists
        already replaces it, with a warning unless ``overwrite``. Errors of earlier background
        saves are raised here, once, as CheckpointError.
        """
        config = CheckpointConfig.build(self.config, **_given(mode=mode, capture_rng=capture_rng))
        with self._operation():
            self._check_open(writing=True)
            check_step(step)
            self._branch_if_rewound()
            return self._saver.start(
                state,
                step,
                sync=config.mode == "sync",
                overlap=overlap,
                capture_rng=config.capture_rng,
                metrics=check_metrics(metrics),
                overwrite=overwrite,
                owner=self,
            )

    def warmup(self, state: Mapping[str, Any]) -> int:
        """Plan the files and allocate every staging slot for ``state``'s structure now, so the
        first save during training costs what the others do; return the host bytes held."""
        with self._operation():
            self._check_open(writing=True)
            self._saver.warmup(state)
            return self.host_bytes

    def wait_staged(self) -> None:
        """Block until every save has finished copying the state (see ``save(overlap=True)``)."""
        self._saver.wait_staged()

    def wait(self) -> list[SaveRecord]:
        """Block until every save in flight has committed (and reached the mirror, if there is one);
        raise the first background error. A failed upload is a warning: the step is committed."""
        with self._operation():
            records = self._saver.wait()
            self._wait_mirror()
            return records

    def _wait_mirror(self) -> None:
        if self._mirror is not None:
            for failure in self._mirror.wait():
                warnings.warn(f"nbckpt: {failure}", stacklevel=4)  # the caller of wait/close

    @property
    def records(self) -> list[SaveRecord]:
        """What each committed save cost, in commit order."""
        return self._saver.records

    @property
    def handles(self) -> list[SaveHandle]:
        """Saves not yet waited for (by ``wait``, a later ``save`` or ``close``)."""
        return self._saver.handles

    @property
    def host_bytes(self) -> int:
        """Host memory held for staging (``max_inflight`` images of the state at most)."""
        return self._saver.pool.host_bytes

    @property
    def staging_pinned(self) -> bool:
        """Whether that memory is pinned (page-locked: with CUDA, unless ``ulimit -l`` is too low)."""
        return self._saver.pool.pin

    # -- reading ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps of the current line, its ancestors' up to where it went on from them
        included, oldest first (a step counts once its manifest exists)."""
        found: set[int] = set()
        for readable in ancestry(self._lines, self.line_name):
            found.update(readable.committed())
            found.update(readable.foreign())  # plain DCP checkpoints (torchtitan's): read only
        return sorted(found)

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed in the line saves go to: a save of it replaces it."""
        return check_step(step) in self._saver.committed

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> dict[str, Any]:
        """The checked manifest of a committed step (CheckpointError if it is invalid)."""
        check_step(step)
        return self._restorer.manifest(step).body

    def verify(self, step: int) -> dict[str, Any]:
        """Check a checkpoint completely: manifest, DCP metadata, every block of every file.
        Whatever is wrong with it is a CheckpointError naming the step."""
        step = check_step(step)
        try:
            return self._restorer.verify(step)
        except NbckptError:
            raise
        except Exception as exc:  # a hostile file the checks did not foresee: still a bad step
            raise CheckpointError(f"{step_name(step)} is malformed: {describe_error(exc)}") from exc

    def restore(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        verify: bool | None = None,
        rng: bool = True,
        strict: bool = False,
        key_map: Callable[[str], str | None] | None = None,
    ) -> int:
        """Load a checkpoint into ``state`` in place and return its step.

        The template rules: each key of ``state`` is filled from the checkpoint's entry of that
        name. Modules, optimizers and objects with ``load_state_dict`` load in place (a module's
        keys and shapes must match, as ``load_state_dict`` demands); tensors are copied into
        (dtype and shape must match); a dict is filled in place with every saved entry; any
        other value is replaced by the saved one. Saved entries that ``state`` does not name are
        left out, unless ``strict``, which refuses to leave any out. ``key_map`` renames the
        keys of saved modules (return None to drop one); without it, torch.compile's
        ``_orig_mod.`` prefix is added or removed where that makes a module's keys match.

        A key the checkpoint lacks, or a shape or dtype that differs, is a ConfigError at once
        (the caller's mistake, not damage). Without ``step``, the newest checkpoint that reads
        back intact is used: a damaged one is skipped with a warning naming the file. Saves in
        flight are waited for first; if the restore fails, ``state`` is unchanged.
        """
        with self._operation():
            self._check_open()
            if not isinstance(state, dict):
                raise ConfigError(f"state must be a dict, not {type(state).__name__}")
            if step is not None:
                check_step(step)
            self._saver.wait()
            try:
                restored = self._restorer.restore(
                    state,
                    step,
                    verify=self.config.verify if verify is None else bool(verify),
                    rng=rng,
                    strict=strict,
                    key_map=key_map,
                )
            except KeyboardInterrupt:
                # A Ctrl-C held back until the state was loaded in full: a save after it must
                # still branch off as after any restore of an older step.
                if self._restorer.applied is not None:
                    self._restored(self._restorer.applied)
                raise
            self._restored(restored)
            return restored

    @property
    def loaded_step(self) -> int | None:
        """The step the last :meth:`restore` loaded into its state, also when a Ctrl-C ended it
        once the state was loaded (None: that restore loaded nothing, or none ran)."""
        return self._restorer.applied

    def _restored(self, restored: int) -> None:
        # Newer steps anywhere the line reads from (the mirror too: after a lost disk it may
        # hold the only copies): a save after this restore must not meet them.
        newer = [s for store in self._restorer.stores for s in store.committed() if s > restored]
        source = self._restorer.last_source
        self.restored_from = self._restorer.stores[source].url
        line = self._chain[source] if source < len(self._chain) else self.line_name
        self._fork = (line, restored) if newer and not self.config.read_only else None

    def load(
        self, step: int | None = None, *, map_location: str | torch.device | None = None
    ) -> dict[str, Any]:
        """Everything a checkpoint holds, as ``torch.load`` would give it: nested, tensors on CPU
        (or ``map_location``), modules and optimizers as their state dicts. Newest step by default.

        ``map_location="meta"`` reads no tensor data at all: shapes, dtypes and every saved
        value (hyperparameters, step counters) from the manifest alone."""
        device = _device(map_location)
        with self._operation():
            self._check_open()
            self._saver.wait()
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise CheckpointError(f"no checkpoint in {self.store.url}")
            return self._restorer.load(check_step(step), verify=self.config.verify, map_location=device)

    def delete(self, step: int, *, line: str | None = None) -> None:
        """Delete a committed checkpoint (it stops counting before its files go), of the line saves
        go to or of the run's line ``line``."""
        with self._operation():
            self._check_open(writing=True)
            self._saver.wait()
            name = self.line_name if line is None else line
            if name not in self._lines:  # a line started since this one opened (by another run)
                self._lines = self._discover()
            if name not in self._lines:
                raise CheckpointError(f"{self.store.url} has no line {name!r}")
            store = self._saver.store if name == self.line_name else self._lines[name].store
            if store.committed_at(check_step(step)) is None:
                if step in store.foreign():
                    raise CheckpointError(
                        f"step {step} in {self.store.url} was written by plain DCP; nbckpt never deletes it"
                    )
                raise CheckpointError(
                    f"no committed checkpoint for step {step} in line {name} of {self.store.url}"
                )
            self._restorer.group.from_rank0(("delete", step), lambda: store.delete(step))
            if name == self.line_name:
                self._saver.committed.discard(step)

    def retain(self) -> None:
        """Apply the ``keep`` policy now, in the background, as after a commit: for a policy whose
        answer changes between commits (:class:`CustomSteps` of a framework's live checkpoints)."""
        with self._operation():
            self._check_open(writing=True)
            self._saver.retain()

    def save_on_signal(
        self,
        snapshot: Snapshot,
        *,
        signals: tuple[signal.Signals | int | str, ...] = (signal.SIGTERM,),
        timeout_s: float = 25.0,
    ) -> Callable[[], None]:
        """On ``signals`` (preemption: SIGTERM by default), save ``snapshot()``'s ``(state, step)``
        synchronously, then let the signal do what it did before (by default: end the process).

        The final save gets ``timeout_s`` (inside a typical 30 s grace period). If it cannot
        commit in time (the storage is slow, or the signal came in the middle of another
        Checkpointer call), the process goes on to exit and the previous checkpoint stays:
        a save that did not commit never counts. What happened is logged either way.
        ``snapshot`` may return None: nothing new to save (the saves in flight are waited for).
        Install from the main thread; ``snapshot`` runs there, when the signal arrives. Returns
        a function that puts the previous handlers back.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("save_on_signal must be called from the main thread (signals reach only it)")
        timeout = _final.check_arguments(snapshot, timeout_s)
        installed = _final.install(self._on_signal, snapshot, _final.check_signals(signals), timeout)
        return partial(_final.uninstall, installed)

    def final_save(self, snapshot: Snapshot, *, timeout_s: float = 25.0, reason: str = "exit") -> str:
        """The final save of :meth:`save_on_signal`, for other ways out (a notebook kernel shutting
        down): ``snapshot()``'s ``(state, step)`` saved synchronously, given up after ``timeout_s``
        (the previous checkpoint stays). Logs and returns one line saying what happened."""
        line, ended = _final.final_save(self._save_now, snapshot, _final.check_arguments(snapshot, timeout_s),
                                        reason)
        # close() at exit would wait for a save still running (its lock is held): it is left behind.
        self._abandoned = self._abandoned or not ended
        return line

    def _save_now(self, taken: tuple[Mapping[str, Any], int] | None) -> None:
        if taken is not None:
            self.save(taken[0], taken[1], mode="sync", overwrite=True)
        self.wait()  # and retention's deletes, so the exit leaves no half-deleted step behind

    def _on_signal(
        self, snapshot: Snapshot, timeout_s: float, signum: int, again: Callable[[], None]
    ) -> bool:
        """The final save a signal asks for; False when the signal came inside one of this
        Checkpointer's calls: ``again`` then runs as soon as that call returns."""
        if self._main_depth:
            self._deferred = again
            return False
        if not self._closed:
            self.final_save(snapshot, timeout_s=timeout_s, reason=signal.Signals(signum).name)
        return True

    # -- lifetime -----------------------------------------------------------------------------

    @contextmanager
    def _operation(self) -> Iterator[None]:
        """One public operation at a time; a final save asked for by a signal that arrived
        inside one runs as soon as it ends (re-entering it from the handler could corrupt it)."""
        main = threading.current_thread() is threading.main_thread()
        with self._lock:
            self._main_depth += main
            try:
                yield
            finally:
                self._main_depth -= main
        if main and self._main_depth == 0 and self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            deferred()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` (or :func:`close_all`) has released it: it does nothing more."""
        return self._closed

    def _check_open(self, *, writing: bool = False) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.store.url} is closed")
        if writing and self.config.read_only:
            raise CheckpointError(f"the Checkpointer for {self.store.url} was opened read-only")

    def close(self) -> None:
        """Wait for saves in flight, release the directory lock; raise any background error."""
        with self._operation():
            if self._closed:
                return
            try:
                self._saver.wait()
                self._wait_mirror()
            finally:
                self._closed = True
                _OPEN.discard(self)
                atexit.unregister(self._at_exit)
                _release(self.store, self._saver, self._io, True, self._mirror)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        # The caller's own exception stays the one raised; a background error rides along.
        try:
            self.close()
        except CheckpointError as background:
            if hasattr(exc, "add_note"):
                exc.add_note(f"nbckpt: while closing, {background}")
            _log.warning("nbckpt: while handling %s: %s", type(exc).__name__, background)

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r}, mode={self.config.mode!r}, keep={self.config.keep!r})"


def _given(**overrides: Any) -> dict[str, Any]:
    """The per-call overrides that were given (None: the config's value)."""
    return {name: value for name, value in overrides.items() if value is not None}


def _device(map_location: Any) -> torch.device | None:
    """``map_location`` as a device this process has; ConfigError in one line if it is none."""
    if map_location is None:
        return None
    if not isinstance(map_location, (str, torch.device)):
        raise ConfigError(
            "map_location must be a device such as 'cpu', 'cuda:0' or 'meta', "
            f"not {type(map_location).__name__}"
        )
    try:
        device = torch.device(map_location)
        torch.empty(0, device=device)  # the device exists here (a CPU-only torch has no 'cuda')
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:
        reason = describe_error(exc)
        raise ConfigError(f"map_location {map_location!r} is not a device here: {reason}") from None
    return device


def _said_cleaned(url: str, recovered: list[str], stacklevel: int) -> None:
    warnings.warn(
        f"nbckpt: cleaned up {len(recovered)} leftover(s) of interrupted saves in {url}: "
        f"{', '.join(recovered)}",
        stacklevel=stacklevel,
    )


def _release(
    store: Store, saver: Saver | None, io: Pool | None, wait: bool, mirror: Mirror | None = None
) -> None:
    """Stop the threads and free the directory; ``wait`` for the threads to end (not from a
    finalizer, which may run on one of them). Any of them may be missing (a failed construction)."""
    if saver is not None:
        saver.stop(wait)
    if io is not None:
        io.stop(wait)
    if mirror is not None:
        mirror.stop(wait)
    store.unlock()


def writer_of(directory: str | os.PathLike[str]) -> Checkpointer | None:
    """The open Checkpointer of this process that writes into ``directory`` (on a local
    directory: the one holding its lock), or None."""
    wanted = open_store(os.fspath(directory)).url
    if not is_url(wanted):
        wanted = os.path.realpath(wanted)  # a symlink or a relative path to the run is the run
    for ckpt in list(_OPEN):
        url = ckpt.store.url if is_url(ckpt.store.url) else os.path.realpath(ckpt.store.url)
        if url == wanted and not ckpt._closed and not ckpt.config.read_only:
            return ckpt
    return None


def close_all() -> list[str]:
    """Close every Checkpointer of this process (a notebook's lost handles); return their directories.

    Background errors are logged, not raised: this is the way out of a stuck session.
    """
    closed = []
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except CheckpointError as exc:
            _log.warning("nbckpt: %s", exc)
        closed.append(ckpt.store.url)
    return closed


def _close_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is None or ckpt._closed or ckpt._abandoned:  # closing would wait for the hung save
        return
    pending = [h for h in ckpt.handles if not h.done()]
    if pending:
        steps = ", ".join(str(h.step) for h in pending)
        warnings.warn(f"nbckpt: finishing save(s) of step {steps} before exit", stacklevel=1)
    try:
        ckpt.close()
    except CheckpointError as exc:
        warnings.warn(f"nbckpt: {exc}", stacklevel=1)
