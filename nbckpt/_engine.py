"""The checkpoint engine: stage into reused host buffers, persist in the background, commit atomically."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import json
import os
import queue
import threading
import time
import uuid
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from . import _faults
from ._dcp import METADATA_FILE, new_hasher
from ._errors import CheckpointError, ConfigError, describe_error
from ._state import RNG_KEY, Flattened, apply, decode, flatten, set_rng_state, tensor_specs
from ._store import MANIFEST, Store, open_store, step_name
from ._timeline import Timeline, now_ns

FORMAT = "nbckpt/1"
# DCP warns on every single-process save/load; that is nbckpt's normal case, not news.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def _quiet_dcp_logger() -> None:
    """DCP logs a DEBUG record per call into a NullHandler: measurable time on the save path.

    Raised to INFO only while nobody attached a real handler, so DCP's own phase timings
    stay available to users who ask for them.
    """
    import logging

    from torch.distributed.checkpoint.logger import _dcp_logger

    if all(isinstance(h, logging.NullHandler) for h in _dcp_logger.handlers):
        _dcp_logger.setLevel(logging.INFO)


_quiet_dcp_logger()
_VERIFY_CHUNK = 8 << 20


class _Unset(enum.Enum):
    UNSET = enum.auto()


_UNSET = _Unset.UNSET


@dataclass
class CheckpointConfig:
    """Everything a :class:`Checkpointer` can be told; every field has a safe default."""

    mode: Literal["sync", "async"] = "async"
    """``"async"``: ``save`` returns after staging and persists in the background;
    ``"sync"``: ``save`` returns once the checkpoint has committed."""
    keep: int | None = None
    """How many committed checkpoints to keep (oldest deleted after a newer commit); None keeps all."""
    max_inflight: int = 1
    """Saves that may be staged or persisting at once; the next ``save`` waits (backpressure).
    Host memory for staging is ``max_inflight`` times the state size, allocated once."""
    verify: bool = True
    """Check every file's size and xxh3 checksum against the manifest before restoring."""
    capture_rng: bool = False
    """Save the torch (CPU and CUDA), numpy and ``random`` RNG states; restore sets them back."""
    writer_threads: int = 2
    """Threads writing the files of one rank in parallel (one file each)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """fsspec options for URLs such as ``s3://`` (``endpoint_url``, ``key``, ``secret``, ...)."""

    def validate(self) -> None:
        """Raise ConfigError naming the first field that is out of range."""
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', not {self.mode!r}")
        if self.keep is not None and not _is_count(self.keep):
            raise ConfigError(f"keep must be a positive integer or None, not {self.keep!r}")
        if not _is_count(self.max_inflight):
            raise ConfigError(f"max_inflight must be a positive integer, not {self.max_inflight!r}")
        if not _is_count(self.writer_threads):
            raise ConfigError(
                f"writer_threads must be a positive integer, not {self.writer_threads!r}"
            )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class SaveRecord:
    """What one committed save cost. Times in seconds; ``stall_s`` is what the caller was blocked."""

    step: int
    path: str
    bytes: int
    stall_s: float
    stage_s: float
    persist_s: float
    wait_s: float
    write_gbs: float

    def to_dict(self) -> dict[str, Any]:
        """The record as plain values (for JSON and DataFrames)."""
        return asdict(self)


class SaveHandle:
    """One save in its two phases: ``staged`` (host copy done) and ``committed`` (durable)."""

    def __init__(self, step: int, nbytes: int) -> None:
        self.step = step
        self.bytes = nbytes
        self.staged: Future[None] = Future()
        self.committed: Future[SaveRecord] = Future()
        self.phase = "staging"
        self.stall_s = 0.0
        self.stage_s = 0.0
        self.wait_s = 0.0
        self.reported = False

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


class _BufferPool:
    """Host staging buffers, allocated once per in-flight slot and reused across saves."""

    def __init__(self, slots: int) -> None:
        self._free: queue.Queue[dict[str, torch.Tensor]] = queue.Queue()
        self._pin = torch.cuda.is_available()  # pinned host memory makes D2H copies async
        for _ in range(slots):
            self._free.put({})

    def acquire(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        buffers = self._free.get()
        for key, tensor in tensors.items():
            buf = buffers.get(key)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
                buffers[key] = torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin
                )
        for key in [k for k in buffers if k not in tensors]:
            del buffers[key]
        return buffers

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        self._free.put(buffers)


class _Worker:
    """One daemon thread running jobs in order (daemon so a hung write never blocks exit)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            # Jobs report their own errors on their futures; the thread must outlive any of them.
            with contextlib.suppress(BaseException):
                job()
            del job  # an idle worker must not keep the last job's Checkpointer alive

    def stop(self, wait: bool = True) -> None:
        self._jobs.put(None)
        # Wait for the thread to end: one still unwinding while the interpreter finalizes
        # (close() at exit) aborts the process ("terminate called without an active exception").
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


class Checkpointer:
    """Fast, atomic, resumable checkpoints of PyTorch state in DCP format.

    >>> ckpt = Checkpointer("data/checkpoints/run1", mode="async", keep=3)
    >>> h = ckpt.save({"model": model, "optim": opt, "step": step}, step=step)
    >>> ckpt.wait(); step = ckpt.restore({"model": model, "optim": opt})

    Under ``torchrun`` every rank must create the Checkpointer and call ``save``
    and ``restore`` together; ranks write their own shards on a gloo group.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        mode: Literal["sync", "async"] | None = None,
        keep: int | _Unset | None = _UNSET,
        *,
        config: CheckpointConfig | None = None,
        **options: Any,
    ) -> None:
        """``mode``, ``keep`` and ``options`` (any :class:`CheckpointConfig` field) override ``config``."""
        unknown = set(options) - set(CheckpointConfig.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"unknown Checkpointer option(s): {', '.join(sorted(unknown))}")
        if mode is not None:
            options["mode"] = mode
        if keep is not _UNSET:
            options["keep"] = keep
        self.config = dataclasses.replace(config or CheckpointConfig(), **options)
        self.config.validate()
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise ConfigError(f"directory must be a non-empty path or URL, not {directory!r}")
        self.directory = os.fspath(directory)
        self.store: Store = open_store(self.directory, self.config.storage_options)
        self._pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.rank = dist.get_rank() if self._pg is not None else 0
        self.world_size = dist.get_world_size() if self._pg is not None else 1
        self.timeline = Timeline(rank=self.rank, label=f"nbckpt-{self.config.mode}")
        self.records: list[SaveRecord] = []
        self.handles: list[SaveHandle] = []
        self._inflight: deque[SaveHandle] = deque()
        self._pool = _BufferPool(self.config.max_inflight)
        self._closed = False
        self._counter = 0
        self._nonce = self._agree(self._open_store)
        self._persister = _Worker("nbckpt-persist")
        self._stagers = [_Worker(f"nbckpt-stage-{i}") for i in range(2)]
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        atexit.register(_close_at_exit, weakref.ref(self))
        # A Checkpointer dropped without close() (a notebook cell run again) frees the directory.
        weakref.finalize(self, _release, self.store, (self._persister, *self._stagers)).atexit = False

    # -- set-up -------------------------------------------------------------------------------

    def _open_store(self) -> str:
        self.store.prepare()
        self.store.lock()
        stale = self.store.stale()
        for name in stale:
            self.store.remove(name)
        if stale:
            warnings.warn(
                f"nbckpt: removed {len(stale)} stale leftover(s) of interrupted saves in "
                f"{self.store.url}: {', '.join(stale)}",
                stacklevel=4,
            )
        return uuid.uuid4().hex[:12]

    def _agree(self, on_rank0: Callable[[], Any]) -> Any:
        """Run ``on_rank0`` on rank 0 and give every rank its result (or its error)."""
        result: Any = None
        error: str | None = None
        if self.rank == 0:
            try:
                result = on_rank0()
            except Exception as exc:
                if self._pg is None:
                    raise
                error = str(exc) if isinstance(exc, CheckpointError) else describe_error(exc)
        if self._pg is not None:
            box = [result, error]
            dist.broadcast_object_list(box, src=0, group=self._pg)
            result, error = box
        if error is not None:
            raise CheckpointError(error)
        return result

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        overlap: bool = False,
        rng: bool | None = None,
        blocking: bool | None = None,
    ) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; returns once the state is copied (async mode).

        ``blocking=True`` makes this one save synchronous (committed before it returns)
        whatever the Checkpointer's mode; ``blocking=False`` makes it asynchronous.

        With ``overlap=True`` it returns before the copy is done: call
        ``handle.wait_staged()`` (or ``ckpt.wait_staged()``) before the next
        optimizer step mutates the parameters, or the checkpoint may mix two steps.
        Errors of earlier background saves are raised here as CheckpointError.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, not {step!r}")
        sync = self.config.mode == "sync" if blocking is None else blocking
        start = now_ns()
        self._raise_pending()
        flat = flatten(state, capture_rng=self.config.capture_rng if rng is None else rng)
        handle = SaveHandle(step, flat.nbytes)

        wait_start = now_ns()
        # a blocking save also waits for every earlier one: saves commit in order
        while self._inflight and (sync or len(self._inflight) >= self.config.max_inflight):
            # dequeue only once done: a KeyboardInterrupt here must not forget the save
            with contextlib.suppress(CheckpointError):  # raised just below, once
                self._inflight[0].committed.result()
            self._inflight.popleft()
        handle.wait_s = (now_ns() - wait_start) / 1e9
        if handle.wait_s > 1e-4:
            self.timeline.record("wait", wait_start, step=step)
        self._raise_pending()

        buffers = self._pool.acquire(flat.tensors)
        self.handles.append(handle)
        try:
            self._stage(handle, flat, buffers, overlap=overlap and not sync)
        except BaseException:
            self._pool.release(buffers)
            self.handles.remove(handle)
            raise
        if sync:
            self._persist(handle, flat, buffers, start, sync=True)
        else:
            self._inflight.append(handle)
            self._persister.submit(lambda: self._persist(handle, flat, buffers, start, sync=False))
        handle.stall_s = (now_ns() - start) / 1e9
        self.timeline.record("stall", start, step=step, nbytes=flat.nbytes)
        if sync:
            handle.reported = True  # raised right here, not again from the next call
            handle.wait()
        return handle

    def _stage(
        self, handle: SaveHandle, flat: Flattened, buffers: dict[str, torch.Tensor], *, overlap: bool
    ) -> None:
        # The caller's stream, read on the caller's thread: the stage threads have their own.
        producer = torch.cuda.current_stream() if self._stream is not None else None
        if producer is not None:
            shards = [list(flat.tensors)]
        else:
            # CPU copies run on the stage threads, one shard each, even when save() waits for
            # them: on the main thread torch splits every copy across its OpenMP threads, which
            # on a busy 2-core machine made staging 303 MB take 0.4-2.4 s instead of 0.04-0.12 s;
            # two threads with a shard each keep both cores busy without OpenMP barriers.
            by_size = sorted(flat.tensors, key=lambda k: flat.tensors[k].numel(), reverse=True)
            shards = [by_size[i :: len(self._stagers)] for i in range(len(self._stagers))]
        begin = now_ns()
        lock = threading.Lock()
        pending = [len(shards)]
        errors: list[BaseException] = []

        def finish_one(error: BaseException | None) -> None:
            with lock:
                if error is not None:
                    errors.append(error)
                pending[0] -= 1
                if pending[0]:
                    return
            if errors:
                handle.staged.set_exception(
                    CheckpointError(f"staging step {handle.step} failed: {describe_error(errors[0])}")
                )
                return
            handle.stage_s = (now_ns() - begin) / 1e9
            self.timeline.record("stage", begin, step=handle.step, nbytes=flat.nbytes)
            handle.phase = "staged"
            handle.staged.set_result(None)

        def copy(keys: list[str]) -> None:
            try:
                if self._stream is not None and producer is not None:
                    self._stream.wait_stream(producer)
                    with torch.cuda.stream(self._stream):
                        for key in keys:
                            buffers[key].copy_(flat.tensors[key], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    event.synchronize()
                else:
                    for key in keys:
                        buffers[key].copy_(flat.tensors[key])
            except BaseException as exc:
                finish_one(exc)
                raise
            finish_one(None)

        if producer is not None and not overlap:
            copy(shards[0])
            handle.staged.result()
            return
        for stager, keys in zip(self._stagers, shards, strict=False):
            stager.submit(partial(copy, keys))
        if not overlap:
            try:
                handle.staged.result()
            except KeyboardInterrupt:
                # save() hands the buffers back on the way out: the copies must be over first.
                handle.staged.exception()
                raise

    def _persist(
        self,
        handle: SaveHandle,
        flat: Flattened,
        buffers: dict[str, torch.Tensor],
        start: int,
        *,
        sync: bool,
    ) -> None:
        """Write, gather, commit; every outcome sets ``handle.committed`` exactly once."""
        begin = now_ns()
        location: str | None = None
        path: str | None = None
        try:
            handle.staged.result()
            handle.phase = "persisting"
            self._counter += 1
            nonce = f"{self._nonce}{self._counter:x}"
            location = self._agree(lambda: self.store.begin(handle.step, nonce))
            files, trees = self._write(handle, location, buffers, flat.tree)
            persisted = now_ns()
            manifest = self._manifest(handle, flat, files, trees)
            committed_location = location
            path = self._agree(lambda: self.store.commit(committed_location, handle.step, manifest))
        except BaseException as exc:
            # Once committed, the checkpoint stays whatever fails after; before, it goes.
            if path is None and location is not None and self.rank == 0:
                self.store.remove(location)
            self._fail(handle, exc, begin)
            if sync and isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            return
        finally:
            self._pool.release(buffers)
        persist_s = (now_ns() - begin) / 1e9
        record = SaveRecord(
            step=handle.step,
            path=path,
            bytes=handle.bytes,
            stall_s=(now_ns() - start) / 1e9 if sync else handle.stall_s,
            stage_s=handle.stage_s,
            persist_s=persist_s,
            wait_s=handle.wait_s,
            write_gbs=handle.bytes / persist_s / 1e9 if persist_s > 0 else 0.0,
        )
        self.timeline.record("persist", begin, persisted, step=handle.step, nbytes=handle.bytes)
        self.timeline.record("commit", persisted, step=handle.step)
        self.records.append(record)
        handle.phase = "committed"
        try:
            self._retain(handle.step)
        except Exception as exc:  # the new checkpoint is committed; old ones stay for later
            warnings.warn(f"nbckpt: retention failed: {describe_error(exc)}", stacklevel=2)
        handle.committed.set_result(record)

    def _write(
        self, handle: SaveHandle, location: str, buffers: dict[str, torch.Tensor], tree: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """DCP-write the staged buffers; return every rank's files and trees that differ."""
        writer = self.store.writer(location, self.config.writer_threads)
        try:
            dcp_save(
                dict(buffers),
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=self._pg,
                no_dist=self._pg is None,
            )
        except BaseException as exc:
            error = writer.fs.first_error()  # the real OSError and its path, which torch.save hides
            if error is not None:
                raise error from exc
            raise
        for fs_start, fs_end, name in writer.fs.fsyncs:
            self.timeline.record("fsync", fs_start, fs_end, step=handle.step, file=name)
        _faults.hit("after_data")
        # DCP's extra writer threads drop their errors; each rank's are agreed on in the gather.
        error = writer.fs.first_error()
        files: dict[str, Any] = dict(writer.fs.files)
        if self._pg is None:
            if error is not None:
                raise error
            return files, {}
        gathered: list[Any] = [None] * self.world_size
        message = None if error is None else describe_error(error)
        dist.all_gather_object(gathered, (files, tree, message), group=self._pg)
        if error is not None:
            raise error
        failed = next((m for _, _, m in gathered if m is not None), None)
        if failed is not None:
            raise CheckpointError(f"another rank failed: {failed}")
        files = {k: v for part, _, _ in gathered for k, v in part.items()}
        trees = {str(r): t for r, (_, t, _) in enumerate(gathered) if t != tree}
        return files, trees

    def _fail(self, handle: SaveHandle, exc: BaseException, begin: int) -> None:
        error = CheckpointError(
            f"save of step {handle.step} to {self.store.url} failed: {describe_error(exc)}"
        )
        error.__cause__ = exc
        handle.phase = "failed"
        if not handle.staged.done():
            handle.staged.set_exception(error)
        handle.committed.set_exception(error)
        self.timeline.record("error", begin, step=handle.step, message=str(error))

    def _manifest(
        self,
        handle: SaveHandle,
        flat: Flattened,
        files: Mapping[str, tuple[int, str]],
        rank_trees: Mapping[str, Any],
    ) -> bytes:
        body = {
            "format": FORMAT,
            "step": handle.step,
            "unix_time": time.time(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "bytes": handle.bytes,
            "world_size": self.world_size,
            "files": {
                name: {"size": size, "xxh3_64": digest}
                for name, (size, digest) in sorted(files.items())
            },
            "tree": flat.tree,
            **({"rank_trees": dict(rank_trees)} if rank_trees else {}),
            "nbckpt_version": _version(),
            "torch_version": torch.__version__,
        }
        body["checksum"] = _manifest_checksum(body)
        return json.dumps(body, separators=(",", ":")).encode()

    def _retain(self, newest: int) -> None:
        if self.config.keep is None or self.rank != 0:
            return
        steps = [s for s in self.store.committed() if s != newest]
        excess = len(steps) + 1 - self.config.keep
        for step in sorted(steps)[: max(excess, 0)]:
            begin = now_ns()
            try:
                self.store.delete(step, uuid.uuid4().hex[:8])
            except Exception as exc:
                warnings.warn(
                    f"nbckpt: could not delete old checkpoint {step_name(step)}: {describe_error(exc)}",
                    stacklevel=2,
                )
                continue
            self.timeline.record("delete", begin, step=step)

    # -- waiting and errors -------------------------------------------------------------------

    def wait_staged(self) -> None:
        """Block until every save has finished copying the state (see ``save(overlap=True)``)."""
        for handle in list(self._inflight):
            handle.wait_staged()

    def wait(self) -> list[SaveRecord]:
        """Block until every save in flight has committed; raise the first background error."""
        records = []
        while self._inflight:
            with contextlib.suppress(CheckpointError):  # raised below, once
                records.append(self._inflight[0].committed.result())
            self._inflight.popleft()  # only once done: Ctrl-C while waiting keeps it tracked
        self._raise_pending()
        return records

    def _raise_pending(self) -> None:
        failed = [h for h in self.handles if h.done() and not h.reported and h.error is not None]
        # Settled handles are dropped so long runs keep this scan short (records stay).
        self.handles = [h for h in self.handles if not h.done() or (h.error and not h.reported)]
        if failed:
            failed[0].reported = True
            self.handles.remove(failed[0])
            raise failed[0].committed.exception()  # type: ignore[misc]

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the Checkpointer for {self.store.url} is closed")

    # -- reading ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, oldest first (a step counts once its manifest exists)."""
        return list(self.store.committed())

    def latest_step(self) -> int | None:
        """The highest committed step, or None when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> dict[str, Any]:
        """The verified manifest of a committed step (raises CheckpointError if it is invalid)."""
        return self._read_manifest(step, self._path(step, self.store.committed()))

    def verify(self, step: int) -> dict[str, Any]:
        """Check a checkpoint's manifest and every file's size and checksum; return the manifest."""
        return self._verify(step, self._path(step, self.store.committed()))

    def _path(self, step: int, committed: Mapping[int, str]) -> str:
        if step not in committed:
            raise CheckpointError(f"no committed checkpoint for step {step} in {self.store.url}")
        return committed[step]

    def _verify(self, step: int, path: str) -> dict[str, Any]:
        manifest = self._read_manifest(step, path)
        try:
            sizes = self.store.list_files(path)
        except OSError as exc:
            raise CheckpointError(f"{step_name(step)} is unreadable ({describe_error(exc)})") from exc
        for name, meta in manifest["files"].items():
            where = f"{step_name(step)}/{name}"
            if name not in sizes:
                raise CheckpointError(f"{where} is missing")
            if sizes[name] != meta["size"]:
                raise CheckpointError(f"{where} has {sizes[name]} bytes, manifest says {meta['size']}")
            hasher = new_hasher()
            try:
                with self.store.open(path, name) as stream:
                    while chunk := stream.read(_VERIFY_CHUNK):
                        hasher.update(chunk)
            except OSError as exc:  # a bad sector, a lost server: a bad checkpoint, not a crash
                raise CheckpointError(f"{where} is unreadable ({describe_error(exc)})") from exc
            if hasher.hexdigest() != meta["xxh3_64"]:
                raise CheckpointError(f"{where} is corrupt (checksum mismatch)")
        return manifest

    def _read_manifest(self, step: int, path: str) -> dict[str, Any]:
        where = f"{step_name(step)}/{MANIFEST}"
        try:
            with self.store.open(path, MANIFEST) as stream:
                manifest = json.loads(stream.read())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{where} is unreadable ({describe_error(exc)})") from exc
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not an nbckpt manifest")
        if manifest.get("checksum") != _manifest_checksum(manifest):
            raise CheckpointError(f"{where} was modified after it was written (checksum mismatch)")
        if manifest.get("step") != step:
            raise CheckpointError(f"{where} names step {manifest.get('step')}, not {step}")
        files = manifest.get("files")
        if not isinstance(files, dict) or METADATA_FILE not in files:
            raise CheckpointError(f"{where} lists no DCP metadata file")
        for name, meta in files.items():
            if not isinstance(name, str) or name != os.path.basename(name) or name in ("", ".", ".."):
                raise CheckpointError(f"{where} names a file outside the checkpoint: {name!r}")
            if not (
                isinstance(meta, dict)
                and isinstance(meta.get("size"), int)
                and isinstance(meta.get("xxh3_64"), str)
            ):
                raise CheckpointError(f"{where} has a malformed entry for {name!r}")
        rank_trees = manifest.get("rank_trees", {})
        if not (
            _is_tree(manifest.get("tree"))
            and isinstance(rank_trees, dict)
            and all(_is_tree(tree) for tree in rank_trees.values())
        ):
            raise CheckpointError(f"{where} has a malformed state tree")
        return manifest

    def restore(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        verify: bool | None = None,
        rng: bool = True,
    ) -> int:
        """Load a checkpoint into ``state`` in place and return its step.

        Without ``step``, the newest checkpoint that verifies is used; a corrupt one is
        skipped with a warning naming the file. Saves in flight are waited for first.
        """
        self._check_open()
        if not isinstance(state, dict):
            raise ConfigError(f"state must be a dict, not {type(state).__name__}")
        self.wait()
        committed = self.store.committed()
        if step is not None:
            self._path(step, committed)
        candidates = [step] if step is not None else sorted(committed, reverse=True)
        check = self.config.verify if verify is None else verify
        for candidate in candidates:
            begin = now_ns()
            try:
                manifest = self._agree(
                    partial(self._verify, candidate, committed[candidate])
                    if check
                    else partial(self._read_manifest, candidate, committed[candidate])
                )
                nbytes = self._load(state, manifest, committed[candidate], rng=rng)
            except CheckpointError as exc:
                if step is not None:
                    raise
                warnings.warn(
                    f"nbckpt: skipping {step_name(candidate)}: {exc}; trying an older checkpoint",
                    stacklevel=2,
                )
                continue
            self.timeline.record("restore", begin, step=candidate, nbytes=nbytes)
            return candidate
        raise CheckpointError(f"no valid checkpoint in {self.store.url}")

    def _load(self, state: dict[str, Any], manifest: dict[str, Any], path: str, *, rng: bool) -> int:
        # Every step that can fail on one rank alone is agreed on by all ranks before the
        # next collective, so a failure never leaves the other ranks waiting in DCP.
        tree = manifest.get("rank_trees", {}).get(str(self.rank), manifest["tree"])
        saved = {key: node for key, node in tree["items"]}
        targets = self._all_agree(lambda: self._load_targets(state, saved, manifest["step"], rng))
        if targets:
            try:
                dcp_load(
                    targets,
                    storage_reader=self.store.reader(path),
                    planner=DefaultLoadPlanner(),
                    process_group=self._pg,
                    no_dist=self._pg is None,
                )
            except BaseException as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"loading {path} failed: {describe_error(exc)}") from exc

        def apply_all() -> None:
            user = [[key, saved[key]] for key in state]
            apply(state, {"t": "dict", "items": user}, targets)
            if rng and RNG_KEY in saved:
                set_rng_state(decode(saved[RNG_KEY], targets))

        self._all_agree(apply_all)
        return sum(t.numel() * t.element_size() for t in targets.values())

    def _load_targets(
        self, state: dict[str, Any], saved: dict[str, Any], step: int, rng: bool
    ) -> dict[str, torch.Tensor]:
        """Tensors DCP loads into: the caller's own where dtype and shape match, else new ones."""
        missing = [key for key in state if key not in saved]
        if missing:
            raise CheckpointError(f"{step_name(step)} has no entry {missing[0]!r}")
        wanted = list(state) + ([RNG_KEY] if rng and RNG_KEY in saved else [])
        current = flatten({key: state[key] for key in state}).tensors
        targets: dict[str, torch.Tensor] = {}
        try:
            specs = tensor_specs({"t": "dict", "items": [[key, saved[key]] for key in wanted]})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(
                f"{step_name(step)}/{MANIFEST} has a malformed tensor entry ({describe_error(exc)})"
            ) from exc
        for key, (dtype, shape) in specs.items():
            tensor = current.get(key)
            if tensor is not None and tensor.dtype == dtype and tuple(tensor.shape) == shape:
                targets[key] = tensor
            else:
                targets[key] = torch.empty(shape, dtype=dtype)
        return targets

    def _all_agree(self, local: Callable[[], Any]) -> Any:
        """Run ``local`` on every rank; if it fails on any rank, raise CheckpointError on all."""
        error: str | None = None
        result: Any = None
        try:
            result = local()
        except (
            CheckpointError, ConfigError, RuntimeError, ValueError, KeyError, TypeError, AttributeError
        ) as exc:
            if self._pg is None:
                if isinstance(exc, (CheckpointError, ConfigError)):
                    raise
                raise CheckpointError(describe_error(exc)) from exc
            error = f"rank {self.rank}: {exc}"
        if self._pg is not None:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(errors, error, group=self._pg)
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise CheckpointError(first)
        return result

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight, release the directory lock; raise any background error."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._persister.stop()
            for stager in self._stagers:
                stager.stop()
            self.store.unlock()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r}, mode={self.config.mode!r}, keep={self.config.keep})"


def _is_tree(tree: Any) -> bool:
    """The top of a state tree: a dict node whose items are [key, node] pairs."""
    return (
        isinstance(tree, dict)
        and isinstance(tree.get("items"), list)
        and all(isinstance(item, list) and len(item) == 2 and isinstance(item[1], dict)
                for item in tree["items"])
    )


def _manifest_checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def _version() -> str:
    from . import __version__

    return __version__


def _release(store: Store, workers: tuple[_Worker, ...]) -> None:
    for worker in workers:
        worker.stop(wait=False)
    store.unlock()


def _close_at_exit(ref: weakref.ref[Checkpointer]) -> None:
    ckpt = ref()
    if ckpt is None or ckpt._closed:
        return
    pending = [h for h in ckpt._inflight if not h.done()]
    if pending:
        steps = ", ".join(str(h.step) for h in pending)
        warnings.warn(f"nbckpt: finishing save(s) of step {steps} before exit", stacklevel=1)
    try:
        ckpt.close()
    except CheckpointError as exc:
        warnings.warn(f"nbckpt: {exc}", stacklevel=1)
