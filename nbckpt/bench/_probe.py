"""What a checkpoint target is and what it can do: mount facts, measured bandwidth, advice.

    >>> result = probe("/mnt/flashblade/ckpt", size_mb=64, checkpoint_bytes=2 * 10**9)
    >>> print(result.summary()); result.to_pandas()      # streams, write_gbs, read_gbs, ...
    $ nbckpt probe /mnt/flashblade/ckpt --size-mb 256
    $ nbckpt probe s3://bucket/prefix --endpoint-url http://flashblade-data:80

Every figure is measured with real files (or objects), real fsyncs and a bounded size
(:mod:`._measure`), and every piece of advice names the measured or mounted value it comes
from (:mod:`._advice`). The probe's write column and ``nbckpt.bench.measure_floors`` use the
same write measurement, so the two agree on method; they differ only in the sizes and stream
counts they are given.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import pandas as pd

from .._errors import CheckpointError, ConfigError
from .._util import (
    MIB,
    check_count,
    endpoint,
    explain_fsspec_error,
    format_bytes,
    fsspec_options,
    is_url,
    open_fsspec,
    where,
)
from ._advice import storage_advice
from ._measure import (
    DEFAULT_REPEATS,
    StreamRun,
    fsync_latencies,
    local_stream_runs,
    metadata_rates,
    object_rates,
    object_stream_runs,
    stream_counts,
)
from ._mounts import MountInfo, mount_info

__all__ = ["DEFAULT_SIZE_MB", "DEFAULT_STREAMS", "ProbeResult", "probe"]

DEFAULT_SIZE_MB = 64.0
DEFAULT_STREAMS = (1, 2, 4, 8)


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
            lines.append(f"  free space: {format_bytes(self.free_bytes)} of {format_bytes(self.total_bytes)}")
        lines.append(
            f"  {self.size_bytes / MIB:,.0f} MiB written and read back per stream count, best of "
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


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _missing_parts(path: str) -> list[str]:
    """The directories ``os.makedirs(path)`` would create, deepest first."""
    missing = []
    while not os.path.exists(path) and path != os.path.dirname(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _probe_directory(
    path: str, *, size: int, streams: Sequence[int], repeats: int, checkpoint_bytes: int | None
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
    try:
        runs, residents = local_stream_runs(work, size, streams=streams, repeats=repeats, read_back=True)
        fsyncs = fsync_latencies(os.path.join(work, "fsync"))
        create, rename, delete = metadata_rates(work)
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


def _probe_object_store(
    url: str, *, size: int, streams: Sequence[int], repeats: int,
    storage_options: dict[str, Any] | None, checkpoint_bytes: int | None,
) -> ProbeResult:
    began = time.perf_counter()
    protocol = url.split("://", 1)[0]
    options = fsspec_options(protocol, storage_options)
    fs, root = open_fsspec(url.rstrip("/"), options)
    work = f"{root.rstrip('/')}/.nbckpt-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(f"{work}/hello", b"nbckpt")
    except Exception as exc:
        raise CheckpointError(
            f"{where(url, options)} is not writable ({explain_fsspec_error(exc, root)})"
        ) from exc
    try:
        runs = object_stream_runs(fs, work, size, streams=streams, repeats=repeats,
                                  read_back=True)
        put_rate, delete_rate = object_rates(fs, work)
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


def probe(
    path_or_url: str | os.PathLike[str],
    *,
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
    counts = stream_counts(streams)
    check_count(repeats, "repeats")
    if checkpoint_bytes is not None and checkpoint_bytes < 0:
        raise ConfigError(f"checkpoint_bytes must be non-negative, not {checkpoint_bytes!r}")
    size = int(size_mb * MIB)
    target = os.fspath(path_or_url)
    if is_url(target):
        return _probe_object_store(target, size=size, streams=counts, repeats=repeats,
                                   storage_options=storage_options, checkpoint_bytes=checkpoint_bytes)
    path = os.path.abspath(os.path.expanduser(target.removeprefix("file://")))
    return _probe_directory(path, size=size, streams=counts, repeats=repeats,
                            checkpoint_bytes=checkpoint_bytes)
