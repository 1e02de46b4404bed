"""How fast a checkpoint target is, what holds it, and what to change there: ``nbckpt probe``.

    >>> result = probe("/mnt/flashblade/ckpt", size_mb=64, checkpoint_bytes=2 * 10**9)
    >>> print(result.summary()); result.to_pandas()      # streams, write_gbs, read_gbs, ...

Its writes are the write floor's (:func:`nbckpt.bench.measure_write`); each piece of advice names
the measured or mounted value it comes from."""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from .._errors import ConfigError
from .._util import GB, MIB, check_count, format_bytes, is_url
from ..engine._internal import endpoint, fsspec_options
from ._measure import DEFAULT_REPEATS, StreamRun, fsync_latencies, scratch, stream_counts, stream_runs

__all__ = ["MountInfo", "ProbeResult", "mount_info", "probe"]

# FUSE counts too: a checkpoint directory on FUSE is nearly always on sshfs, s3fs, gcsfuse, juicefs...
_NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "ceph", "lustre", "gpfs", "beegfs", "9p"})


@dataclass(frozen=True)
class MountInfo:
    """The mount holding a path; ``options`` are the mount's and its superblock's (NFS's ``nconnect``)."""

    source: str
    mount_point: str
    fstype: str
    options: dict[str, str | None]

    @property
    def kind(self) -> str:
        """``memory`` (lost at reboot), ``network`` or ``local``."""
        if self.fstype in ("tmpfs", "ramfs"):
            return "memory"
        return "network" if self.fstype in _NETWORK_FS or self.fstype.startswith("fuse.") else "local"


def _unescape(text: str) -> str:
    r"""Undo the kernel's octal escapes (``\040`` space, ``\011`` tab, ``\012`` newline, ``\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), text)


def mount_info(path: str | os.PathLike[str], mountinfo: str | None = None) -> MountInfo:
    """The mount holding ``path`` (which need not exist yet): the longest mount point that
    contains it, the last of several stacked on one point. ``mountinfo`` is the text of
    ``/proc/self/mountinfo``, for tests."""
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as stream:
            mountinfo = stream.read()
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    best: MountInfo | None = None
    for line in mountinfo.splitlines():
        # id parent major:minor root mount-point options [optional...] - fstype source super-options
        fields = line.split()
        dash = fields.index("-", 6) if "-" in fields[6:] else len(fields)
        if len(fields) < dash + 4:
            raise ConfigError(f"not a mountinfo line: {line!r}")
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.mount_point)):
            pairs = (item.partition("=") for item in f"{fields[5]},{fields[dash + 3]}".split(","))
            options = {key: value if sep else None for key, sep, value in pairs}
            best = MountInfo(_unescape(fields[dash + 2]), point, fields[dash + 1], options)
    if best is None:
        raise ConfigError(f"no mount found for {target} in /proc/self/mountinfo")
    return best


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
    cache_dropped: bool | None = None  # reads came from storage (checked); None: object GETs
    checkpoint_bytes: int | None = None
    repeats: int = 1
    elapsed_s: float = 0.0
    advice: list[str] = field(default_factory=list)

    def best(self) -> StreamRun:
        """The stream count with the highest write bandwidth."""
        return max(self.runs, key=lambda run: run.write_gbs)

    def to_pandas(self) -> pd.DataFrame:
        """One row per stream count: streams, bytes, write_gbs, read_gbs, write_s, read_s."""
        columns = ["streams", "bytes", "write_gbs", "read_gbs", "write_s", "read_s"]
        return pd.DataFrame([[getattr(run, name) for name in columns] for run in self.runs], columns=columns)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "runs": self.to_pandas().to_dict(orient="records")}

    def summary(self) -> str:
        """A few lines of text: what the target is, the measured table, and the advice."""
        lines = [f"Storage probe of {self.target}: {self.kind} ({self.fstype}, {self.source})"]
        if self.kind != "object":
            options = ",".join(k if v is None else f"{k}={v}" for k, v in self.options.items())
            lines.append(f"  mounted on {self.mount_point}: {options}")
        if self.free_bytes is not None and self.total_bytes:
            lines.append(f"  free space: {format_bytes(self.free_bytes)} of {format_bytes(self.total_bytes)}")
        reads = {
            None: "reads are object GETs (no page cache)",
            True: "page cache dropped before reading (posix_fadvise, checked with mincore)",
            False: "page cache could NOT be dropped: read figures may be memory speed",
        }
        lines.append(
            f"  {self.size_bytes / MIB:,.0f} MiB written and read back per stream count, best of "
            f"{self.repeats} ({self.elapsed_s:.1f} s in all); {reads[self.cache_dropped]}"
        )
        lines.append("  streams  write GB/s  read GB/s")
        lines.extend(f"  {run.streams:7d}  {run.write_gbs:10.3f}  {run.read_gbs:9.3f}" for run in self.runs)
        if self.fsync_ms is not None:
            lines.append(f"  fsync of 4 KiB: median {self.fsync_ms:.2f} ms, p95 {self.fsync_p95_ms:.2f} ms")
        return "\n".join([*lines, "Advice:", *(f"  - {item}" for item in self.advice)])


def _advice(result: ProbeResult) -> list[str]:
    """Plain-words advice, each item tied to a measured or mounted value of ``result``."""
    advice: list[str] = []
    best, first, size, free = result.best(), result.runs[0], result.checkpoint_bytes, result.free_bytes
    if best.streams > first.streams and best.write_gbs > 1.25 * first.write_gbs:
        advice.append(
            f"{first.streams} stream(s) wrote {first.write_gbs:.2f} GB/s, {best.streams} streams "
            f"{best.write_gbs:.2f} GB/s: use Checkpointer(..., writer_threads={best.streams}) so "
            "one rank writes several files at once."
        )
    elif len(result.runs) > 1:
        advice.append(
            f"{first.streams} stream(s) already reached {first.write_gbs:.2f} GB/s (best "
            f"{best.write_gbs:.2f} GB/s with {best.streams}): more writer threads do not pay "
            "off here; keep writer_threads at 1 or 2."
        )
    if size and best.write_gbs > 0:
        advice.append(
            f"At {best.write_gbs:.2f} GB/s a {format_bytes(size)} checkpoint takes about "
            f"{size / (best.write_gbs * GB):.3g} s to persist: checkpoint less often than that, "
            "or saves queue up (async mode hides the write, not the bandwidth)."
        )
    if size and free is not None and free < 2 * size:
        advice.append(
            f"Free space {format_bytes(free)} is below twice the checkpoint ({format_bytes(size)}"
            + (
                "): saves will fail with ENOSPC."
                if free < size
                else "): a new checkpoint is "
                "written before the old one is deleted, so keep room for keep+1 of them."
            )
        )
    if result.kind == "memory":
        advice.append(
            f"{result.mount_point} is {result.fstype}: it lives in RAM and is lost at reboot. "
            "Good for experiments; not for protecting a run."
        )
    nconnect = result.options.get("nconnect") or "1"
    if result.fstype.startswith("nfs") and (not nconnect.isdigit() or int(nconnect) < 2):
        advice.append(
            "NFS mount without nconnect: one TCP connection, often a client's limit. Remount with "
            "nconnect=8 or 16 (Linux 5.3+; Pure measured about 10 Gbps with one connection and 70 "
            "with 16 reading from a FlashBlade; see docs/storage.md)."
        )
    if result.fsync_ms is not None and result.fsync_ms > 10:
        advice.append(
            f"fsync takes {result.fsync_ms:.1f} ms (median): every checkpoint file and "
            "directory is fsynced, so use mode='async' to keep it off the training loop."
        )
    return advice or ["Nothing to change: the measured figures and mount options look fine."]


def probe(
    target: str | os.PathLike[str],
    *,
    size_mb: float = 64.0,
    streams: Sequence[int] = (1, 2, 4, 8),
    checkpoint_bytes: int | None = None,
    repeats: int = DEFAULT_REPEATS,
    storage_options: dict[str, Any] | None = None,
) -> ProbeResult:
    """Measure a directory (local, NFS, tmpfs...) or an ``s3://`` URL, and advise: ``size_mb`` is
    written (and read back) ``repeats`` times per stream count, split over the streams, the fastest
    round counting; ``checkpoint_bytes`` turns on the free-space and time-to-persist advice. Leaves
    nothing behind; ConfigError for bad arguments, CheckpointError if the target cannot be written."""
    if not isinstance(size_mb, (int, float)) or not size_mb > 0:
        raise ConfigError(f"size_mb must be a positive number, not {size_mb!r}")
    counts = stream_counts(streams)
    check_count(repeats, "repeats")
    if checkpoint_bytes is not None and checkpoint_bytes < 0:
        raise ConfigError(f"checkpoint_bytes must be non-negative, not {checkpoint_bytes!r}")
    began, target, size = time.perf_counter(), os.fspath(target), int(size_mb * MIB)
    url = is_url(target)
    options = fsspec_options(target.split("://", 1)[0], storage_options) if url else {}
    path = target if url else os.path.abspath(os.path.expanduser(target.removeprefix("file://")))
    # an object store shows its protocol as type and its endpoint as source
    mount = (
        MountInfo(endpoint(options) or "AWS default endpoint", "", path.split("://")[0], {})
        if url
        else mount_info(path)
    )
    with scratch(path, storage_options, "probing") as (fs, work):
        usage = None if url else shutil.disk_usage(path)
        runs, cached = stream_runs(fs, work, size, streams=counts, repeats=repeats, read_back=True)
        fsyncs = fsync_latencies(os.path.join(work, "fsync")) if fs is None else []
    result = ProbeResult(
        target=path,
        kind="object" if url else mount.kind,
        fstype=mount.fstype,
        source=mount.source,
        mount_point=mount.mount_point,
        options=mount.options,
        free_bytes=usage.free if usage else None,
        total_bytes=usage.total if usage else None,
        size_bytes=size,
        runs=runs,
        fsync_ms=statistics.median(fsyncs) if fsyncs else None,
        fsync_p95_ms=sorted(fsyncs)[math.ceil(0.95 * len(fsyncs)) - 1] if fsyncs else None,
        cache_dropped=None if url else bool(cached) and max(cached) < 0.1,
        checkpoint_bytes=checkpoint_bytes,
        repeats=repeats,
        elapsed_s=time.perf_counter() - began,
    )
    result.advice = _advice(result)
    return result
