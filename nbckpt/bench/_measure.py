"""The storage measurements: parallel durable writes (and reads back), fsync latency, small files.

The write measurement is the same for the probe and the floors (:func:`measure_write`):
``bytes`` split over ``streams`` threads, each writing its own file in 4 MiB ``os.write``
calls and ending with ``fsync`` (objects: multipart uploads), the fastest of ``repeats``
rounds per stream count. Every byte written is random, so compressing or deduplicating
storage cannot flatter the figures.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigError
from .._util import GB, MIB, check_count, fsspec_options, is_url, open_fsspec, write_all

__all__ = [
    "DEFAULT_REPEATS",
    "StreamRun",
    "fsync_latencies",
    "local_stream_runs",
    "measure_write",
    "metadata_rates",
    "object_rates",
    "object_stream_runs",
    "stream_counts",
]

DEFAULT_REPEATS = 2
_CHUNK = 4 * MIB  # os.write size: large writes, as DCP's writer makes
_S3_PART = 8 * MIB  # multipart part size for the object probe (S3's minimum is 5 MiB)
_SMALL_FILES = 100  # files (or objects) for the create/rename/delete rates
_FSYNCS = 20  # 4 KiB write+fsync rounds for the latency
_PHASE_LIMIT_S = 3.0  # a slow metadata or fsync phase stops early; rates stay exact


@dataclass(frozen=True)
class StreamRun:
    """Writing (then reading back) ``bytes`` split over ``streams`` parallel files or objects."""

    streams: int
    bytes: int
    write_s: float
    """The fastest round's seconds (other load only ever slows a round down)."""
    read_s: float | None
    write_rounds_s: tuple[float, ...] = ()
    """Every round's write seconds, fastest or not: their spread is this machine's noise."""

    @property
    def write_gbs(self) -> float:
        return self.bytes / self.write_s / GB if self.write_s > 0 else math.nan

    @property
    def read_gbs(self) -> float:
        return self.bytes / self.read_s / GB if self.read_s else math.nan


def stream_counts(streams: Sequence[int]) -> list[int]:
    """``streams`` as a list; ConfigError unless it holds one or more positive integers."""
    counts = list(streams)
    if not counts:
        raise ConfigError(f"streams must be positive integers, not {streams!r}")
    for count in counts:
        check_count(count, f"every stream count (streams={streams!r})")
    return counts


# -- the pieces --------------------------------------------------------------------------------


def _pattern(nbytes: int) -> memoryview:
    """Random bytes to write: compressing or deduplicating storage must not flatter the figures."""
    return memoryview(os.urandom(nbytes + 64 * 1024))


def _slice(pattern: memoryview, index: int, size: int) -> memoryview:
    offset = (index * 4096 + 512) % (len(pattern) - size + 1)
    return pattern[offset : offset + size]


def _in_threads(count: int, work: Callable[[int], None]) -> float:
    """Run ``work(i)`` in ``count`` threads started together; wall seconds until all finish."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count + 1)

    def run(index: int) -> None:
        barrier.wait()
        try:
            work(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def _timed_ops(count: int, op: Callable[[int], None]) -> float:
    """Operations per second over up to ``count`` calls (fewer if the phase limit is reached)."""
    start = time.perf_counter()
    done = 0
    while done < count:
        op(done)
        done += 1
        if time.perf_counter() - start > _PHASE_LIMIT_S:
            break
    return done / max(time.perf_counter() - start, 1e-9)


def _write_file(path: str, nbytes: int, pattern: memoryview, *, salt: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done, index = 0, salt * 7919
        while done < nbytes:
            chunk = _slice(pattern, index, min(_CHUNK, nbytes - done))
            write_all(fd, chunk)
            done, index = done + len(chunk), index + 1
        os.fsync(fd)
        with suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _read_file(path: str) -> None:
    buffer = bytearray(_CHUNK)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while os.readv(fd, [buffer]) > 0:
            pass
    finally:
        os.close(fd)


def _write_round(files: list[str], share: int, pattern: memoryview) -> float:
    """One measured round: every file written in its own thread, each ending with fsync."""
    return _in_threads(len(files), lambda i: _write_file(files[i], share, pattern, salt=i))


def _read_round(files: list[str]) -> float:
    return _in_threads(len(files), lambda i: _read_file(files[i]))


def _resident_fraction(path: str) -> float | None:
    """Share of ``path``'s pages in the page cache (mincore), or None where it cannot be told."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            return None
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        status = libc.mincore(address, size, vector)
        libc.munmap(address, size)
    finally:
        os.close(fd)
    return None if status != 0 else sum(v & 1 for v in vector) / pages


def _upload_round(fs: Any, keys: list[str], *, share: int, pattern: memoryview) -> float:
    """One measured round: every object uploaded in its own thread."""

    def upload(i: int) -> None:
        # Parts of _S3_PART bytes: s3fs sends a multipart upload once a part is full.
        with fs.open(keys[i], "wb", block_size=_S3_PART) as stream:
            done, index = 0, i * 7919
            while done < share:
                chunk = _slice(pattern, index, min(_S3_PART, share - done))
                stream.write(chunk)
                done, index = done + len(chunk), index + 1

    return _in_threads(len(keys), upload)


def _download_round(fs: Any, keys: list[str]) -> float:
    return _in_threads(len(keys), lambda i: fs.cat_file(keys[i]))


# -- measurements ------------------------------------------------------------------------------


def local_stream_runs(
    work: str, size: int, *, streams: Sequence[int], repeats: int, read_back: bool
) -> tuple[list[StreamRun], list[float]]:
    """Write ``size`` bytes into files in ``work`` at each stream count, ``repeats`` rounds each.

    With ``read_back`` every round is read back too, and the second list holds the share of
    each round's first file still in the page cache when reading began (a read from memory
    is no read from storage).
    """
    runs: list[StreamRun] = []
    residents: list[float] = []
    pattern = _pattern(min(_CHUNK, size))
    for count in streams:
        files = [os.path.join(work, f"stream-{count}-{i}") for i in range(count)]
        share = max(size // count, 4096)
        writes, reads = [], []
        for _ in range(repeats):
            writes.append(_write_round(files, share, pattern))
            if read_back:
                fraction = _resident_fraction(files[0])
                if fraction is not None:
                    residents.append(fraction)
                reads.append(_read_round(files))
        runs.append(StreamRun(count, share * count, min(writes), min(reads) if reads else None,
                              tuple(writes)))
        for name in files:
            os.unlink(name)
    return runs, residents


def object_stream_runs(
    fs: Any, work: str, size: int, *, streams: Sequence[int], repeats: int, read_back: bool
) -> list[StreamRun]:
    """Upload ``size`` bytes as objects under ``work`` at each stream count (and download them)."""
    runs: list[StreamRun] = []
    pattern = _pattern(min(_S3_PART, size))
    for count in streams:
        share = max(size // count, 1)
        keys = [f"{work}/stream-{count}-{i}" for i in range(count)]
        writes, reads = [], []
        for _ in range(repeats):
            writes.append(_upload_round(fs, keys, share=share, pattern=pattern))
            if read_back:
                reads.append(_download_round(fs, keys))
        runs.append(StreamRun(count, share * count, min(writes), min(reads) if reads else None,
                              tuple(writes)))
        fs.rm(keys)
    return runs


def fsync_latencies(path: str) -> list[float]:
    """Milliseconds of each 4 KiB write + fsync (appending, like a manifest or a log)."""
    block = os.urandom(4096)
    latencies: list[float] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        started = time.perf_counter()
        for index in range(_FSYNCS):
            begin = time.perf_counter()
            os.pwrite(fd, block, index * 4096)
            os.fsync(fd)
            latencies.append((time.perf_counter() - begin) * 1e3)
            if time.perf_counter() - started > _PHASE_LIMIT_S:
                break
    finally:
        os.close(fd)
    return latencies


def metadata_rates(work: str) -> tuple[float, float, float]:
    """Creates, renames and deletes per second of small files (what a commit does)."""
    folder = os.path.join(work, "meta")
    os.mkdir(folder)
    names: list[str] = []

    def create(i: int) -> None:
        name = os.path.join(folder, f"f{i}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        write_all(fd, b"nbckpt probe\n")
        os.close(fd)
        names.append(name)

    create_rate = _timed_ops(_SMALL_FILES, create)
    renamed: list[str] = []

    def rename(i: int) -> None:
        os.rename(names[i], names[i] + ".r")
        renamed.append(names[i] + ".r")

    rename_rate = _timed_ops(len(names), rename)
    leftovers = renamed + names[len(renamed):]
    delete_rate = _timed_ops(len(leftovers), lambda i: os.unlink(leftovers[i]))
    return create_rate, rename_rate, delete_rate


def object_rates(fs: Any, work: str) -> tuple[float, float]:
    """PUTs and deletes per second of small objects under ``work``."""
    small = [f"{work}/small-{i}" for i in range(_SMALL_FILES)]
    put_rate = _timed_ops(len(small), lambda i: fs.pipe_file(small[i], b"nbckpt probe\n"))
    fs.invalidate_cache()
    written = [key for key in small if fs.exists(key)]
    delete_rate = _timed_ops(len(written), lambda i: fs.rm_file(written[i]))
    return put_rate, delete_rate


def measure_write(
    target: str | os.PathLike[str],
    nbytes: int,
    *,
    streams: Sequence[int] = (1,),
    repeats: int = DEFAULT_REPEATS,
    storage_options: dict[str, Any] | None = None,
) -> list[StreamRun]:
    """Write ``nbytes`` split over each stream count, exactly as :func:`nbckpt.bench.probe` writes.

    One :class:`StreamRun` per stream count (``read_s`` is None): the fastest of ``repeats``
    rounds, every round kept in ``write_rounds_s``. Files end with fsync, objects with a
    completed (multipart) upload; everything written is removed. ``target`` must exist.
    """
    check_count(nbytes, "nbytes of the write measurement")
    counts = stream_counts(streams)
    check_count(repeats, "repeats")
    text = os.fspath(target)
    if is_url(text):
        fs, root = open_fsspec(text.rstrip("/"), fsspec_options(text.split("://", 1)[0], storage_options))
        work = f"{root.rstrip('/')}/.nbckpt-floor-{uuid.uuid4().hex[:8]}"
        try:
            return object_stream_runs(fs, work, nbytes, streams=counts, repeats=repeats, read_back=False)
        finally:
            with suppress(Exception):
                fs.rm(work, recursive=True)
    work = os.path.join(text.removeprefix("file://"), f".nbckpt-floor-{uuid.uuid4().hex[:8]}")
    os.mkdir(work)
    try:
        return local_stream_runs(work, nbytes, streams=counts, repeats=repeats, read_back=False)[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
