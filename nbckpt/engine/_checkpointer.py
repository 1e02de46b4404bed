"""The one public face of the engine: :class:`Checkpointer`. It owns the guards (one operation at
a time, closed or not, argument checks) and the lifetime (the lock, the threads, closing); the
save pipeline (:mod:`._saver`) and the restorer (:mod:`._restorer`) do the work."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from .._errors import CheckpointError, ConfigError
from .._util import check_flag
from . import _shutdown
from ._config import CheckpointConfig, Mode
from ._context import Context
from ._mirror import mirror_target, open_mirror, refuse_a_mirror
from ._open_store import open_store
from ._ranks import join
from ._restorer import Options, device_of
from ._retainer import Retainer
from ._retention import check_metrics
from ._run import Run, claim_run, open_run
from ._saver import Saver
from ._schedule import Grace, Interval, Pacer
from ._shared import open_on_rank0
from ._shutdown import Snapshot, close_all, register, release, unregister, writing_into
from ._store import Store, check_step
from ._timeline import SaveHandle, SaveRecord, Timeline
from ._workers import Pool, refuse_waits, worker_thread

__all__ = ["Checkpointer", "close_all", "writer_of"]

_log = logging.getLogger("nbckpt")


class Checkpointer:
    """Fast, atomic, resumable checkpoints of PyTorch state, in DCP's format.

    >>> ckpt = Checkpointer("data/checkpoints/run1", mode="async", keep=3)
    >>> h = ckpt.save({"model": model, "optim": opt, "step": step}, step=step)
    >>> ckpt.wait(); step = ckpt.restore({"model": model, "optim": opt})

    Safe to share between threads (operations run one at a time). Under ``torchrun`` every
    rank creates the Checkpointer and calls ``save`` and ``restore`` together, each with its
    own tensors (a key on several ranks is taken as replicated and written once); when one
    rank checkpoints alone, pass ``ranks="local"``.

    A save's callbacks (``handle.committed.add_done_callback``) and timeline listeners run on
    nbckpt's own threads: there the reading calls work (``steps``, ``latest_step``, ``has_step``,
    ``lines``, ``manifest``, ``verify``, ``load``, ``records``, ``handles``), while any thread may
    be in ``wait()``; the calls that wait for nbckpt's threads (``save``, ``wait``, ``restore``,
    ``delete``, ``close``, ...) raise a ConfigError there instead of waiting for ever.
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
        mirror_root = mirror_target(self.config, self.store)  # refused before anything is created
        ranks = self._ranks = join(self.config.ranks, self.config.timeout_s)
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.timeline = Timeline(rank=self.rank, label=f"nbckpt-{self.config.mode}")
        self._lock = threading.RLock()  # one operation at a time, whichever thread calls
        self._signals = _shutdown.Deferral(ranks.caller)  # when a signal's final save runs
        self._abandoned = False  # a final save did not end in time: the exit must not wait for it
        self._closed = False
        self._caller = ranks.caller
        self._pacer = Pacer(self.config.schedule) if self.config.schedule is not None else None
        self._grace = Grace()  # the time save_on_signal's final save has
        try:
            if not self.config.read_only:
                _shutdown.wait_released(self.store, self.config.timeout_s)
            # Every rank must see the directory rank 0 claims (_shared says how it is told); read
            # only on rank 0, nothing is claimed nor written there, and each rank says what it lacks.
            opening = partial(open_run, self.store, self.config.read_only)
            claim = None if self.config.read_only else partial(claim_run, self.store, refuse_a_mirror)
            nonce, committed = open_on_rank0(
                ranks.caller,
                ("open",),
                self.store,
                claim,
                opening,
                undo=self.store.unlock,
                what="run directory",
            )
            self._io = Pool(self.config.writer_threads, "nbckpt-io", nice=self.config.writer_nice)
            context = Context(self.timeline, self._io, ranks, self.config.writer_nice)
            self._mirror = open_mirror(mirror_root, self.config, self.store, context, nonce)
            policy, writes = self.config.retention, self.rank == 0 and not self.config.read_only
            self._retainer = Retainer(policy, context) if writes and policy is not None else None
            # Rank 0's saver tells them of each commit: the mirror first (its upload is queued
            # before any pass can ask which steps it still reads), then retention.
            observers = [o for o in (self._mirror, self._retainer) if o is not None] if writes else []
            self._saver = Saver(self.config, self.store, context, nonce, committed, observers)
            self._run = Run(
                self.store,
                self._mirror,
                self._saver,
                context,
                read_only=self.config.read_only,
            )
        except BaseException:
            # The ranks' groups are made, the directory locked, threads run: a failed
            # construction gives all of it back (the groups once the threads are stopped).
            names = ("_saver", "_retainer", "_io", "_mirror", "_ranks")
            release(self.store, True, *[getattr(self, name, None) for name in names])
            raise
        self._made_in = os.getpid()
        register(self, self._at_exit)
        # A Checkpointer dropped without close() (a notebook cell run again) frees the directory
        # once its threads are done (a save in flight holds it alive until then).
        parts = (self._saver, self._retainer, self._io, self._mirror, self._ranks)
        carry = self._saver.after_its_work
        self._dropped = weakref.finalize(
            self, _shutdown.release_later, self.store, carry, *parts, made_in=self._made_in
        )
        self._dropped.atexit = False

    @property
    def restored_from(self) -> str | None:
        """Where the last restore read its checkpoint: the run's directory, or the mirror's URL
        when the local copy was gone or damaged (None before a restore)."""
        return self._run.restored_from

    def set_aside_runs(self) -> list[dict[str, Any]]:
        """The runs set aside inside this one, oldest first: the steps that were newer than a
        step restored when the next save came (``after``), each restorable by opening its
        ``path`` (``Checkpointer(path)``); also ``name``, ``steps`` and ``earlier_release`` (a
        ``branch-N`` an earlier nbckpt started, listed the same way)."""
        with self._operation("set_aside_runs"):
            self._check_open()
            return self._run.set_aside_runs()

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

        ``mode`` and ``capture_rng`` override the config's for this save. With ``overlap=True``
        it returns before the copy is done: ``handle.wait_staged()`` before the next optimizer
        step. ``metrics`` (``{"val_loss": 0.31}``) are kept in the manifest for :class:`BestN`.
        Saving an existing step replaces it, with a warning unless ``overwrite``. Errors of
        earlier background saves are raised here, once, as CheckpointError.
        """
        check_flag(overlap, "overlap")
        check_flag(overwrite, "overwrite")
        given = {"mode": mode, "capture_rng": capture_rng}
        config = CheckpointConfig.build(self.config, **{k: v for k, v in given.items() if v is not None})
        with self._operation("save"):
            self._check_open(writing=True)
            check_step(step)
            self._run.set_aside_if_rewound()
            if (late := self._grace.late(self.records)) is not None:
                warnings.warn(late, stacklevel=3)  # the caller of save, once
            if self._pacer is not None:
                self._pacer.saved(time.monotonic())
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

    def due(self) -> bool:
        """Whether a save is due now by the config's ``schedule`` (a :class:`SaveSchedule`): ask
        once a training step, ``if ckpt.due(): ckpt.save(state, step)``. The interval follows
        this run's measured costs (:attr:`save_interval` says why); every rank gets rank 0's
        answer, from its clock and costs, with no collective at most steps."""
        if self._pacer is None:
            raise ConfigError("due() needs a schedule: Checkpointer(..., schedule=SaveSchedule(mtbf='8h'))")
        with self._operation("due"):
            self._check_open()  # closed, its ranks are gone: it would answer for this rank alone
            persisting = any(not handle.done() for handle in self._saver.handles)
            return self._pacer.due(persisting, self.records, self._last_restore_s, self._caller)

    def _last_restore_s(self) -> float | None:
        restores = [event.duration_s for event in self.timeline.events if event.kind == "restore"]
        return restores[-1] if restores else None

    @property
    def save_interval(self) -> Interval | None:
        """The schedule's last decision: seconds between saves, and one line saying why."""
        return self._pacer.interval if self._pacer is not None else None

    def warmup(self, state: Mapping[str, Any]) -> int:
        """Plan the files and allocate every staging slot for ``state``'s structure now, so the
        first save during training costs what the others do; return the host bytes held."""
        with self._operation("warmup"):
            self._check_open(writing=True)
            self._saver.warmup(state)
            return self.host_bytes

    def wait_staged(self) -> None:
        """Block until every save has finished copying the state (see ``save(overlap=True)``)."""
        refuse_waits("ckpt.wait_staged()")
        self._saver.wait_staged()

    def wait(self) -> list[SaveRecord]:
        """Block until every save in flight has committed (and reached the mirror); raise the
        first background error."""
        with self._operation("wait"):
            records = self._saver.wait()
            self._wait_mirror()
            return records

    def _wait_mirror(self) -> None:  # a failed upload is a warning: the step is committed
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
        """Committed steps of the run, oldest first (a step counts once its manifest exists; steps
        set aside after a rewind are their own run's, :meth:`set_aside_runs`)."""
        return self._run.steps()

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed in the run: a save of it replaces it."""
        return self._saver.holds(check_step(step))

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        return max(self.steps(), default=None)

    def manifest(self, step: int) -> dict[str, Any]:
        """The checked manifest of a committed step (CheckpointError if it is invalid)."""
        check_step(step)
        return self._run.restorer.manifest(step).body

    def verify(self, step: int) -> dict[str, Any]:
        """Check a checkpoint completely: manifest, DCP metadata, every block of every file.
        Whatever is wrong with it is a CheckpointError naming the step."""
        return self._run.restorer.verify(check_step(step))

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

        Each key of ``state`` is filled from the saved entry of that name: modules, optimizers
        and objects with ``load_state_dict`` load in place, tensors are copied into (same dtype
        and shape), a dict is filled in place, any other value is replaced. Saved entries
        ``state`` does not name are left out, unless ``strict``. ``key_map`` renames the keys of
        saved modules (None drops one); without it, torch.compile's ``_orig_mod.`` prefix or
        DDP's ``module.`` is added or removed where that makes a module's keys match.

        A missing key, another shape or dtype is a ConfigError at once. Without ``step``, the
        newest checkpoint that reads back intact is used (a damaged one is skipped with a
        warning). Saves in flight are waited for first; if the restore fails, ``state`` is
        unchanged.
        """
        with self._operation("restore"):
            self._check_open()
            if not isinstance(state, dict):
                raise ConfigError(f"state must be a dict, not {type(state).__name__}")
            if step is not None:
                check_step(step)
            for name, flag in (("verify", verify), ("rng", rng), ("strict", strict)):
                if flag is not None:
                    check_flag(flag, name)
            if key_map is not None and not callable(key_map):
                raise ConfigError(f"key_map must be a function of a key, or None, not {key_map!r}")
            self._saver.wait()
            verify = self.config.verify if verify is None else verify
            return self._run.restore(state, step, Options(verify, rng, strict, key_map))

    @property
    def loaded_step(self) -> int | None:
        """The step the last :meth:`restore` loaded into its state, also when a Ctrl-C ended it
        once the state was loaded (None: that restore loaded nothing, or none ran)."""
        applied = self._run.restorer.applied
        return None if applied is None else applied.step

    def load(
        self, step: int | None = None, *, map_location: str | torch.device | None = None
    ) -> dict[str, Any]:
        """Everything a checkpoint holds, as ``torch.load`` would give it: nested, tensors on CPU
        (or ``map_location``), modules and optimizers as their state dicts. Newest step by default.

        ``map_location="meta"`` reads no tensor data at all: shapes, dtypes and every saved
        value (hyperparameters, step counters) from the manifest alone. From a save's callback
        it reads the steps committed so far (the saves in flight are not waited for)."""
        device = device_of(map_location)
        if worker_thread() is not None:
            # nbckpt's own thread (a save's callback): the saves in flight may need this thread to
            # finish, and a thread in wait() holds the lock until they do; a read needs neither.
            return self._load(step, device)
        with self._operation("load"):
            self._saver.wait()
            return self._load(step, device)

    def _load(self, step: int | None, device: torch.device | None) -> dict[str, Any]:
        self._check_open()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no checkpoint in {self.store.url}")
        return self._run.restorer.load(check_step(step), verify=self.config.verify, map_location=device)

    def delete(self, step: int) -> None:
        """Delete a committed checkpoint of the run (it stops counting before its files go); one
        of a set-aside run is deleted by opening that run."""
        with self._operation("delete"):
            self._check_open(writing=True)
            self._saver.wait()
            store = self.store
            check_step(step)

            def remove() -> None:
                # Looked at by rank 0 as it deletes: another rank looking first could find the
                # step already gone (rank 0 runs its part before the others arrive).
                if store.committed_at(step) is None:
                    raise CheckpointError(
                        self._run.undeletable(step)
                        or f"no committed checkpoint for step {step} in {store.url}"
                    )
                store.delete(step)

            self._run.restorer.group.from_rank0(("delete", step), remove)
            self._saver.deleted(store, step)

    def retain(self) -> None:
        """Apply the ``keep`` policy now, in the background, as after a commit: for a policy whose
        answer changes between commits (:class:`CustomSteps` of a framework's live checkpoints)."""
        with self._operation("retain"):
            self._check_open(writing=True)
            # a pass as after the newest commit (rank 0 has the retainer, when there is a policy)
            if self._retainer is not None and (latest := self._saver.latest()) is not None:
                self._retainer.committed(latest)

    def save_on_signal(
        self,
        snapshot: Snapshot,
        *,
        signals: tuple[signal.Signals | int | str, ...] = (signal.SIGTERM,),
        timeout_s: float = 25.0,
    ) -> Callable[[], None]:
        """On ``signals`` (SIGTERM by default), save ``snapshot()``'s ``(state, step)``
        synchronously, then let the signal do what it did before (by default: end the process).

        The final save gets ``timeout_s`` (inside a typical 30 s grace period); one that cannot
        commit in time never counts, and the previous checkpoint stays. What happened is logged.
        ``snapshot`` may return None: nothing new (the saves in flight are waited for). Install
        from the main thread, where ``snapshot`` runs, between any two bytecodes: a state that
        changes in several statements (the weights, then a step counter) can be caught between
        them unless each step runs inside :meth:`whole_step`. Returns what puts the old handlers
        back.
        """
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("save_on_signal must be called from the main thread (signals reach only it)")
        timeout = _shutdown.check_arguments(snapshot, timeout_s)
        installed = _shutdown.install(self._on_signal, snapshot, _shutdown.check_signals(signals), timeout)
        self._grace = Grace(timeout)
        # the final save of a rank that another rank's signal makes save too
        self._signals.save_here = partial(
            self.final_save, snapshot, timeout_s=timeout, reason="a signal to another rank"
        )

        def uninstall() -> None:
            _shutdown.uninstall(installed)
            self._signals.save_here = None

        return uninstall

    def final_save(self, snapshot: Snapshot, *, timeout_s: float = 25.0, reason: str = "exit") -> str:
        """The final save of :meth:`save_on_signal`, for other ways out (a notebook kernel shutting
        down): ``snapshot()``'s ``(state, step)`` saved synchronously, given up after ``timeout_s``
        (the previous checkpoint stays). Logs and returns one line saying what happened."""
        if not isinstance(reason, str):
            raise ConfigError(f"reason must be text (it is logged), not {reason!r}")
        refuse_waits("ckpt.final_save()")
        timeout = _shutdown.check_arguments(snapshot, timeout_s)
        if (late := Grace(timeout, given_by="final_save").late(self.records)) is not None:
            _log.warning("%s (%s)", late, reason)
        with self._signals.final():
            line, ended = _shutdown.final_save(self._save_now, snapshot, timeout, reason)
        # close() at exit would wait for a save still running (its lock is held): it is left behind.
        self._abandoned = self._abandoned or not ended
        return line

    def _save_now(self, taken: tuple[Mapping[str, Any], int] | None) -> None:
        if taken is not None:
            self.save(taken[0], taken[1], mode="sync", overwrite=True)
        self.wait()  # and retention's deletes, so the exit leaves no half-deleted step behind

    @contextmanager
    def whole_step(self) -> Iterator[None]:
        """Around a training step and its counter (``step += 1`` inside): a final save that a
        signal asks for (:meth:`save_on_signal`) inside it waits until it ends, so that it holds
        a whole step, never weights already updated beside the count of the step before. Keep a
        step well inside the grace period the final save has to fit in. With several ranks the
        ranks save at the end of the same step: every step's end is then a small collective."""
        with self._signals.block(self._is_closed, step=True):
            yield

    def _on_signal(
        self, snapshot: Snapshot, timeout_s: float, signum: int, again: Callable[[], None]
    ) -> bool:
        """The final save a signal asks for; False when it must wait (:class:`_shutdown.Deferral`):
        ``again`` then runs when it can."""
        if self._signals.defers(again):
            return False
        if not self._closed and self._signals.saves:
            self.final_save(snapshot, timeout_s=timeout_s, reason=signal.Signals(signum).name)
        return True

    def _is_closed(self) -> bool:
        return self._closed

    # -- lifetime -----------------------------------------------------------------------------

    @contextmanager
    def _operation(self, call: str) -> Iterator[None]:
        """One public operation at a time; a final save asked for by a signal that arrived
        inside one runs as soon as it ends (re-entering it from the handler could corrupt it).
        Refused on nbckpt's own threads (a save's callback): each one waits for them, or for the
        lock, which a thread in ``wait()`` holds until they are done."""
        refuse_waits(f"ckpt.{call}()")
        with self._signals.block(self._is_closed, self._lock):
            yield

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
        with self._operation("close"):
            if self._closed:
                return
            try:
                try:
                    self._saver.wait()
                finally:
                    self._closed = True
                    unregister(self)
                    self._dropped.detach()  # released here: its persist thread takes no more work
                    self._leave()
                self._wait_mirror()
            finally:
                release(self.store, True, self._retainer, self._io, self._mirror)

    def _leave(self) -> None:
        """close()'s end of the saver, whose threads alone use the ranks' groups: they end, then
        the groups are given back where every rank closes it too (a stop that failed may leave a
        thread on them: let go only). Before rank 0's uploads to the mirror are waited for: after
        them, an upload outlasting the close's check-in deadline kept the groups on every rank, and
        rank 0's close waited out the deadline as well."""
        try:
            self._saver.stop(True)
        except BaseException:
            self._ranks.stop(True)
            raise
        self._ranks.leave()

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

    def _at_exit(self) -> None:
        """At the process's exit: finish the saves in flight and close (unless a final save
        hangs, which closing would wait for). Not in a child of ``os.fork`` exiting with its copy:
        the threads, the saves in flight and the ranks' connections are the parent's (the child's
        close waited for ever for a save in flight at the fork, and checked in to the ranks' close
        on the parent's store connection)."""
        if self._closed or self._abandoned or os.getpid() != self._made_in:
            return
        try:
            pending = [h for h in self.handles if not h.done()]
            if pending:
                steps = ", ".join(str(h.step) for h in pending)
                warnings.warn(f"nbckpt: finishing save(s) of step {steps} before exit", stacklevel=1)
            self.close()
        except CheckpointError as exc:
            warnings.warn(f"nbckpt: {exc}", stacklevel=1)
        except KeyboardInterrupt:  # a Ctrl-C as the exit waits (twice: the close waits for threads)
            _shutdown.ended_by(signal.SIGINT)  # how the process ends, once the exit's work is done
            raise

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r}, mode={self.config.mode!r}, keep={self.config.keep!r})"


def writer_of(directory: str | os.PathLike[str]) -> Checkpointer | None:
    """The open Checkpointer of this process that writes into ``directory`` (on a local
    directory: the one holding its lock), or None."""
    found = writing_into(directory)
    return found if isinstance(found, Checkpointer) else None
