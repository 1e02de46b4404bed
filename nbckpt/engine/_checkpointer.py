"""The one public face of the engine: :class:`Checkpointer`, and what a save gives back.

A save is staged (copied into host images, :mod:`._staging`), then persisted on a background
thread: files written and checksummed (:mod:`._files`), the manifest built
(:mod:`._manifest`), and committed by the store (:mod:`._store`). Restore reads and checks
(:mod:`._reader`) before it touches the caller's state. Every step that involves other
ranks goes through :mod:`._ranks`, so a failure on one rank is a failure on all.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from .. import _faults
from .._errors import CheckpointError, ConfigError, describe_error
from .._timeline import Timeline, now_ns
from . import _rng
from ._config import CheckpointConfig, Mode
from ._files import FileResult, write_image
from ._layout import METADATA_FILE, Layout, plan
from ._manifest import MAX_MANIFEST_BYTES, Manifest, build, parse
from ._ranks import join
from ._reader import check_dcp_metadata, read_metadata, read_tensors, verify_files
from ._staging import Slot, Stager, StagingPool
from ._state import Flattened, apply, check_template, decode, flatten, node_tensors
from ._store import MANIFEST, Store, open_store, step_name
from ._workers import Pool, Worker, run_all

__all__ = ["Checkpointer", "SaveHandle", "SaveRecord", "close_all"]

_log = logging.getLogger("nbckpt")
_OPEN: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
_UNSET: Any = object()


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost. Times in seconds; ``stall_s`` is what the caller was blocked.

    ``cpu_s`` counts the CPU time of nbckpt's own threads for this save (copying, hashing,
    writing); the kernel's share of writing back pages after ``write`` returns is not in it.
    """

    step: int
    path: str
    bytes: int
    stall_s: float
    stage_s: float
    persist_s: float
    wait_s: float
    write_gbs: float
    cpu_s: float

    def to_dict(self) -> dict[str, Any]:
        """The record as plain values (for JSON and DataFrames)."""
        return asdict(self)


class SaveHandle:
    """One save in its two phases: ``staged`` (host copy done) and ``committed`` (durable)."""

    def __init__(self, step: int, nbytes: int, seq: int, *, reported: bool) -> None:
        self.step = step
        self.bytes = nbytes
        self.seq = seq
        self.staged: Future[None] = Future()
        self.committed: Future[SaveRecord] = Future()
        self.phase = "staging"
        self.stall_s = 0.0
        self.stage_s = 0.0
        self.wait_s = 0.0
        self.reported = reported
        self.slot: Slot | None = None
        self._returned = threading.Event()

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self.committed.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state has been copied; required before mutating it with ``overlap=True``."""
        self._result(self.staged, timeout)

    def wait(self, timeout: float | None = None) -> SaveRecord:
        """Block until committed; raises :class:`CheckpointError` if the save failed."""
        record: SaveRecord = self._result(self.committed, timeout)
        return record

    def _result(self, future: Future[Any], timeout: float | None) -> Any:
        try:
            return future.result(timeout)
        except CheckpointError:
            self.reported = True
            raise

    @property
    def error(self) -> BaseException | None:
        """The CheckpointError of a failed save; None while running or after success."""
        return self.committed.exception() if self.committed.done() else None

    def __repr__(self) -> str:
        return f"<SaveHandle step={self.step} {self.phase}>"


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
        self,
        directory: str | os.PathLike[str],
        mode: Mode | None = None,
        keep: int | None = _UNSET,
        *,
        config: CheckpointConfig | None = None,
        **options: Any,
    ) -> None:
        """``mode``, ``keep`` and ``options`` (any :class:`CheckpointConfig` field) override ``config``."""
        if mode is not None:
            options["mode"] = mode
        if keep is not _UNSET:
            options["keep"] = keep
        self.config = CheckpointConfig.build(config, **options)
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise ConfigError(f"directory must be a non-empty path or URL, not {directory!r}")
        self.directory = os.fspath(directory)
        self.store: Store = open_store(self.directory, self.config.storage_options)
        ranks = join(self.config.ranks, self.config.timeout_s)
        self._caller, self._background = ranks.caller, ranks.background
        self.rank, self.world_size = ranks.rank, ranks.world_size
        self.timeline = Timeline(rank=self.rank, label=f"nbckpt-{self.config.mode}")
        self.records: list[SaveRecord] = []
        self._lock = threading.RLock()  # one operation at a time, whichever thread calls
        self._state = threading.Lock()  # the bookkeeping below, shared with the background
        self._inflight: deque[SaveHandle] = deque()
        self._unreported: list[SaveHandle] = []
        self._layouts: dict[Any, Layout] = {}
        self._retention: Future[None] | None = None
        self._closed = False
        self._seq = 0
        self._pool = StagingPool(self.config.max_inflight, pin=torch.cuda.is_available())
        self._nonce, self._committed = self._caller.from_rank0(("open",), self._open_store)
        self._stager = Stager()
        self._persister = Worker("nbckpt-persist")
        self._retainer = Worker("nbckpt-retention")
        self._io = Pool(self.config.writer_threads, "nbckpt-io")
        _OPEN.add(self)
        atexit.register(_close_at_exit, weakref.ref(self))
        # A Checkpointer dropped without close() (a notebook cell run again) frees the directory.
        finalizer = weakref.finalize(
            self, _release, self.store, self._stager, (self._persister, self._retainer), self._io
        )
        finalizer.atexit = False

    # -- set-up -------------------------------------------------------------------------------

    def _open_store(self) -> tuple[str, set[int]]:
        self.store.prepare()
        self.store.lock()
        try:
            recovered = self.store.recover()
            committed = set(self.store.committed())
        except BaseException:
            self.store.unlock()  # a failed open must not hold the directory for the process's life
            raise
        if recovered:
            warnings.warn(
                f"nbckpt: cleaned up {len(recovered)} leftover(s) of interrupted saves in "
                f"{self.store.url}: {', '.join(recovered)}",
                stacklevel=5,
            )
        return uuid.uuid4().hex[:12], committed

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        overlap: bool = False,
        rng: bool | None = None,
        blocking: bool | None = None,
        overwrite: bool = False,
    ) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; in async mode, return once the state is copied.

        ``blocking=True`` makes this one save synchronous (committed before it returns)
        whatever the mode; ``blocking=False`` makes it asynchronous. With ``overlap=True`` it
        returns before the copy is done: call ``handle.wait_staged()`` (or
        ``ckpt.wait_staged()``) before the next optimizer step changes the parameters.
        Saving a step that exists already replaces it, with a warning unless ``overwrite``.
        Errors of earlier background saves are raised here, once, as CheckpointError.
        """
        with self._lock:
            self._check_open()
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ConfigError(f"step must be a non-negative integer, not {step!r}")
            sync = self.config.mode == "sync" if blocking is None else bool(blocking)
            start = now_ns()
            self._raise_pending()
            self._seq += 1
            seq = self._seq
            capture = self.config.capture_rng if rng is None else bool(rng)
            flat, layout = self._plan(state, step, seq)
            if step in self._committed and not overwrite:
                warnings.warn(
                    f"nbckpt: step {step} already exists in {self.store.url} and is replaced; "
                    "pass overwrite=True if that is intended, or save to a new directory",
                    stacklevel=2,
                )
            handle = SaveHandle(step, flat.nbytes, seq, reported=sync)
            self._wait_for_room(handle, sync)
            rng_state = _rng.capture() if capture else None
            stage_done: Future[tuple[float, int]] = Future()
            stage_began = now_ns()
            stage_done.add_done_callback(partial(self._staged, handle, stage_began))
            try:
                slot = self._pool.acquire(handle)
                try:
                    slot.fit(layout.files.get(self.rank, ()), *_dtypes_and_shapes(flat), pin=self._pool.pin)
                except Exception as exc:
                    raise CheckpointError(
                        f"could not allocate {flat.nbytes / 1e9:.2f} GB of staging memory: "
                        f"{describe_error(exc)}"
                    ) from exc
                self._stager.stage(flat.tensors, slot, stage_done, wait=sync or not overlap)
            except BaseException:
                if handle.slot is not None:
                    self._pool.release(handle.slot, handle)
                raise
            with self._state:
                self._inflight.append(handle)
            try:
                self._persister.submit(
                    partial(self._persist, handle, flat, layout, rng_state, stage_done, start, sync)
                )
                handle.stall_s = (now_ns() - start) / 1e9
                self.timeline.record("stall", start, step=step, nbytes=flat.nbytes)
            finally:
                handle._returned.set()
            if sync:
                try:
                    handle.committed.result()
                except KeyboardInterrupt:
                    handle.reported = False  # it goes on in the background: report its outcome later
                    raise
            return handle

    def _plan(self, state: Mapping[str, Any], step: int, seq: int) -> tuple[Flattened, Layout]:
        """Flatten and agree across ranks, then the file layout (cached per structure)."""
        box: list[Flattened] = []

        def local() -> tuple[Any, ...]:
            flat = flatten(state)
            box.append(flat)
            return flat.specs()

        signatures = self._caller.exchange(("save", step, seq), local)
        flat = box[0]
        key = tuple(signatures)
        layout = self._layouts.get(key)
        if layout is None:
            paths = flat.paths
            if self.world_size > 1:
                everyone = self._caller.exchange(("plan", step, seq), lambda: flat.paths)
                paths = {k: v for rank_paths in everyone for k, v in rank_paths.items()}
            try:
                layout = plan(signatures, paths, self.config.writer_threads)
            except CheckpointError as exc:
                raise ConfigError(str(exc)) from None
            if len(self._layouts) >= 4:  # a run alternates between a few structures at most
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return flat, layout

    def _wait_for_room(self, handle: SaveHandle, sync: bool) -> None:
        """Backpressure: wait while ``max_inflight`` saves are in flight (a sync save: for all)."""
        began = now_ns()
        while True:
            with self._state:
                if not self._inflight or (not sync and len(self._inflight) < self.config.max_inflight):
                    break
                oldest = self._inflight[0]
            with contextlib.suppress(CheckpointError):  # raised just below, once
                oldest.committed.result()
            with self._state:  # dequeued only once done: Ctrl-C while waiting keeps it tracked
                if self._inflight and self._inflight[0] is oldest:
                    self._inflight.popleft()
        handle.wait_s = (now_ns() - began) / 1e9
        if handle.wait_s > 1e-4:
            self.timeline.record("wait", began, step=handle.step)
        self._raise_pending()

    def _staged(self, handle: SaveHandle, began: int, done: Future[tuple[float, int]]) -> None:
        """Staging ended (on a stage thread): the state may change from now on."""
        if done.exception() is not None:
            return  # reported by the persist job, which fails the save
        ended = done.result()[1]
        handle.stage_s = (ended - began) / 1e9
        self.timeline.record("stage", began, ended, step=handle.step, nbytes=handle.bytes)
        handle.phase = "staged"
        handle.staged.set_result(None)

    def _persist(
        self,
        handle: SaveHandle,
        flat: Flattened,
        layout: Layout,
        rng_state: dict[str, Any] | None,
        stage_done: Future[tuple[float, int]],
        start: int,
        sync: bool,
    ) -> None:
        """Write, agree, commit; every outcome sets ``handle.committed`` exactly once."""
        step, tag = handle.step, handle.seq
        began = now_ns()
        persist_began = began
        location: str | None = None
        path: str | None = None
        cpu_s = 0.0
        try:
            cpu_s += stage_done.result()[0]
            handle.staged.result()  # set by the stage thread's callback before this returns
            handle.phase = "persisting"
            persist_began = now_ns()
            nonce = f"{self._nonce}{tag:x}"
            location = self._background.from_rank0(
                ("begin", step, tag), lambda: self.store.begin(step, nonce)
            )
            written = self._background.exchange(
                ("write", step, tag),
                lambda: self._write(handle, location or "", layout, flat.tree, rng_state),
            )
            assert handle.slot is not None
            self._pool.release(handle.slot, handle)  # the images are written: the slot is free
            files: dict[str, FileResult] = {}
            for part in written:
                files.update(part[0])
            cpu_s += sum(result.cpu_s for name, result in written[self.rank][0].items())
            for result in written[self.rank][0].values():
                if result.fsync_ns != (0, 0):
                    self.timeline.record("fsync", *result.fsync_ns, step=step, file=result.name)
            persisted = now_ns()
            manifest = build(
                step=step,
                nbytes=sum(part[3] for part in written),
                world_size=self.world_size,
                files=files,
                items={key: (name, item.offset) for key, (name, item) in layout.items().items()},
                tree=flat.tree,
                rank_trees={str(r): part[1] for r, part in enumerate(written) if part[1] != flat.tree},
                rng={str(r): part[2] for r, part in enumerate(written) if part[2] is not None},
                version=_version(),
            )
            target = location
            path = self._background.from_rank0(
                ("commit", step, tag), lambda: self.store.commit(target, step, manifest)
            )
        except BaseException as exc:
            # Once committed, the checkpoint stays whatever fails after; before, it goes.
            if handle.slot is not None:
                self._pool.release(handle.slot, handle)
            if path is None and location is not None and self.rank == 0:
                self.store.discard(location)
            self._fail(handle, exc, began)
            return
        if not sync:
            handle._returned.wait()  # stall_s is final once save() has returned
        persist_s = (now_ns() - persist_began) / 1e9
        record = SaveRecord(
            step=step,
            path=path,
            bytes=handle.bytes,
            stall_s=(now_ns() - start) / 1e9 if sync else handle.stall_s,
            stage_s=handle.stage_s,
            persist_s=persist_s,
            wait_s=handle.wait_s,
            write_gbs=handle.bytes / persist_s / 1e9 if persist_s > 0 else 0.0,
            cpu_s=cpu_s,
        )
        self.timeline.record("persist", persist_began, persisted, step=step, nbytes=handle.bytes)
        self.timeline.record("commit", persisted, step=step)
        with self._state:
            self.records.append(record)
            self._committed.add(step)
        handle.phase = "committed"
        retention: Future[None] | None = None
        if self.config.keep is not None and self.rank == 0:
            retention = Future()
            self._retention = retention  # before the commit is reported: wait() must see it
        handle.committed.set_result(record)
        if retention is not None:  # after the commit is reported: a slow delete delays no save
            self._retainer.submit(partial(self._retain, step, retention))

    def _write(
        self,
        handle: SaveHandle,
        location: str,
        layout: Layout,
        tree: Any,
        rng_state: Any,
    ) -> tuple[dict[str, FileResult], Any, Any, int]:
        """This rank's files, written in parallel (rank 0 adds the DCP metadata)."""
        slot = handle.slot
        assert slot is not None
        fsync = self.store.is_local
        jobs: list[Callable[[], FileResult]] = [
            partial(self._write_image, location, name, image.numpy().data, fsync)
            for name, image in slot.images.items()
        ]
        if self.rank == 0:
            jobs.append(partial(self._write_bytes, location, METADATA_FILE, layout.metadata, fsync))
        # All of them finish, even after a failure: nothing may write into a removed location.
        results = {result.name: result for result in run_all(self._io, jobs)}
        _faults.hit("after_data")
        own = sum(slot.views[key].nbytes for key in slot.views)
        return results, tree, rng_state, own

    def _write_image(self, location: str, name: str, image: memoryview, fsync: bool) -> FileResult:
        return write_image(self.store.sink(location, name), image, fsync=fsync)

    def _write_bytes(self, location: str, name: str, data: bytes, fsync: bool) -> FileResult:
        return write_image(self.store.sink(location, name), memoryview(data), fsync=fsync)

    def _fail(self, handle: SaveHandle, exc: BaseException, began: int) -> None:
        error = CheckpointError(
            f"save of step {handle.step} to {self.store.url} failed: "
            f"{exc if isinstance(exc, CheckpointError) else describe_error(exc)}"
        )
        error.__cause__ = exc
        handle.phase = "failed"
        if not handle.staged.done():
            handle.staged.set_exception(error)
        with self._state:
            self._unreported.append(handle)
        handle.committed.set_exception(error)
        self.timeline.record("error", began, step=handle.step, message=str(error))
        _log.warning("%s", error)

    def _retain(self, newest: int, done: Future[None]) -> None:
        """Delete the oldest checkpoints beyond ``keep``, never ``newest``; failures are logged."""
        try:
            keep = self.config.keep or 0
            steps = sorted(s for s in self.store.committed() if s != newest)
            for step in steps[: max(len(steps) + 1 - keep, 0)]:
                began = now_ns()
                try:
                    self.store.delete(step)
                except Exception as exc:
                    _log.warning(
                        "nbckpt: could not delete old checkpoint %s: %s", step_name(step), describe_error(exc)
                    )
                    continue
                with self._state:
                    self._committed.discard(step)
                self.timeline.record("delete", began, step=step)
        except Exception as exc:
            _log.warning("nbckpt: retention failed: %s", describe_error(exc))
        finally:
            done.set_result(None)

    # -- waiting and errors -------------------------------------------------------------------

    def wait_staged(self) -> None:
        """Block until every save has finished copying the state (see ``save(overlap=True)``)."""
        with self._state:
            pending = list(self._inflight)
        for handle in pending:
            handle.wait_staged()

    def wait(self) -> list[SaveRecord]:
        """Block until every save in flight has committed; raise the first background error."""
        with self._lock:
            records = []
            while True:
                with self._state:
                    if not self._inflight:
                        break
                    oldest = self._inflight[0]
                with contextlib.suppress(CheckpointError):  # raised below, once
                    records.append(oldest.committed.result())
                with self._state:  # only once done: Ctrl-C while waiting keeps it tracked
                    if self._inflight and self._inflight[0] is oldest:
                        self._inflight.popleft()
            if self._retention is not None:
                self._retention.result()
            self._raise_pending()
            return records

    def _raise_pending(self) -> None:
        with self._state:
            failed = [h for h in self._unreported if not h.reported]
            self._unreported.clear()
        if failed:
            failed[0].reported = True
            raise failed[0].committed.exception()  # type: ignore[misc]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.store.url} is closed")

    @property
    def handles(self) -> list[SaveHandle]:
        """Saves not yet waited for (by ``wait``, a later ``save`` or ``close``)."""
        with self._state:
            return list(self._inflight)

    @property
    def host_bytes(self) -> int:
        """Host memory held for staging (``max_inflight`` images of the state at most)."""
        return self._pool.host_bytes

    # -- reading ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (a step counts once its manifest exists)."""
        return list(self.store.committed())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> dict[str, Any]:
        """The checked manifest of a committed step (CheckpointError if it is invalid)."""
        return self._manifest(_check_step(step), self._location(step)).body

    def verify(self, step: int) -> dict[str, Any]:
        """Check a checkpoint completely: manifest, DCP metadata, every block of every file."""
        location = self._location(_check_step(step))
        manifest = self._manifest(step, location)
        check_dcp_metadata(
            read_metadata(self.store, location, manifest), manifest, f"{step_name(step)}/{METADATA_FILE}"
        )
        verify_files(self.store, self._io, location, manifest)
        return manifest.body

    def _location(self, step: int) -> str:
        committed = self.store.committed()
        if step not in committed:
            have = ", ".join(map(str, committed)) or "none"
            raise CheckpointError(
                f"no committed checkpoint for step {step} in {self.store.url} (steps: {have})"
            )
        return committed[step]

    def _manifest(self, step: int, location: str) -> Manifest:
        where = f"{step_name(step)}/{MANIFEST}"
        try:
            data = self.store.read_small(location, MANIFEST, MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise CheckpointError(f"{where} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{where} is unreadable ({describe_error(exc)})") from exc
        except CheckpointError as exc:
            raise CheckpointError(f"{step_name(step)}/{exc}") from None
        return parse(data, step, where)

    def restore(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        verify: bool | None = None,
        rng: bool = True,
    ) -> int:
        """Load a checkpoint into ``state`` in place and return its step.

        Each key of ``state`` is filled from the checkpoint's entry of that name: modules,
        optimizers and objects with ``load_state_dict`` in place, tensors copied into (dtype
        and shape must match), anything else replaced by the saved value; saved entries that
        ``state`` does not name are left out. A key the checkpoint lacks, or a shape or dtype
        that differs, is a ConfigError at once (the caller's mistake, not damage). Without
        ``step``, the newest checkpoint that reads back intact is used: a damaged one is
        skipped with a warning naming the file. Saves in flight are waited for first; if the
        restore fails, ``state`` is unchanged.
        """
        with self._lock:
            self._check_open()
            if not isinstance(state, dict):
                raise ConfigError(f"state must be a dict, not {type(state).__name__}")
            if step is not None:
                _check_step(step)
            self.wait()
            check = self.config.verify if verify is None else bool(verify)
            tried: list[int] = []
            attempt = 0
            while True:
                attempt += 1
                candidate, location = self._caller.from_rank0(
                    ("pick", step, attempt), partial(self._pick, step, tried)
                )
                began = now_ns()
                try:
                    tensors, saved, rng_record = self._read_for(
                        state, candidate, location, check, rng, attempt
                    )
                except CheckpointError as exc:
                    if step is not None:
                        raise
                    tried.append(candidate)
                    warnings.warn(
                        f"nbckpt: skipping {step_name(candidate)}: {exc}; trying an older checkpoint",
                        stacklevel=3,
                    )
                    continue
                self._caller.exchange(
                    ("apply", candidate, attempt), partial(self._apply, state, saved, tensors, candidate)
                )
                if rng_record is not None:
                    _rng.restore(rng_record)
                self.timeline.record(
                    "restore", began, step=candidate, nbytes=sum(t.nbytes for t in tensors.values())
                )
                return candidate

    @staticmethod
    def _apply(
        state: dict[str, Any], saved: dict[str, Any], tensors: dict[str, torch.Tensor], step: int
    ) -> None:
        try:
            apply(state, saved, tensors)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:  # e.g. an optimizer's groups
            raise ConfigError(
                f"cannot restore {step_name(step)} into this state: {describe_error(exc)}"
            ) from exc

    def _pick(self, step: int | None, tried: list[int]) -> tuple[int, str]:
        """Rank 0's choice of checkpoint, which every rank then uses (one listing, one answer)."""
        committed = self.store.committed()
        if step is not None:
            return step, self._location(step)
        left = [s for s in sorted(committed, reverse=True) if s not in tried]
        if not left:
            raise CheckpointError(f"no valid checkpoint in {self.store.url}")
        return left[0], committed[left[0]]

    def _read_for(
        self,
        state: dict[str, Any],
        step: int,
        location: str,
        check: bool,
        rng: bool,
        attempt: int,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any]:
        """This rank's part of a restore, agreed by all: the user's mistakes first, then damage."""
        box: list[Any] = []

        def local() -> str:
            manifest = self._manifest(step, location)
            saved = manifest.tree(self.rank)
            problems = check_template(state, saved, "")
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise ConfigError(f"cannot restore {step_name(step)} into this state: {problems[0]}{more}")
            box.append((manifest, saved))
            return manifest.checksum

        checksums = self._caller.exchange(("check", step, attempt), local)
        if len(set(checksums)) > 1:
            raise CheckpointError(f"{step_name(step)}/{MANIFEST} reads differently on different ranks")
        manifest, saved = box[0]

        def read() -> None:
            wanted = {key for key, _ in saved["items"] if key in state}
            subtree = {"t": "dict", "items": [[k, n] for k, n in saved["items"] if k in wanted]}
            keys = [leaf["key"] for leaf in node_tensors(subtree)]
            if check and self.rank == 0:
                where = f"{step_name(step)}/{METADATA_FILE}"
                check_dcp_metadata(read_metadata(self.store, location, manifest), manifest, where)
            tensors, _ = read_tensors(self.store, self._io, location, manifest, keys, verify=check)
            box.append(tensors)

        self._caller.exchange(("read", step, attempt), read)
        record = manifest.rng(self.rank) if rng else None
        return box[1], saved, record

    def load(
        self, step: int | None = None, *, map_location: str | torch.device | None = None
    ) -> dict[str, Any]:
        """Everything a checkpoint holds, as ``torch.load`` would give it: nested, tensors on CPU
        (or ``map_location``), modules and optimizers as their state dicts. Newest step by default."""
        with self._lock:
            self._check_open()
            self.wait()
            if step is None:
                step = self.latest_step()
                if step is None:
                    raise CheckpointError(f"no checkpoint in {self.store.url}")
            location = self._location(_check_step(step))
            manifest = self._manifest(step, location)
            saved = manifest.tree(self.rank)
            keys = [leaf["key"] for leaf in node_tensors(saved)]
            tensors, _ = read_tensors(
                self.store, self._io, location, manifest, keys, verify=self.config.verify
            )
            if map_location is not None:
                tensors = {k: t.to(map_location) for k, t in tensors.items()}
            value: dict[str, Any] = decode(saved, tensors)
            return value

    def delete(self, step: int) -> None:
        """Delete a committed checkpoint (it stops counting before its files go)."""
        with self._lock:
            self._check_open()
            self.wait()
            self._location(_check_step(step))
            self._caller.from_rank0(("delete", step), lambda: self.store.delete(step))
            with self._state:
                self._committed.discard(step)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight, release the directory lock; raise any background error."""
        with self._lock:
            if self._closed:
                return
            try:
                self.wait()
            finally:
                self._closed = True
                _OPEN.discard(self)
                _release(self.store, self._stager, (self._persister, self._retainer), self._io, wait=True)

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
        return f"Checkpointer({self.store.url!r}, mode={self.config.mode!r}, keep={self.config.keep})"


def _check_step(step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative integer, not {step!r}")
    return step


def _dtypes_and_shapes(flat: Flattened) -> tuple[dict[str, torch.dtype], dict[str, tuple[int, ...]]]:
    return (
        {key: t.dtype for key, t in flat.tensors.items()},
        {key: tuple(t.shape) for key, t in flat.tensors.items()},
    )


def _version() -> str:
    from .. import __version__

    return __version__


def _release(store: Store, stager: Stager, workers: tuple[Worker, ...], io: Pool, wait: bool = False) -> None:
    """Stop the threads and free the directory; ``wait`` for the threads to end (not from a
    finalizer, which may run on one of them)."""
    stager.stop(wait)
    for worker in workers:
        worker.stop(wait)
    io.stop(wait)
    store.unlock()


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
    if ckpt is None or ckpt._closed:
        return
    pending = [h for h in ckpt.handles if not h.done()]
    if pending:
        steps = ", ".join(str(h.step) for h in pending)
        warnings.warn(f"nbckpt: finishing save(s) of step {steps} before exit", stacklevel=1)
    try:
        ckpt.close()
    except CheckpointError as exc:
        warnings.warn(f"nbckpt: {exc}", stacklevel=1)
