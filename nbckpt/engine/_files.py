"""Moving bytes between memory and checkpoint files: large writes and scattered reads that release
the GIL, the xxh3 of every block (``_format.BLOCK_SIZE``) computed in the same pass, while the
bytes are in cache; the durable small-file write every layer uses.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Protocol

from .._errors import CheckpointError, describe_error
from ._faults import fault_point
from ._format import BLOCK_SIZE, block_hasher, checksum

__all__ = [
    "FileResult",
    "LocalSink",
    "LocalSource",
    "Sink",
    "Source",
    "StreamSink",
    "StreamSource",
    "cached_fraction",
    "copy_file",
    "damage_named",
    "drop_cached",
    "exchange_paths",
    "fsync_dir",
    "hash_blocks",
    "read_into",
    "write_all",
    "write_atomic",
    "write_image",
]


def write_all(fd: int, data: bytes | memoryview) -> None:
    """``os.write`` until every byte is out: on a nearly full disk one call may write only part."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def with_filename(exc: OSError, path: str) -> OSError:
    """``exc`` naming ``path`` (os.write and os.fsync errors do not say which file)."""
    if exc.filename is None:
        exc.filename = path
    return exc


def drop_cached(path: str) -> None:
    """Ask the kernel to drop the durable file ``path`` from the page cache; a file that is gone,
    or a file system that keeps its pages (tmpfs, where they are the data), is left as it is.

    A checkpoint's writes need free pages: where written files stay cached, every save takes
    pages the kernel has not used for a while, and in a VM whose host reclaims free guest memory
    (free page reporting, balloons) each such page first costs a fault on the host. Measured in
    this project's VM: 64 MiB written at 4 ranks cost 150-190 ms of CPU per file once earlier
    checkpoints filled the cache, 20 ms while their pages were dropped."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):  # not offered here (macOS has no posix_fadvise)
        pass
    finally:
        os.close(fd)


def cached_fraction(path: str) -> float | None:
    """Share of ``path``'s pages in the page cache (mincore), or None where it cannot be told.

    posix_fadvise(DONTNEED) is only advice (tmpfs pages are the data, NFS and FUSE may keep
    theirs): a read from memory is no read from storage, so the drop is checked, not assumed.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as view:
            anchor = ctypes.c_char.from_buffer(view)  # a private mapping reports the file's pages
            address = ctypes.addressof(anchor)
            del anchor  # the mapping cannot close while a ctypes view of it exists
            pages = (len(view) + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            status = libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(view)), vector)
    except (OSError, ValueError, AttributeError):
        return None
    return None if status != 0 else sum(v & 1 for v in vector) / pages


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (a new file or rename in it survives a power cut)."""
    fault_point("dir.fsync", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        with_filename(exc, path)
        raise
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike[str], fill: Callable[[IO[bytes]], object] | bytes, *, temporary: str | None = None
) -> None:
    """A file at ``path`` that replaces the old one only once it is whole and durable (``fill``
    writes it, or is its bytes): a crash leaves the old file or the new, never half of one, and
    at most the ``temporary`` file (a name a clean-up recognises; by default a fresh one). Its
    mode is a checkpoint file's, 0o644 less the umask (``mkstemp``'s 0o600 kept results and
    reports from the other users who read them)."""
    path = os.path.abspath(os.fspath(path))
    if temporary is None:
        name = f".{os.path.basename(path)}.tmp-{os.urandom(4).hex()}"  # as mkstemp's: O_EXCL below
        temporary = os.path.join(os.path.dirname(path), name)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as stream:
            if isinstance(fill, bytes):
                stream.write(fill)
            else:
                fill(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
        fsync_dir(os.path.dirname(path))
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


#: Bytes hashed and then written (or read and then hashed) at a time: small enough to stay in
#: the core's cache between the two, large enough that each system call moves a lot.
PIECE_SIZE = 1 << 20
#: Buffers one ``preadv`` takes at most (Linux's IOV_MAX): a column block of a tensor read into
#: a row-major one is one buffer per row.
IOV_MAX = 1024


@contextmanager
def damage_named(label: str) -> Iterator[None]:
    """Reading ``label`` (``step-NNNNNN/file``) failing is a damaged checkpoint, named in one line:
    a bad sector or a lost server is a CheckpointError (restore falls back), not a crash."""
    try:
        yield
    except FileNotFoundError:
        raise CheckpointError(f"{label} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"{label} is unreadable ({describe_error(exc)})") from exc
    except CheckpointError as exc:
        if str(exc).startswith(label):
            raise
        raise CheckpointError(f"{label.rsplit('/', 1)[0]}/{exc}") from None


class Sink(Protocol):
    """Where one checkpoint file is written."""

    name: str

    def write(self, data: memoryview) -> None: ...
    def sync(self) -> None: ...
    def close(self) -> None: ...


class Source(Protocol):
    """One checkpoint file being read; ``size`` is checked against the manifest first."""

    name: str
    size: int

    def readinto(self, offset: int, views: Sequence[memoryview]) -> None: ...
    def close(self) -> None: ...


@dataclass
class FileResult:
    """What writing one file produced: its size, block checksums and when its fsync ran."""

    name: str
    size: int
    blocks: list[str]
    fsync_ns: tuple[int, int] = (0, 0)
    cpu_s: float = 0.0
    shared: bool = False
    """Taken whole from an earlier step (incremental saves), not written by this process."""


class LocalSink:
    """A new file in a local (or NFS) directory; never follows a symlink, never overwrites."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.name = os.path.basename(path)
        try:
            self._fd = os.open(
                path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        except OSError as exc:
            raise with_filename(exc, path) from None

    def write(self, data: memoryview) -> None:
        try:
            fault_point("file.write", self.path)
            write_all(self._fd, data)
        except OSError as exc:
            raise with_filename(exc, self.path) from None

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise with_filename(exc, self.path) from None

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class StreamSink:
    """A file on an fsspec filesystem (``s3://``...): durable once ``close`` returns."""

    def __init__(self, fs: Any, path: str) -> None:
        self.name = path.rsplit("/", 1)[-1]
        self._stream = fs.open(path, "wb")

    def write(self, data: memoryview) -> None:
        self._stream.write(data)

    def sync(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


class LocalSource:
    """A regular file of a checkpoint opened for reading: no symlinks, no FIFOs, no devices."""

    def __init__(self, path: str, expected_size: int | None) -> None:
        self.path = path
        self.name = os.path.basename(path)
        fault_point("file.open", path)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer that never comes.
            self._fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise with_filename(exc, path) from None
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            self.close()
            raise CheckpointError(f"{self.name} is not a regular file")
        self.size = info.st_size
        if expected_size is not None and self.size != expected_size:
            self.close()
            raise CheckpointError(f"{self.name} has {info.st_size} bytes, manifest says {expected_size}")

    def readinto(self, offset: int, views: Sequence[memoryview]) -> None:
        want = sum(len(v) for v in views)
        try:
            got = os.preadv(self._fd, views, offset)
        except OSError as exc:
            raise with_filename(exc, self.path) from None
        if got != want:  # the file shrank under us: a damaged checkpoint, not a short read
            raise CheckpointError(f"{self.name} ended at byte {offset + got}, manifest says more")

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class StreamSource:
    """A checkpoint file on an fsspec filesystem, read by range."""

    def __init__(self, fs: Any, path: str, expected_size: int | None) -> None:
        self.name = path.rsplit("/", 1)[-1]
        self._fs, self._path = fs, path
        info = fs.info(path)
        if info.get("type") != "file":
            raise CheckpointError(f"{self.name} is not a file")
        self.size = int(info["size"])
        if expected_size is not None and self.size != expected_size:
            raise CheckpointError(f"{self.name} has {self.size} bytes, manifest says {expected_size}")

    def readinto(self, offset: int, views: Sequence[memoryview]) -> None:
        want = sum(len(v) for v in views)
        data = memoryview(self._fs.cat_file(self._path, start=offset, end=offset + want))
        if len(data) != want:
            raise CheckpointError(f"{self.name} ended at byte {offset + len(data)}, manifest says more")
        for view in views:
            view[:] = data[: len(view)]
            data = data[len(view) :]

    def close(self) -> None:
        pass


def write_image(sink: Sink, image: memoryview, *, fsync: bool) -> FileResult:
    """Write ``image`` whole, hashing each block on the way; fsync; close. Runs on any thread."""
    cpu = time.thread_time()
    hashes = []
    try:
        for start in range(0, len(image), BLOCK_SIZE):
            block = image[start : start + BLOCK_SIZE]
            hasher = block_hasher()
            for at in range(0, len(block), PIECE_SIZE):
                piece = block[at : at + PIECE_SIZE]
                hasher.update(piece)
                sink.write(piece)
            hashes.append(hasher.hexdigest())
        began = time.perf_counter_ns()
        if fsync:
            sink.sync()
        synced = (began, time.perf_counter_ns())
    finally:
        sink.close()
    return FileResult(sink.name, len(image), hashes, synced, time.thread_time() - cpu)


def copy_file(source: Source, sink: Sink, blocks: Sequence[str], *, fsync: bool) -> int:
    """Copy ``source`` to ``sink`` block by block, checking each on the way (a damaged copy is
    never passed on); fsync, close. Returns the bytes copied."""
    scratch = memoryview(bytearray(min(BLOCK_SIZE, source.size)))
    try:
        for offset in range(0, source.size, BLOCK_SIZE):
            block = scratch[: min(BLOCK_SIZE, source.size - offset)]
            read_into(source, [(offset, block)], blocks)
            sink.write(block)
        if fsync:
            sink.sync()
    finally:
        sink.close()
    return source.size


def hash_blocks(data: bytes | memoryview) -> list[str]:
    """Block checksums of bytes in memory (small files: the DCP metadata)."""
    view = memoryview(data).cast("B")
    return [checksum(view[i : i + BLOCK_SIZE]) for i in range(0, len(view), BLOCK_SIZE)]


def _walk(
    regions: Sequence[tuple[int, memoryview | None]], start: int, end: int, scratch: memoryview
) -> Iterator[tuple[int, int, list[memoryview]]]:
    """Cut ``[start, end)`` into pieces that never cross a block: ``(offset, block, views)``, from
    gapless sorted ``regions``; a view of None is bytes nobody wants, read into ``scratch``."""
    index = 0
    while index + 1 < len(regions) and regions[index + 1][0] <= start:
        index += 1
    offset = start
    while offset < end:
        block_end = min(end, (offset // BLOCK_SIZE + 1) * BLOCK_SIZE)
        piece_end = min(block_end, offset + PIECE_SIZE)
        views: list[memoryview] = []
        used = 0
        at = offset
        while at < piece_end and len(views) < IOV_MAX:
            region_offset, view = regions[index]
            region_end = regions[index + 1][0] if index + 1 < len(regions) else end
            take = min(piece_end, region_end) - at
            if view is None:
                views.append(scratch[used : used + take])
                used += take
            else:
                views.append(view[at - region_offset : at - region_offset + take])
            at += take
            if at == region_end:
                index += 1
        yield offset, offset // BLOCK_SIZE, views
        offset = at  # piece_end, unless the piece ran out of views first


def read_into(
    source: Source,
    wanted: Sequence[tuple[int, memoryview]],
    blocks: Sequence[str] | None,
    *,
    whole: bool = False,
    cover: Sequence[tuple[int, int]] = (),
) -> float:
    """Read the byte ranges ``wanted`` (sorted ``(offset, view)``) from ``source`` into their views;
    with ``blocks``, read the whole blocks around them (all with ``whole``; those around the
    ``cover`` ranges too, into scratch) and check each. Returns this thread's CPU seconds."""
    cpu = time.thread_time()
    scratch = memoryview(bytearray(PIECE_SIZE))
    wanted = [(offset, view) for offset, view in wanted if len(view)]
    ranges = [(offset, len(view)) for offset, view in wanted]
    if whole and source.size:
        spans = [(0, source.size)]
    elif blocks is None:  # nothing to check: exactly the bytes wanted
        spans = _spans(ranges, source.size, 1)
    else:
        spans = _spans([*ranges, *cover], source.size, BLOCK_SIZE)
    cursor = 0
    for span_start, span_end in spans:
        regions, cursor = _regions(wanted, cursor, span_start, span_end)
        hasher = block_hasher()
        for offset, block, views in _walk(regions, span_start, span_end, scratch):
            source.readinto(offset, views)
            if blocks is None:
                continue
            for view in views:
                hasher.update(view)
            if offset + sum(len(v) for v in views) == min(span_end, (block + 1) * BLOCK_SIZE):
                if block >= len(blocks) or hasher.hexdigest() != blocks[block]:
                    raise CheckpointError(f"{source.name} is corrupt (checksum mismatch in block {block})")
                hasher = block_hasher()
    return time.thread_time() - cpu


def _spans(ranges: Sequence[tuple[int, int]], size: int, align: int) -> list[tuple[int, int]]:
    """Spans covering ``ranges``, aligned to ``align`` bytes: touching ones merged into one span."""
    spans: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        if not length:
            continue
        first = offset // align * align
        last = min(size, -(-(offset + length) // align) * align)
        if spans and first <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], last))
        else:
            spans.append((first, last))
    return spans


def _regions(
    wanted: Sequence[tuple[int, memoryview]], first: int, start: int, end: int
) -> tuple[list[tuple[int, memoryview | None]], int]:
    """``[start, end)`` as gapless regions: the wanted views from index ``first`` on that lie in
    it, and None between them; and the index of the first wanted view after it (each span is
    walked once: a file of 10,000 tensors must not cost 10,000 passes over them)."""
    regions: list[tuple[int, memoryview | None]] = []
    at = start
    index = first
    while index < len(wanted) and wanted[index][0] < end:
        offset, view = wanted[index]
        index += 1
        if offset + len(view) <= start:
            continue
        if offset > at:
            regions.append((at, None))
        regions.append((offset, view))
        at = offset + len(view)
    if at < end or not regions:
        regions.append((at, None))
    return regions, index


def exchange_paths(a: str, b: str) -> bool:
    """Swap two paths atomically with Linux renameat2(RENAME_EXCHANGE); False only where it is not
    offered (any other failure is raised). A file system that ignores the flag renames instead,
    which fails onto a step; the caller checks that ``a`` still exists after a success."""
    import ctypes.util

    try:
        fault_point("file.exchange", a, b)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    # ENOTEMPTY, EEXIST: the file system took the call for a plain rename onto a non-empty
    # directory (SeaweedFS's FUSE mount does: it ignores the flag), which an exchange never is.
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOTEMPTY, errno.EEXIST):
        return False
    raise OSError(code, os.strerror(code), a, None, b)
