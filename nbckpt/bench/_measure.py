"""Timing a storage path (durable writes, reads back, fsync) for the probe, and the floors.

A write is ``bytes`` split over ``streams`` threads, each writing its own file in 4 MiB
``os.write`` calls and ending with ``fsync`` (objects: 8 MiB multipart parts), the fastest of
``repeats`` rounds per stream count; the bytes are random, so compressing storage cannot flatter
them. A save stall is read against the copy floor (the same bytes into preallocated memory), a
write rate against the write floor (this write of the same bytes, to the same directory), both
measured before each repeat of a comparison so that they meet the same moments of the machine.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import GB, GIB, MIB, check_count, format_bytes, is_url
from ..engine import CheckpointConfig, Timeline
from ..engine._internal import (
    Pool,
    cached_fraction,
    drop_cached,
    endpoint,
    explain_fsspec_error,
    fsspec_options,
    now_ns,
    open_fsspec,
    step_name,
)
from ._strategy import Strategy, failing_as

__all__ = [
    "DEFAULT_REPEATS",
    "FLOOR_SAMPLE_BYTES",
    "Floors",
    "RawWriteBeside",
    "StreamRun",
    "combine_floors",
    "concurrent_write",
    "fsync_latencies",
    "measure_floors",
    "measure_write",
    "scratch",
    "stream_counts",
    "stream_runs",
]

DEFAULT_REPEATS = 2
_CHUNK = 4 * MIB  # os.write size: large writes, as DCP's writer makes
_PART = 8 * MIB  # multipart part size for objects (S3's minimum is 5 MiB)


@dataclass(frozen=True)
class StreamRun:
    """Writing (then reading back) ``bytes`` split over ``streams`` parallel files or objects."""

    streams: int
    bytes: int
    write_s: float  # the fastest round's (other load only ever slows a round down)
    read_s: float | None
    write_rounds_s: tuple[float, ...] = ()  # every round's, fastest or not: this machine's noise

    @property
    def write_gbs(self) -> float:
        return self.bytes / self.write_s / GB if self.write_s > 0 else math.nan

    @property
    def read_gbs(self) -> float:
        return self.bytes / self.read_s / GB if self.read_s else math.nan


def stream_counts(streams: Sequence[int]) -> list[int]:
    """``streams`` as a list; ConfigError unless it holds one or more positive integers."""
    counts = [check_count(count, f"every stream count (streams={streams!r})") for count in streams]
    if not counts:
        raise ConfigError(f"streams must be positive integers, not {streams!r}")
    return counts


def in_threads(count: int, work: Callable[[int], Any]) -> float:
    """Seconds from releasing ``count`` started threads running ``work(i)`` until all end (or one fails)."""
    barrier = threading.Barrier(count + 1)

    def run(index: int) -> None:
        barrier.wait()
        work(index)

    with ThreadPoolExecutor(count) as pool:
        done = [pool.submit(run, i) for i in range(count)]
        barrier.wait()
        start = time.perf_counter()
        for future in done:
            future.result()
        return time.perf_counter() - start


def _pieces(pattern: memoryview, nbytes: int, size: int, salt: int) -> Iterator[memoryview]:
    """``nbytes`` in pieces of ``size``, each at another offset of ``pattern``: no two alike."""
    done, index = 0, salt * 7919
    while done < nbytes:
        length = min(size, nbytes - done)
        offset = (index * 4096 + 512) % (len(pattern) - length + 1)
        yield pattern[offset : offset + length]
        done, index = done + length, index + 1


def _write(
    fs: Any, names: list[str], nbytes: int, pattern: memoryview, index: int, *, drop: bool = True
) -> None:
    """File ``names[index]`` written durably; with ``drop``, then dropped from the page cache (so
    that the read back comes from storage)."""
    local = fs is None  # s3fs sends a multipart part each time block_size bytes are buffered
    with open(names[index], "wb") if local else fs.open(names[index], "wb", block_size=_PART) as stream:
        for piece in _pieces(pattern, nbytes, _CHUNK if local else _PART, index):
            stream.write(piece)  # larger than the buffer: one os.write each, no copy
        if local:
            stream.flush()
            os.fsync(stream.fileno())
            if drop:
                with suppress(OSError, AttributeError):
                    os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _read(fs: Any, names: list[str], index: int) -> None:
    if fs is not None:
        fs.cat_file(names[index])
        return
    buffer = bytearray(_CHUNK)
    with open(names[index], "rb", buffering=0) as stream:
        while stream.readinto(buffer):
            pass


def stream_runs(
    fs: Any, work: str, size: int, *, streams: Sequence[int], repeats: int, read_back: bool
) -> tuple[list[StreamRun], list[float]]:
    """Write ``size`` bytes into ``work`` (a directory, or an object prefix of ``fs``) at each
    stream count, ``repeats`` rounds each, and read each round back if ``read_back``: the second
    list holds the share of each round's first file in the page cache as reading began."""
    runs, cached = list[StreamRun](), list[float]()
    pattern = memoryview(os.urandom(min(_CHUNK if fs is None else _PART, size) + 64 * 1024))
    for count in streams:
        names = [f"{work}/stream-{count}-{i}" for i in range(count)]
        share = max(size // count, 4096)
        writes, reads = [], []
        for _ in range(repeats):
            writes.append(in_threads(count, partial(_write, fs, names, share, pattern)))
            if read_back:
                fraction = None if fs is not None else cached_fraction(names[0])
                if fraction is not None:
                    cached.append(fraction)
                reads.append(in_threads(count, partial(_read, fs, names)))
        runs.append(StreamRun(count, share * count, min(writes), min(reads, default=None), tuple(writes)))
        for name in names:
            (os.unlink if fs is None else fs.rm_file)(name)
    return runs, cached


@contextmanager
def scratch(
    target: str, storage_options: dict[str, Any] | None, what: str = "writing to"
) -> Iterator[tuple[Any, str]]:
    """``(fs, work)``: a fresh directory in ``target`` (``fs`` None; ``target`` is created if
    need be), or a fresh prefix under an object-store URL; on leaving, removed with everything in
    it and every directory made for it. ConfigError if ``target`` cannot hold a directory; what
    the block raises as it works there, a CheckpointError ``<what> <target> failed: <why>``."""
    local, root, made = not is_url(target), target.removeprefix("file://"), list[str]()
    fs: Any = None
    options = {} if local else fsspec_options(target.split("://", 1)[0], storage_options)
    if not local:
        fs, root = open_fsspec(target.rstrip("/"), options)
    work = f"{root.rstrip('/')}/.nbckpt-probe-{uuid.uuid4().hex[:8]}"
    while local and not os.path.exists(root) and root != os.path.dirname(root):
        made, root = [*made, root], os.path.dirname(root)  # deepest first
    try:
        if local:
            try:
                os.makedirs(work)
            except OSError as exc:
                raise ConfigError(f"cannot write in {target}: {exc.strerror or exc}") from exc
        with _failing_in(target, None if local else options, what):
            yield fs, work
    finally:
        if local:
            shutil.rmtree(work, ignore_errors=True)
            for folder in made:
                with suppress(OSError):
                    os.rmdir(folder)
        else:
            with suppress(Exception):
                fs.rm(work, recursive=True)


@contextmanager
def _failing_in(target: str, options: dict[str, Any] | None, what: str) -> Iterator[None]:
    """An OSError (a local ``target``) or anything an object store's client raises (``options``
    given: its fsspec options), raised as one line that names the target, an object store's
    endpoint and the cause, instead of the client's traceback."""
    failures: type[Exception] = OSError if options is None else Exception  # a client raises anything
    try:
        yield
    except NbckptError:
        raise
    except failures as exc:
        if options is None:
            where, why = target, f"{getattr(exc, 'strerror', None) or exc} ({getattr(exc, 'filename', None)})"
        else:
            where = f"{target} (endpoint {endpoint(options) or 'AWS default endpoint'})"
            why = explain_fsspec_error(exc, target.split("://", 1)[1])
        raise CheckpointError(f"{what} {where} failed: {why}") from exc


def fsync_latencies(path: str) -> list[float]:
    """Milliseconds of each 4 KiB write + fsync (appending, like a manifest or a log)."""
    block, latencies = os.urandom(4096), list[float]()
    with open(path, "wb", buffering=0) as stream:
        started = time.perf_counter()
        while len(latencies) < 20 and time.perf_counter() - started < 3.0:  # a slow fsync stops early
            begin = time.perf_counter()
            stream.write(block)
            os.fsync(stream.fileno())
            latencies.append((time.perf_counter() - begin) * 1e3)
    return latencies


def measure_write(
    target: str | os.PathLike[str],
    nbytes: int,
    *,
    streams: Sequence[int] = (1,),
    repeats: int = DEFAULT_REPEATS,
    storage_options: dict[str, Any] | None = None,
) -> list[StreamRun]:
    """Write ``nbytes`` split over each stream count, exactly as :func:`nbckpt.bench.probe` writes:
    one :class:`StreamRun` per stream count (``read_s`` None). Everything written is removed, and
    every directory made for it."""
    check_count(nbytes, "nbytes of the write measurement")
    counts = stream_counts(streams)
    check_count(repeats, "repeats")
    with scratch(os.fspath(target), storage_options) as (fs, work):
        return stream_runs(fs, work, nbytes, streams=counts, repeats=repeats, read_back=False)[0]


def concurrent_write(
    target: str | os.PathLike[str],
    nbytes: int,
    *,
    start: Callable[[], None],
    storage_options: dict[str, Any] | None = None,
) -> tuple[int, int]:
    """One durable raw write of ``nbytes`` into a file of ``target``, as :func:`measure_write`
    writes, for every rank to make at once: its directory and bytes are made first, then
    ``start()`` (a barrier of every rank) releases it. The wall-clock nanoseconds (``time.time_ns``,
    which the ranks of a host share) of its first byte and of its fsync's end: the write itself,
    as a save's write span is timed, not the preparation before it, nor the drop from the page
    cache and the removal after it (a save drops the step before once it has committed)."""
    check_count(nbytes, "nbytes of the concurrent write")
    with scratch(os.fspath(target), storage_options) as (fs, work):
        pattern = memoryview(os.urandom(min(_CHUNK if fs is None else _PART, nbytes) + 64 * 1024))
        names = [f"{work}/stream-1-0"]
        start()
        begin = time.time_ns()
        _write(fs, names, nbytes, pattern, 0, drop=False)
        return begin, time.time_ns()


class RawWriteBeside(Strategy):
    """The write floor beside training: at each save, ``nbytes`` of random bytes written raw (no
    copy, no checksum, no manifest) into files of their own, one per writer thread, each ending
    with its fsync, while the loop trains on; the threads are as many, and as far below the
    caller's priority, as nbckpt's writers (:class:`~nbckpt.CheckpointConfig`'s
    ``writer_threads`` and ``writer_nice``). So where the host's cores train (CPU training), the
    raw write meets the competition nbckpt's persist meets: the floor as such a job sees it.
    Each thread's write is one ``persist`` event; a step's files stay, as a save's do, until the
    lane's folder is removed, and leave the page cache once the next step's are written, as a
    save's do (``Saver._uncache``): each write reuses the pages the step before freed instead of
    taking fresh ones, which in this VM cost a host fault each (``_files.drop_cached``)."""

    name = "raw-write-beside-training"
    description = "the raw write of each rank's share by nbckpt's writer threads, beside training"
    stall_covers_copy = False

    def __init__(self, nbytes: int, *, config: CheckpointConfig | None = None, rank: int = 0) -> None:
        super().__init__()
        config = config or CheckpointConfig()
        self.nbytes = check_count(nbytes, "nbytes of the write beside training")
        self.rank = rank  # in its files' names: every rank writes into the job's one folder
        self.threads, self.nice = config.writer_threads, config.writer_nice
        self._pattern = memoryview(os.urandom(min(_CHUNK, self.nbytes) + 64 * 1024))
        self._pool: Pool | None = None
        self._writes: list[Future[None]] = []
        self._written: list[str] = []  # the names of the step before, one per thread

    def open(self, directory: str, timeline: Timeline) -> None:
        super().open(directory, timeline)
        self._pool = Pool(self.threads, "nbckpt-floor", nice=self.nice)

    def save(self, state: Mapping[str, Any], step: int) -> None:
        if self._pool is None:
            raise ConfigError(f"strategy {self.name} is not open; call open() first")
        self.finish()  # one write at a time, as nbckpt's max_inflight=1
        stem = os.path.join(self.path, f"{step_name(step)}-rank{self.rank}")
        names = [f"{stem}-{index}" for index in range(self.threads)]
        before, self._written = self._written, names
        share, rest = divmod(self.nbytes, self.threads)
        self._writes = [
            self._pool.submit(partial(self._write_one, names, before, index, share + (index < rest), step))
            for index in range(self.threads)
        ]

    def _write_one(self, names: list[str], before: list[str], index: int, nbytes: int, step: int) -> None:
        begin = now_ns()
        with failing_as(f"the raw write of step {step} to {names[index]}"):
            _write(None, names, nbytes, self._pattern, index, drop=False)
        self.record("persist", begin, now_ns(), step=step, nbytes=nbytes)
        if before:  # as a save's persist ends: the step before's file out of the page cache
            drop_cached(before[index])

    def finish(self) -> None:
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()

    def close(self) -> None:
        if self._pool is not None:
            with suppress(Exception):  # a failed write was raised by finish() already
                self.finish()
            self._pool.stop()
            self._pool = None


# Floors are measured on at most this many bytes and scaled: rates are flat well below it.
FLOOR_SAMPLE_BYTES = GIB


@dataclass(frozen=True)
class Floors:
    """What the hardware allows for ``bytes``: a copy into preallocated memory, a durable raw write."""

    bytes: int
    copy_s: float
    copy_gbs: float
    write_gbs: float  # the best stream count's fastest round
    write_s: float = math.nan
    sample_bytes: int = 0
    write_streams: int = 1
    write_gbs_by_streams: dict[str, float] = field(default_factory=dict)
    write_gbs_rounds: tuple[float, ...] = ()  # every round of the best stream count: the noise
    repeats: int = 1
    copy_gbs_by_repeat: tuple[float, ...] = ()  # the floors measured before each repeat
    write_gbs_by_repeat: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Floors:
        """The floors of a JSON document (which holds NaN as null, tuples as lists)."""

        def restore(value: Any) -> Any:
            if isinstance(value, list):
                return tuple(map(restore, value))
            if isinstance(value, dict):
                return {str(k): restore(v) for k, v in value.items()}
            return math.nan if value is None else value

        known = {"copy_s": None, "copy_gbs": None, "write_gbs": None, **body}
        return cls(**{name: restore(v) for name, v in known.items() if name in cls.__dataclass_fields__})

    def describe(self) -> str:
        def span(rates: Sequence[float], digits: int) -> str:
            return f"{min(rates):.{digits}f}-{max(rates):.{digits}f} GB/s"

        text = (
            f"floors for {format_bytes(self.bytes)}: copy {self.copy_s:.4f} s ({self.copy_gbs:.1f} "
            f"GB/s); raw durable write {self.write_gbs:.2f} GB/s ({self.write_s:.3f} s) with "
            f"{self.write_streams} stream(s)"
        )
        if len(self.copy_gbs_by_repeat) > 1:
            text += (
                f"; measured before each of {len(self.copy_gbs_by_repeat)} repeats, the fastest counts: "
                f"copy {span(self.copy_gbs_by_repeat, 1)}, write {span(self.write_gbs_by_repeat, 2)}"
            )
        if self.write_gbs_rounds:
            text += f", best of {len(self.write_gbs_rounds)} rounds ({span(self.write_gbs_rounds, 2)})"
        if self.sample_bytes and self.sample_bytes < self.bytes:
            text += f"; measured on {format_bytes(self.sample_bytes)} and scaled"
        return text


def _copy_floor(nbytes: int, device: str) -> float:
    """The fastest copy of ``nbytes`` into a preallocated host buffer (pinned on CUDA); on the
    host on one thread and split over two, as nbckpt stages, three rounds each."""
    cuda = device == "cuda"
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target.copy_(source)  # touches every page once, as reused staging buffers are
    # nbckpt's staging splits a host copy over two threads (engine/_staging.py): so does the floor.
    shards, times = list(zip(target.chunk(2), source.chunk(2), strict=True)), list[float]()
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
            begin = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
        else:  # copy_ releases the GIL: the shards are copied at once
            times.append(in_threads(1, lambda _: target.copy_(source)))
            times.append(in_threads(len(shards), lambda i: shards[i][0].copy_(shards[i][1])))
    return min(times)


def measure_floors(
    nbytes: int,
    directory: str,
    *,
    device: str = "cpu",
    repeats: int = DEFAULT_REPEATS,
    storage_options: dict[str, Any] | None = None,
) -> Floors:
    """Measure the copy floor and the raw fsync'd write rate of ``directory`` for ``nbytes``: the
    write at 1 stream (torch.save's and DCP's one file) and 2 (nbckpt's default writer threads),
    the faster counting. Up to :data:`FLOOR_SAMPLE_BYTES` are really copied and written; larger
    sizes are scaled linearly from that sample."""
    check_count(nbytes, "nbytes")
    sample = min(nbytes, FLOOR_SAMPLE_BYTES)
    copy_s = _copy_floor(sample, device) * nbytes / sample
    runs = measure_write(directory, sample, streams=(1, 2), repeats=repeats, storage_options=storage_options)
    best = max(runs, key=lambda run: run.write_gbs)
    return Floors(
        bytes=nbytes,
        copy_s=copy_s,
        copy_gbs=nbytes / copy_s / GB,
        write_gbs=best.write_gbs,
        write_s=nbytes / (best.write_gbs * GB),
        sample_bytes=sample,
        write_streams=best.streams,
        write_gbs_by_streams={str(run.streams): run.write_gbs for run in runs},
        write_gbs_rounds=tuple(best.bytes / s / GB for s in best.write_rounds_s if s > 0),
        repeats=repeats,
    )


def combine_floors(measured: Sequence[Floors]) -> Floors:
    """One floor from floors measured before each repeat: the fastest copy and write of any,
    every repeat's rates kept (``copy_gbs_by_repeat``, ``write_gbs_by_repeat``)."""
    copy = min(measured, key=lambda floors: floors.copy_s)
    keys = {key: None for floors in measured for key in floors.write_gbs_by_streams}  # in order
    streams = {key: max(f.write_gbs_by_streams.get(key, 0.0) for f in measured) for key in keys}
    return replace(
        max(measured, key=lambda floors: floors.write_gbs),
        copy_s=copy.copy_s,
        copy_gbs=copy.copy_gbs,
        write_gbs_by_streams=streams,
        write_gbs_rounds=tuple(rate for floors in measured for rate in floors.write_gbs_rounds),
        repeats=sum(floors.repeats for floors in measured),
        copy_gbs_by_repeat=tuple(floors.copy_gbs for floors in measured),
        write_gbs_by_repeat=tuple(floors.write_gbs for floors in measured),
    )
