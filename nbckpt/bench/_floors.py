"""What the hardware allows for a checkpoint's bytes: the copy floor and the raw write floor.

A strategy's save stall is read against the copy floor (the same bytes into preallocated
memory, on one thread and split over two as nbckpt's staging copies) and its write rate against
the raw fsync'd write of the same bytes into the same directory, measured exactly as ``nbckpt
probe`` measures (:func:`nbckpt.bench.measure_write`). A comparison measures the floors once
per repeat, just before it (:func:`combine_floors`), so that the floor sees the same moments of
a shared machine as the runs: the fastest round of any repeat is the floor, and a strategy
faster than it is a measurement problem, flagged as such.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from .._util import GB, GIB, check_count, format_bytes
from ._measure import DEFAULT_REPEATS as WRITE_REPEATS
from ._measure import measure_write

__all__ = ["FLOOR_SAMPLE_BYTES", "FLOOR_STREAMS", "Floors", "combine_floors", "measure_floors"]

# Floors are measured on at most this many bytes and scaled: rates are flat well below it.
FLOOR_SAMPLE_BYTES = GIB
#: Stream counts of the write floor: what torch.save and DCP use (one file) and what nbckpt's
#: default two writer threads use.
FLOOR_STREAMS = (1, 2)


@dataclass(frozen=True)
class Floors:
    """What the hardware allows for ``bytes``: a copy into preallocated memory, and a raw write
    made durable (files fsync'd, objects uploaded) measured like ``nbckpt probe``."""

    bytes: int
    copy_s: float
    copy_gbs: float
    write_gbs: float
    """The best stream count's rate: the fastest round of :func:`nbckpt.bench.measure_write`."""
    write_s: float = math.nan
    sample_bytes: int = 0
    write_streams: int = 1
    write_gbs_by_streams: dict[str, float] = field(default_factory=dict)
    write_gbs_rounds: tuple[float, ...] = ()
    """Every round of the best stream count: how much the write rate varied here."""
    repeats: int = 1
    copy_gbs_by_repeat: tuple[float, ...] = ()
    """The copy floor measured before each repeat of a comparison (the floor is the fastest)."""
    write_gbs_by_repeat: tuple[float, ...] = ()
    """The write floor measured before each repeat of a comparison (the floor is the fastest)."""

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        for name in ("write_gbs_rounds", "copy_gbs_by_repeat", "write_gbs_by_repeat"):
            body[name] = list(getattr(self, name))
        return body

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> Floors:
        """The floors of a JSON document (``null`` numbers become NaN)."""
        known = {name: value for name, value in body.items() if name in cls.__dataclass_fields__}
        for name in ("copy_s", "copy_gbs", "write_gbs", "write_s"):
            if known.get(name) is None:
                known[name] = math.nan
        for name in ("write_gbs_rounds", "copy_gbs_by_repeat", "write_gbs_by_repeat"):
            known[name] = tuple(math.nan if v is None else float(v) for v in known.get(name) or ())
        known["write_gbs_by_streams"] = {str(k): math.nan if v is None else float(v)
                                         for k, v in (known.get("write_gbs_by_streams") or {}).items()}
        return cls(**known)

    def describe(self) -> str:
        text = (f"floors for {format_bytes(self.bytes)}: copy {self.copy_s:.4f} s "
                f"({self.copy_gbs:.1f} GB/s); raw durable write {self.write_gbs:.2f} GB/s "
                f"({self.write_s:.3f} s) with {self.write_streams} stream(s)")
        if len(self.copy_gbs_by_repeat) > 1:
            text += (f"; measured before each of {len(self.copy_gbs_by_repeat)} repeats, the "
                     f"fastest counts: copy {min(self.copy_gbs_by_repeat):.1f}-"
                     f"{max(self.copy_gbs_by_repeat):.1f} GB/s, write "
                     f"{min(self.write_gbs_by_repeat):.2f}-{max(self.write_gbs_by_repeat):.2f} GB/s")
        if self.write_gbs_rounds:
            text += (f", best of {len(self.write_gbs_rounds)} rounds "
                     f"({min(self.write_gbs_rounds):.2f}-{max(self.write_gbs_rounds):.2f} GB/s)")
        if len(self.write_gbs_by_streams) > 1:
            text += "; by streams: " + ", ".join(
                f"{k} -> {v:.2f} GB/s" for k, v in self.write_gbs_by_streams.items())
        if self.sample_bytes and self.sample_bytes < self.bytes:
            text += f"; measured on {format_bytes(self.sample_bytes)} and scaled"
        return text


# nbckpt's staging splits a host copy over two threads (engine/_staging.py): so does the floor.
_COPY_THREADS = 2


def _split_copy(target: torch.Tensor, source: torch.Tensor, threads: int) -> None:
    """``target.copy_(source)`` in ``threads`` shards copied at once (copy_ releases the GIL)."""
    shards = list(zip(target.chunk(threads), source.chunk(threads), strict=True))
    workers = [threading.Thread(target=lambda t=t, s=s: t.copy_(s)) for t, s in shards[1:]]
    for worker in workers:
        worker.start()
    shards[0][0].copy_(shards[0][1])
    for worker in workers:
        worker.join()


def _copy_floor(nbytes: int, device: str) -> float:
    """Best of three copies of ``nbytes`` into a preallocated host buffer (pinned on CUDA); on
    the host, also split over two threads, as nbckpt stages: the faster counts."""
    cuda = device == "cuda"
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    target.copy_(source)  # touches every page once, as reused staging buffers are
    best = math.inf
    for round_ in range(3 if cuda else 6):
        if cuda:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        if cuda:
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize()
        elif round_ % 2:
            _split_copy(target, source, _COPY_THREADS)
        else:
            target.copy_(source)
        best = min(best, time.perf_counter() - begin)
    return best


def measure_floors(
    nbytes: int,
    directory: str,
    *,
    device: str = "cpu",
    storage_options: dict[str, Any] | None = None,
    streams: Sequence[int] = FLOOR_STREAMS,
    repeats: int = WRITE_REPEATS,
) -> Floors:
    """Measure the copy floor and the raw fsync'd write rate of ``directory`` for ``nbytes``.

    The write is :func:`nbckpt.bench.measure_write`, the probe's own method, at each of
    ``streams``; the fastest stream count is the floor. Up to :data:`FLOOR_SAMPLE_BYTES` are
    really copied and written; larger sizes are scaled linearly from that sample.
    """
    check_count(nbytes, "nbytes")
    sample = min(nbytes, FLOOR_SAMPLE_BYTES)
    scale = nbytes / sample
    copy_s = _copy_floor(sample, device) * scale
    runs = measure_write(directory, sample, streams=streams, repeats=repeats,
                         storage_options=dict(storage_options or {}))
    best = max(runs, key=lambda run: run.write_gbs)
    rate = best.write_gbs
    return Floors(
        bytes=nbytes,
        copy_s=copy_s,
        copy_gbs=nbytes / copy_s / GB,
        write_gbs=rate,
        write_s=nbytes / (rate * GB),
        sample_bytes=sample,
        write_streams=best.streams,
        write_gbs_by_streams={str(run.streams): run.write_gbs for run in runs},
        write_gbs_rounds=tuple(best.bytes / s / GB for s in best.write_rounds_s if s > 0),
        repeats=repeats,
    )


def combine_floors(measured: Sequence[Floors]) -> Floors:
    """One floor from floors measured before each repeat: the fastest copy and write of any,
    every repeat's rates kept (``copy_gbs_by_repeat``, ``write_gbs_by_repeat``)."""
    if not measured:
        raise ValueError("combine_floors needs at least one measurement")
    copy = min(measured, key=lambda floors: floors.copy_s)
    write = max(measured, key=lambda floors: floors.write_gbs)
    streams: dict[str, float] = {}
    for floors in measured:
        for key, rate in floors.write_gbs_by_streams.items():
            streams[key] = max(streams.get(key, 0.0), rate)
    return replace(
        write,
        copy_s=copy.copy_s,
        copy_gbs=copy.copy_gbs,
        write_gbs_by_streams=streams,
        write_gbs_rounds=tuple(rate for floors in measured for rate in floors.write_gbs_rounds),
        repeats=sum(floors.repeats for floors in measured),
        copy_gbs_by_repeat=tuple(floors.copy_gbs for floors in measured),
        write_gbs_by_repeat=tuple(floors.write_gbs for floors in measured),
    )
