"""What a checkpoint target is and what it can do: mount facts, measured bandwidth, advice.

    >>> result = probe("/mnt/flashblade/ckpt", size_mb=64, checkpoint_bytes=2 * 10**9)
    >>> print(result.summary()); result.to_pandas()      # streams, write_gbs, read_gbs, ...
    $ nbckpt probe /mnt/flashblade/ckpt --size-mb 256
    $ nbckpt probe s3://bucket/prefix --endpoint-url http://flashblade-data:80

Every figure is measured with real files (or objects), real fsyncs and a bounded size,
and every piece of advice names the measured or mounted value it comes from.

The write measurement is :func:`measure_write`: ``bytes`` split over ``streams`` threads, each
writing its own file in 4 MiB ``os.write`` calls and ending with ``fsync`` (objects: multipart
uploads), the fastest of ``repeats`` rounds per stream count. The probe uses it for its write
column and ``nbckpt.bench.measure_floors`` for the raw write floor, so the two agree on
method; they differ only in the sizes and stream counts they are given.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import pandas as pd

from .._errors import CheckpointError, ConfigError
from .._util import MIB, endpoint, explain_fsspec_error, fsspec_options, is_url, where

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_SIZE_MB",
    "DEFAULT_STREAMS",
    "MountInfo",
    "ProbeResult",
    "StreamRun",
    "measure_write",
    "mount_info",
    "parse_mount_line",
    "probe",
    "storage_advice",
]

DEFAULT_SIZE_MB = 64.0
DEFAULT_STREAMS = (1, 2, 4, 8)
DEFAULT_REPEATS = 2
MiB = MIB
_CHUNK = 4 * MiB  # os.write size: large writes, as DCP's writer makes
_S3_PART = 8 * MiB  # multipart part size for the object probe (S3's minimum is 5 MiB)
_SMALL_FILES = 100  # files (or objects) for the create/rename/delete rates
_FSYNCS = 20  # 4 KiB write+fsync rounds for the latency
_PHASE_LIMIT_S = 3.0  # a slow metadata or fsync phase stops early; rates stay exact

MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "9p", "afs", "orangefs", "pvfs2", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
    "fuse.goofys", "fuse.juicefs", "fuse.blobfuse2", "fuse.mountpoint-s3", "fuse.glusterfs",
    "fuse.ceph-fuse", "fuse.weka", "fuse.cvmfs",
})
# NFS mount options that decide checkpoint throughput and failure behaviour.
NFS_KEYS = (
    "vers", "nconnect", "rsize", "wsize", "proto", "hard", "soft", "timeo", "retrans",
    "actimeo", "acregmin", "acregmax", "acdirmin", "acdirmax", "noac", "sec", "addr",
)


# -- mounts -------------------------------------------------------------------------------------


def _unescape(field_text: str) -> str:
    r"""Undo /proc/mounts octal escapes (``\040`` space, ``\011`` tab, ``\012`` newline, ``\134``)."""
    out, i = [], 0
    while i < len(field_text):
        octal = field_text[i + 1 : i + 4]
        if field_text[i] == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/mounts``: what is mounted where, how."""

    source: str
    mount_point: str
    fstype: str
    options: dict[str, str | None]

    @property
    def kind(self) -> str:
        """``memory`` (lost at reboot), ``network`` or ``local``."""
        if self.fstype in MEMORY_FS:
            return "memory"
        if self.fstype in NETWORK_FS or self.fstype.startswith("nfs"):
            return "network"
        if self.fstype.startswith("fuse.") and ":" in self.source:  # host:path, as sshfs
            return "network"
        return "local"

    @property
    def is_nfs(self) -> bool:
        return self.fstype.startswith("nfs")

    @property
    def nfs_options(self) -> dict[str, str | None]:
        """The NFS options that matter for checkpoints (empty for other filesystems)."""
        if not self.is_nfs:
            return {}
        return {key: self.options[key] for key in NFS_KEYS if key in self.options}

    def option_int(self, key: str) -> int | None:
        value = self.options.get(key)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None


def parse_mount_line(line: str) -> MountInfo:
    """Parse one ``/proc/mounts`` (fstab-format) line; ConfigError if it is not one."""
    fields = line.split()
    if len(fields) < 4:
        raise ConfigError(f"not a mount line (need source, mount point, type, options): {line!r}")
    options: dict[str, str | None] = {}
    for item in _unescape(fields[3]).split(","):
        if item:
            key, sep, value = item.partition("=")
            options[key] = value if sep else None
    return MountInfo(
        source=_unescape(fields[0]),
        mount_point=_unescape(fields[1]),
        fstype=fields[2],
        options=options,
    )


def mount_info(path: str | os.PathLike[str], mounts: str | None = None) -> MountInfo:
    """The mount holding ``path``: the longest mount point that contains it (the last one wins
    when several are stacked on the same point). ``mounts`` is /proc/mounts text (for tests)."""
    if mounts is None:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as stream:
            mounts = stream.read()
    # realpath resolves the links of the part that exists; a target need not exist yet.
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    best: MountInfo | None = None
    for line in mounts.splitlines():
        if not line.strip():
            continue
        entry = parse_mount_line(line)
        point = entry.mount_point.rstrip("/") or "/"
        inside = target == point or target.startswith(point if point == "/" else point + "/")
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = entry
    if best is None:
        raise ConfigError(f"no mount found for {target} in /proc/mounts")
    return best


# -- the result ---------------------------------------------------------------------------------


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
        return self.bytes / self.write_s / 1e9 if self.write_s > 0 else math.nan

    @property
    def read_gbs(self) -> float:
        return self.bytes / self.read_s / 1e9 if self.read_s else math.nan


@dataclass
class ProbeResult:
    """What :func:`probe` found. Bandwidths in GB/s (1e9 bytes), times in ms or s as named."""

    target: str
    kind: str  # local | network | memory | object
    fstype: str
    source: str
    mount_point: str
    options: dict[str, str | None]
    free_bytes: int | None
    total_bytes: int | None
    size_bytes: int
    runs: list[StreamRun]
    fsync_ms: float | None = None
    fsync_p95_ms: float | None = None
    create_per_s: float | None = None
    rename_per_s: float | None = None
    delete_per_s: float | None = None
    cache_dropped: bool | None = None
    """True: reads came from storage (page cache dropped and checked with mincore);
    False: they may have come from memory; None: no page cache involved (object store)."""
    checkpoint_bytes: int | None = None
    repeats: int = 1
    elapsed_s: float = 0.0
    advice: list[str] = field(default_factory=list)

    @property
    def mount(self) -> MountInfo:
        return MountInfo(self.source, self.mount_point, self.fstype, self.options)

    @property
    def nfs(self) -> dict[str, str | None]:
        return self.mount.nfs_options

    def best(self) -> StreamRun | None:
        """The stream count with the highest write bandwidth."""
        return max(self.runs, key=lambda run: run.write_gbs) if self.runs else None

    def to_pandas(self) -> pd.DataFrame:
        """One row per stream count: streams, bytes, write_gbs, read_gbs, write_s, read_s."""
        rows = [
            {
                "streams": run.streams, "bytes": run.bytes, "write_gbs": run.write_gbs,
                "read_gbs": run.read_gbs, "write_s": run.write_s, "read_s": run.read_s,
            }
            for run in self.runs
        ]
        columns = ["streams", "bytes", "write_gbs", "read_gbs", "write_s", "read_s"]
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["runs"] = self.to_pandas().to_dict(orient="records")
        body["nfs"] = self.nfs
        return body

    def to_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as stream:
            json.dump(self.to_dict(), stream, indent=1, default=str)

    def summary(self) -> str:
        """A few lines of text: what the target is, the measured table, and the advice."""
        lines = [f"Storage probe of {self.target}: {self.kind} ({self.fstype}, {self.source})"]
        if self.kind != "object":
            lines.append(f"  mounted on {self.mount_point}: {_options_text(self.options)}")
        if self.nfs:
            lines.append(f"  NFS: {_options_text(self.nfs)}")
        if self.free_bytes is not None and self.total_bytes:
            lines.append(f"  free space: {_gb(self.free_bytes)} of {_gb(self.total_bytes)}")
        lines.append(
            f"  {_mib(self.size_bytes)} written and read back per stream count, best of "
            f"{self.repeats} ({self.elapsed_s:.1f} s in all); {_cache_text(self.cache_dropped, self.kind)}"
        )
        lines.append("  streams  write GB/s  read GB/s")
        for run in self.runs:
            lines.append(f"  {run.streams:7d}  {run.write_gbs:10.3f}  {run.read_gbs:9.3f}")
        if self.fsync_ms is not None:
            lines.append(f"  fsync of 4 KiB: median {self.fsync_ms:.2f} ms, p95 {self.fsync_p95_ms:.2f} ms")
        rates = [
            f"{rate:,.0f} {name}/s"
            for name, rate in (("creates", self.create_per_s), ("renames", self.rename_per_s),
                               ("deletes", self.delete_per_s))
            if rate is not None
        ]
        if rates:
            what = "small objects" if self.kind == "object" else "small files"
            lines.append(f"  {what}: {', '.join(rates)}")
        lines.append("Advice:")
        lines.extend(f"  - {item}" for item in self.advice)
        return "\n".join(lines)


def _streams(count: int) -> str:
    return "1 stream" if count == 1 else f"{count} streams"


def _gb(nbytes: float) -> str:
    """Bytes in decimal units, GB for anything a checkpoint target holds, MB below that."""
    return f"{nbytes / 1e9:,.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


def _mib(nbytes: float) -> str:
    return f"{nbytes / MiB:,.0f} MiB"


def _options_text(options: dict[str, str | None]) -> str:
    return ",".join(key if value is None else f"{key}={value}" for key, value in options.items())


def _cache_text(dropped: bool | None, kind: str) -> str:
    if dropped is None:
        return "reads are object GETs (no page cache)"
    if kind == "memory":
        return "a memory filesystem: reads are memory speed"
    if dropped:
        return "page cache dropped before reading (posix_fadvise, checked with mincore)"
    return "page cache could NOT be dropped: read figures may be memory speed"


# -- advice ---------------------------------------------------------------------------------------


def storage_advice(result: ProbeResult) -> list[str]:
    """Plain-words advice, each item tied to a measured or mounted value of ``result``."""
    advice: list[str] = []
    best, first = result.best(), (result.runs[0] if result.runs else None)
    if best is not None and first is not None:
        if best.streams > first.streams and best.write_gbs > 1.25 * first.write_gbs:
            advice.append(
                f"{_streams(first.streams)} wrote {first.write_gbs:.2f} GB/s, {best.streams} streams "
                f"{best.write_gbs:.2f} GB/s: use Checkpointer(..., writer_threads={best.streams}) "
                "so one rank writes several files at once."
            )
        elif len(result.runs) > 1:
            advice.append(
                f"{_streams(first.streams)} already reached {first.write_gbs:.2f} GB/s (best "
                f"{best.write_gbs:.2f} GB/s with {best.streams}): more writer threads do not pay off "
                "here; keep writer_threads at 1 or 2."
            )
    if result.checkpoint_bytes and best is not None and best.write_gbs > 0:
        seconds = result.checkpoint_bytes / (best.write_gbs * 1e9)
        advice.append(
            f"At {best.write_gbs:.2f} GB/s a {_gb(result.checkpoint_bytes)} checkpoint takes about "
            f"{seconds:.3g} s to persist: checkpoint less often than that, or saves queue up "
            "(async mode hides the write, not the bandwidth)."
        )
    if result.checkpoint_bytes and result.free_bytes is not None:
        if result.free_bytes < result.checkpoint_bytes:
            advice.append(
                f"Free space {_gb(result.free_bytes)} is less than one checkpoint "
                f"({_gb(result.checkpoint_bytes)}): saves will fail with ENOSPC."
            )
        elif result.free_bytes < 2 * result.checkpoint_bytes:
            advice.append(
                f"Free space {_gb(result.free_bytes)} is less than twice the checkpoint "
                f"({_gb(result.checkpoint_bytes)}): a new checkpoint is written before the old one "
                "is deleted, so keep room for keep+1 checkpoints."
            )
    advice.extend(_mount_advice(result))
    if result.cache_dropped is False and result.kind != "memory":
        advice.append(
            "The page cache could not be dropped after writing, so read figures may be memory "
            "speed, not storage speed."
        )
    if result.fsync_ms is not None and result.fsync_ms > 10:
        advice.append(
            f"fsync takes {result.fsync_ms:.1f} ms (median): every checkpoint file and directory is "
            "fsynced, so use mode='async' to keep this off the training loop."
        )
    if result.create_per_s is not None and result.create_per_s < 200:
        what = "small-object PUTs" if result.kind == "object" else "file creates"
        advice.append(
            f"Only {result.create_per_s:,.0f} {what}/s: each checkpoint costs a few of them "
            "(data files, metadata, manifest) plus the retention deletes, so keep the number of "
            "files per checkpoint small (writer_threads of 8 or less) and checkpoint no more often "
            "than the measured bandwidth allows."
        )
    if not advice:
        advice.append("Nothing to change: the measured figures and mount options look fine.")
    return advice


def _mount_advice(result: ProbeResult) -> list[str]:
    advice = []
    if result.kind == "memory":
        advice.append(
            f"{result.mount_point} is {result.fstype}: it lives in RAM (and counts against it) and "
            "is lost at reboot or power loss. Good for experiments; not for protecting a run."
        )
    if result.fstype == "overlay":
        advice.append(
            "This is a container's overlay filesystem: checkpoints vanish with the container. "
            "Mount a volume (or the shared storage) for the checkpoint directory."
        )
    if result.fstype.startswith("fuse."):
        advice.append(
            f"{result.fstype} is a FUSE filesystem: fsync and rename guarantees depend on its driver."
            + (" For object storage use the s3:// URL directly." if result.kind == "network" else "")
        )
    if result.kind == "object":
        advice.append(
            "Object store: no rename, so nbckpt commits by writing manifest.json after all data. "
            "A dead endpoint fails a save at once, a hung one only after read_timeout x attempts "
            "(storage_options config_kwargs; see docs/storage.md)."
        )
    mount = result.mount
    if not mount.is_nfs:
        return advice
    options = mount.options
    nconnect = mount.option_int("nconnect")
    if nconnect is None or nconnect < 2:
        advice.append(
            "NFS mount without nconnect: all traffic goes over one TCP connection, often the limit "
            "of a single client. Remount with nconnect=8 or 16 (Linux 5.3 or later): the client "
            "spreads its RPCs over the connections (Pure measured about 10 Gbps with one and 70 "
            "Gbps with nconnect=16 reading from a FlashBlade; see docs/storage.md)."
        )
    for key in ("rsize", "wsize"):
        size = mount.option_int(key)
        if size is not None and size < MiB:
            advice.append(f"{key}={size} is below 1 MiB: mount with {key}=1048576 for large checkpoint I/O.")
    if "soft" in options:
        advice.append(
            "soft mount: a slow server makes writes fail with EIO after retrans timeouts; use hard "
            "(the default) so a server hiccup delays a save instead of failing it."
        )
    if (options.get("proto") or "").startswith("udp"):
        advice.append("proto=udp: use TCP (proto=tcp) for large writes.")
    if options.get("vers") in ("4", "4.0"):
        advice.append(
            f"vers={options.get('vers')}: NFS v4.0 has no sessions; use v4.1 or v3 where the server "
            "offers them (FlashBlade serves both)."
        )
    return advice


# -- measuring a directory ------------------------------------------------------------------------


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


def _write_file(path: str, nbytes: int, pattern: memoryview, salt: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        done, index = 0, salt * 7919
        while done < nbytes:
            chunk = _slice(pattern, index, min(_CHUNK, nbytes - done))
            while chunk:
                written = os.write(fd, chunk)
                chunk, done = chunk[written:], done + written
            index += 1
        os.fsync(fd)
        with suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _write_nth(paths: list[str], nbytes: int, pattern: memoryview, index: int) -> None:
    _write_file(paths[index], nbytes, pattern, index)


def _stream_files(work: str, size: int, count: int) -> tuple[list[str], int]:
    """The ``count`` files ``size`` bytes are split over, and each one's share."""
    return [os.path.join(work, f"stream-{count}-{i}") for i in range(count)], max(size // count, 4096)


def _write_round(files: list[str], share: int, pattern: memoryview) -> float:
    """One measured round: every file written in its own thread, each ending with fsync."""
    return _in_threads(len(files), partial(_write_nth, files, share, pattern))


def _read_nth(paths: list[str], index: int) -> None:
    _read_file(paths[index])


def _read_file(path: str) -> None:
    buffer = bytearray(_CHUNK)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while os.readv(fd, [buffer]) > 0:
            pass
    finally:
        os.close(fd)


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


def _probe_directory(
    path: str, size: int, streams: Sequence[int], repeats: int, checkpoint_bytes: int | None
) -> ProbeResult:
    began = time.perf_counter()
    created = _missing_parts(path)
    try:
        os.makedirs(path, exist_ok=True)
        work = os.path.join(path, f".nbckpt-probe-{uuid.uuid4().hex[:8]}")
        os.mkdir(work)
    except OSError as exc:
        raise ConfigError(f"cannot probe {path}: {exc.strerror or exc}") from exc
    mount = mount_info(path)
    usage = shutil.disk_usage(path)
    runs: list[StreamRun] = []
    residents: list[float] = []
    try:
        pattern = _pattern(min(_CHUNK, size))
        for count in streams:
            files, share = _stream_files(work, size, count)
            writes, reads = [], []
            for _ in range(repeats):
                writes.append(_write_round(files, share, pattern))
                fraction = _resident_fraction(files[0])
                if fraction is not None:
                    residents.append(fraction)
                reads.append(_in_threads(count, partial(_read_nth, files)))
            runs.append(StreamRun(count, share * count, min(writes), min(reads), tuple(writes)))
            for name in files:
                os.unlink(name)
        fsyncs = _fsync_latencies(os.path.join(work, "fsync"))
        create, rename, delete = _metadata_rates(work)
    except OSError as exc:
        raise CheckpointError(f"probing {path} failed: {exc.strerror or exc} ({exc.filename})") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        for folder in created:  # leave no directory the probe made
            with suppress(OSError):
                os.rmdir(folder)
    result = ProbeResult(
        target=path, kind=mount.kind, fstype=mount.fstype, source=mount.source,
        mount_point=mount.mount_point, options=mount.options, free_bytes=usage.free,
        total_bytes=usage.total, size_bytes=size, runs=runs,
        fsync_ms=statistics.median(fsyncs), fsync_p95_ms=_p95(fsyncs),
        create_per_s=create, rename_per_s=rename, delete_per_s=delete,
        cache_dropped=(max(residents) < 0.1) if residents else False,
        checkpoint_bytes=checkpoint_bytes, repeats=repeats, elapsed_s=time.perf_counter() - began,
    )
    result.advice = storage_advice(result)
    return result


def _missing_parts(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, deepest first."""
    missing = []
    while not os.path.exists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _fsync_latencies(path: str) -> list[float]:
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


def _metadata_rates(work: str) -> tuple[float, float, float]:
    """Creates, renames and deletes per second of small files (what a commit does)."""
    folder = os.path.join(work, "meta")
    os.mkdir(folder)
    names: list[str] = []

    def create(i: int) -> None:
        name = os.path.join(folder, f"f{i}")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        os.write(fd, b"nbckpt probe\n")
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


# -- measuring an object store --------------------------------------------------------------------


def _upload_round(fs: Any, keys: list[str], share: int, pattern: memoryview) -> float:
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


def _probe_object_store(
    url: str, size: int, streams: Sequence[int], repeats: int,
    storage_options: dict[str, Any] | None, checkpoint_bytes: int | None,
) -> ProbeResult:
    from fsspec.core import url_to_fs

    began = time.perf_counter()
    protocol = url.split("://", 1)[0]
    options = fsspec_options(protocol, storage_options)
    try:
        fs, root = url_to_fs(url.rstrip("/"), **options)
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot open {url}: {exc}") from exc
    work = f"{root.rstrip('/')}/.nbckpt-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(f"{work}/hello", b"nbckpt")
    except Exception as exc:
        raise CheckpointError(
            f"{where(url, options)} is not writable ({explain_fsspec_error(exc, root)})"
        ) from exc
    runs: list[StreamRun] = []
    try:
        pattern = _pattern(min(_S3_PART, size))
        for count in streams:
            share = max(size // count, 1)
            keys = [f"{work}/stream-{count}-{i}" for i in range(count)]

            def download(i: int, keys: list[str] = keys) -> None:
                fs.cat_file(keys[i])

            writes, reads = [], []
            for _ in range(repeats):
                writes.append(_upload_round(fs, keys, share, pattern))
                reads.append(_in_threads(count, download))
            runs.append(StreamRun(count, share * count, min(writes), min(reads), tuple(writes)))
            fs.rm(keys)
        small = [f"{work}/small-{i}" for i in range(_SMALL_FILES)]
        put_rate = _timed_ops(len(small), lambda i: fs.pipe_file(small[i], b"nbckpt probe\n"))
        fs.invalidate_cache()
        written = [key for key in small if fs.exists(key)]
        delete_rate = _timed_ops(len(written), lambda i: fs.rm_file(written[i]))
    except Exception as exc:
        raise CheckpointError(
            f"probing {where(url, options)} failed ({explain_fsspec_error(exc, root)})"
        ) from exc
    finally:
        with suppress(Exception):
            fs.rm(work, recursive=True)
    result = ProbeResult(
        target=url, kind="object", fstype=protocol, source=endpoint(options) or "AWS default endpoint",
        mount_point="", options={}, free_bytes=None, total_bytes=None, size_bytes=size,
        runs=runs, create_per_s=put_rate, delete_per_s=delete_rate, cache_dropped=None,
        checkpoint_bytes=checkpoint_bytes, repeats=repeats, elapsed_s=time.perf_counter() - began,
    )
    result.advice = storage_advice(result)
    return result


# -- the write measurement on its own (the raw write floor) ---------------------------------------


def measure_write(
    target: str | os.PathLike[str],
    nbytes: int,
    streams: Sequence[int] = (1,),
    repeats: int = DEFAULT_REPEATS,
    storage_options: dict[str, Any] | None = None,
) -> list[StreamRun]:
    """Write ``nbytes`` split over each stream count, exactly as :func:`probe` writes.

    One :class:`StreamRun` per stream count (``read_s`` is None): the fastest of ``repeats``
    rounds, every round kept in ``write_rounds_s``. Files end with fsync, objects with a
    completed (multipart) upload; everything written is removed. ``target`` must exist.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ConfigError(f"the write measurement needs a positive number of bytes, not {nbytes!r}")
    counts = list(streams)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ConfigError(f"streams must be positive integers, not {streams!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, not {repeats!r}")
    text = os.fspath(target)
    runs: list[StreamRun] = []
    if is_url(text):
        from fsspec.core import url_to_fs

        protocol = text.split("://", 1)[0]
        fs, root = url_to_fs(text.rstrip("/"), **fsspec_options(protocol, storage_options))
        work = f"{root.rstrip('/')}/.nbckpt-floor-{uuid.uuid4().hex[:8]}"
        pattern = _pattern(min(_S3_PART, nbytes))
        try:
            for count in counts:
                share = max(nbytes // count, 1)
                keys = [f"{work}/stream-{count}-{i}" for i in range(count)]
                rounds = [_upload_round(fs, keys, share, pattern) for _ in range(repeats)]
                runs.append(StreamRun(count, share * count, min(rounds), None, tuple(rounds)))
        finally:
            with suppress(Exception):
                fs.rm(work, recursive=True)
        return runs
    work = os.path.join(text.removeprefix("file://"), f".nbckpt-floor-{uuid.uuid4().hex[:8]}")
    os.mkdir(work)
    try:
        pattern = _pattern(min(_CHUNK, nbytes))
        for count in counts:
            files, share = _stream_files(work, nbytes, count)
            rounds = [_write_round(files, share, pattern) for _ in range(repeats)]
            runs.append(StreamRun(count, share * count, min(rounds), None, tuple(rounds)))
            for name in files:
                os.unlink(name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return runs


# -- the entry points -----------------------------------------------------------------------------


def probe(
    path_or_url: str | os.PathLike[str],
    size_mb: float = DEFAULT_SIZE_MB,
    streams: Sequence[int] = DEFAULT_STREAMS,
    storage_options: dict[str, Any] | None = None,
    checkpoint_bytes: int | None = None,
    repeats: int = DEFAULT_REPEATS,
) -> ProbeResult:
    """Measure a directory (local, NFS, tmpfs...) or an ``s3://`` URL, and advise.

    ``size_mb`` is written (and read back) ``repeats`` times per stream count, split over
    the streams; the fastest round counts (other load only ever slows a round down).
    ``checkpoint_bytes`` (optional) turns on the free-space and time-to-persist advice.
    Leaves nothing behind; raises ConfigError for bad arguments, CheckpointError if the
    target cannot be written.
    """
    if not isinstance(size_mb, (int, float)) or not size_mb > 0:
        raise ConfigError(f"size_mb must be a positive number, not {size_mb!r}")
    counts = list(streams)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ConfigError(f"streams must be positive integers, not {streams!r}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, not {repeats!r}")
    if checkpoint_bytes is not None and checkpoint_bytes < 0:
        raise ConfigError(f"checkpoint_bytes must be non-negative, not {checkpoint_bytes!r}")
    size = int(size_mb * MiB)
    target = os.fspath(path_or_url)
    if is_url(target):
        return _probe_object_store(target, size, counts, repeats, storage_options, checkpoint_bytes)
    path = os.path.abspath(os.path.expanduser(target.removeprefix("file://")))
    return _probe_directory(path, size, counts, repeats, checkpoint_bytes)
