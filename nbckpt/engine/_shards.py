"""Sharded tensors: which part of a whole tensor a rank holds, and which bytes move where.

A DTensor (FSDP2, tensor parallel, HSDP) is saved as DCP saves it: each rank writes its local
shard as a *chunk* of the whole tensor, and a chunk several ranks hold is written once. A
restore asks for a *region* of the whole tensor and reads, from each saved chunk that overlaps
it, only the bytes of the overlap. A plain tensor under one key on several ranks is replicated
(DCP's rule too) and written once; :func:`fingerprints` checks cheaply that its copies agree.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from .._errors import ConfigError
from ._torch_compat import dtensor_spec

__all__ = [
    "Region",
    "Runs",
    "check_replicas",
    "fingerprints",
    "is_dtensor",
    "is_replicated",
    "local_part",
    "overlap",
    "region_of",
    "runs",
    "tiles",
    "wrap_like",
]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """A box of a whole tensor: where it starts in each dimension, and how far it runs."""

    offsets: Shape
    sizes: Shape

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (checked by name first: importing DTensor costs time)."""
    if type(value).__name__ != "DTensor":
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def is_replicated(tensor: Any) -> bool:
    """Whether other ranks hold a DTensor's chunk too (a Replicate placement on a mesh dimension)."""
    return any(placement.is_replicate() for placement in tensor.placements)


def local_part(tensor: Any, key: str) -> tuple[torch.Tensor, Region]:
    """A DTensor's local tensor and the region of the whole tensor it holds."""
    try:
        region = region_of(tensor)
    except (RuntimeError, ValueError) as exc:  # a Partial placement: a reduction still pending
        raise ConfigError(
            f"{key} is a DTensor with placements {tuple(tensor.placements)} that hold no chunk of "
            f"the whole tensor ({exc}); redistribute it (Shard or Replicate) before saving"
        ) from None
    local = tensor.to_local().detach()
    if tuple(local.shape) != region.sizes:
        raise ConfigError(
            f"{key}: the DTensor's local tensor has shape {tuple(local.shape)}, its chunk {region.sizes}"
        )
    return local, region


#: Each DTensor spec's chunk (a spec is a mesh, placements and a shape: the same every save).
_REGIONS: dict[Any, Region] = {}


def region_of(tensor: Any) -> Region:
    """The chunk of the whole tensor a DTensor holds on this rank, computed once per spec (never
    keyed by the tensor, which it would keep alive): hundreds of them cost milliseconds a stall."""
    spec = dtensor_spec(tensor)
    region = _REGIONS.get(spec)
    if region is None:
        chunks = tensor.__create_chunk_list__()
        if len(chunks) != 1:
            raise ValueError(f"its local part is {len(chunks)} chunks; nbckpt saves one")
        region = Region(tuple(int(n) for n in chunks[0].offsets), tuple(int(n) for n in chunks[0].sizes))
        if len(_REGIONS) >= 8192:
            _REGIONS.clear()
        _REGIONS[spec] = region
    return region


def wrap_like(local: torch.Tensor, like: Any) -> Any:
    """``local`` (the region of ``like``'s local shard) as a DTensor sharded exactly as ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(like.to_local().device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def overlap(a: Region, b: Region) -> Region | None:
    """The box two regions share, or None."""
    offsets, sizes = [], []
    for a_off, a_size, b_off, b_size in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True):
        start, end = max(a_off, b_off), min(a_off + a_size, b_off + b_size)
        if end <= start:
            return None
        offsets.append(start)
        sizes.append(end - start)
    return Region(tuple(offsets), tuple(sizes))


#: Pairs of chunks the sweep of :func:`tiles` may compare before it tries straight cuts instead:
#: chunks that all span the first dimension (a tensor sharded by columns) are compared each
#: with each, and 20,000 of them in 1 MB of ``.metadata`` would take many minutes.
SWEEP_BUDGET = 1 << 18


def tiles(chunks: Sequence[Region], shape: Shape, *, budget: int = SWEEP_BUDGET) -> bool:
    """Whether ``chunks`` cover the whole tensor of ``shape`` exactly once: inside it, volumes
    adding up, no two overlapping (a sweep along the first dimension: n log n for n chunks in
    rows; past ``budget`` comparisons, a tiling by straight cuts, as every DTensor placement
    makes, is still recognised, in n log n a level)."""
    full = Region.whole(shape)
    if len(chunks) == 1 and chunks[0] == full:  # a plain tensor: one chunk, all of it
        return True
    solid = [c for c in chunks if c.numel]
    if any(overlap(c, full) != c for c in solid) or sum(c.numel for c in solid) != full.numel:
        return False
    if not shape:
        return len(solid) == 1
    active: list[Region] = []
    for chunk in sorted(solid, key=lambda c: c.offsets):
        start = chunk.offsets[0]
        active = [c for c in active if c.offsets[0] + c.sizes[0] > start]
        budget -= len(active)
        if budget < 0:
            return _cut(solid, full)
        if any(overlap(c, chunk) is not None for c in active):
            return False
        active.append(chunk)
    return True


def _cut(chunks: list[Region], whole: Region) -> bool:
    """Whether ``chunks`` (inside ``whole``, their volumes adding up to it) split, by straight
    cuts no chunk crosses and again within each part, down to parts of one chunk each filling
    its part: then no two overlap. Sorting work is bounded (64 times the chunks and dimensions)."""
    work = 64 * len(chunks) * len(whole.sizes)
    stack = [(chunks, whole)]
    while stack:
        group, box = stack.pop()
        if len(group) == 1:
            if group[0] != box:
                return False
            continue
        parts = None
        for dim in range(len(box.sizes)):
            work -= len(group)
            parts = _slabs(group, box, dim)
            if len(parts) > 1 or work < 0:
                break
        if work < 0 or parts is None or len(parts) == 1:
            return False
        stack.extend(parts)
    return True


def _slabs(group: list[Region], box: Region, dim: int) -> list[tuple[list[Region], Region]]:
    """``group`` split along ``dim`` where no chunk crosses, each part with the box it spans."""
    parts: list[tuple[list[Region], Region]] = []
    current: list[Region] = []
    start = reach = box.offsets[dim]
    for chunk in sorted(group, key=lambda c: c.offsets[dim]):
        if current and chunk.offsets[dim] >= reach:
            parts.append((current, _span(box, dim, start, reach)))
            current, start = [], chunk.offsets[dim]
        current.append(chunk)
        reach = max(reach, chunk.offsets[dim] + chunk.sizes[dim])
    parts.append((current, _span(box, dim, start, reach)))
    return parts


def _span(box: Region, dim: int, start: int, end: int) -> Region:
    offsets, sizes = list(box.offsets), list(box.sizes)
    offsets[dim], sizes[dim] = start, end - start
    return Region(tuple(offsets), tuple(sizes))


#: (source byte offset, destination byte offset, bytes) of each contiguous run, as arrays.
Runs = tuple[np.ndarray, np.ndarray, int]


def runs(box: Region, source: Region, target: Region, itemsize: int) -> Runs:
    """The contiguous byte runs that copy ``box`` from ``source``'s row-major bytes into
    ``target``'s (``box`` lies inside both): one run for a row range, one per row for a column
    block (the dimensions after the last narrower one are whole in both)."""
    dims = len(box.sizes)
    if dims == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), itemsize
    split = dims - 1
    while split > 0 and box.sizes[split] == source.sizes[split] == target.sizes[split]:
        split -= 1
    inner = math.prod(box.sizes[split + 1 :])
    length = box.sizes[split] * inner * itemsize
    src = _starts(box, source, split, itemsize)
    dst = _starts(box, target, split, itemsize)
    return src, dst, length


def _starts(box: Region, side: Region, split: int, itemsize: int) -> np.ndarray:
    """Byte offset in ``side`` of each run: every index of the box's dimensions before ``split``."""
    strides = [itemsize * math.prod(side.sizes[d + 1 :]) for d in range(len(side.sizes))]
    base = (box.offsets[split] - side.offsets[split]) * strides[split]
    starts = np.full(1, base, dtype=np.int64)
    for d in range(split):
        first = box.offsets[d] - side.offsets[d]
        steps = (np.arange(box.sizes[d], dtype=np.int64) + first) * strides[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts


#: Elements of a replicated tensor compared across ranks: enough to tell one rank's batch or
#: shard from another's, few enough to cost microseconds a tensor.
SAMPLES = 128


@functools.lru_cache(maxsize=512)
def _positions(numel: int, device: torch.device) -> torch.Tensor:
    steps = min(numel, SAMPLES)
    return torch.linspace(0, numel - 1, steps, dtype=torch.float64).round().long().to(device)


#: ``torch.take`` has no kernel for unsigned and float8 dtypes: their bits are sampled as the
#: signed integers of the same width (a fingerprint compares bits, not values, anyway).
_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    width = tensor.element_size()
    return tensor.view(_SAME_WIDTH[width]) if width in _SAME_WIDTH else tensor


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """A cheap fingerprint of each tensor: a hash of :data:`SAMPLES` elements spread over it,
    the same positions on every rank (a device's samples come back in one copy)."""
    samples = {
        key: torch.take(_bits(tensor), _positions(tensor.numel(), tensor.device)).view(torch.uint8)
        for key, tensor in tensors.items()
        if tensor.numel()
    }
    by_device: dict[torch.device, list[str]] = {}
    for key, sample in samples.items():
        by_device.setdefault(sample.device, []).append(key)
    found = {}
    for device, keys in by_device.items():
        joined = torch.cat([samples[k] for k in keys])
        data = (joined if device.type == "cpu" else joined.cpu()).numpy().tobytes()
        at = 0
        for key in keys:
            size = samples[key].numel()
            found[key] = xxhash.xxh3_64_hexdigest(data[at : at + size])
            at += size
    return found


def check_replicas(
    shared: frozenset[str], replicated: Mapping[str, Sequence[Sequence[int]]], prints: list[dict[str, str]]
) -> None:
    """A tensor several ranks hold (a plain tensor under one key; a DTensor's chunk under a
    Replicate placement) is written once, so its copies must agree: the same ConfigError on
    every rank (they all see every fingerprint) when they do not."""
    for key in sorted(shared):
        differ = _differ(key, range(len(prints)), prints)
        if differ:
            raise ConfigError(
                f"{key!r} is a plain tensor with different values on different ranks ({differ}); "
                "a plain tensor under one key is replicated and written once. Give each rank's "
                f"its own key (e.g. f'{key}.rank{{rank}}'), or make it a DTensor"
            )
    for key in sorted(replicated):
        for group in replicated[key]:
            differ = _differ(key, group, prints)
            if differ:
                raise ConfigError(
                    f"{key!r} is a DTensor whose replicas differ ({differ}); a Replicate placement's "
                    "copies are written once, by one rank. Make them agree (broadcast from one "
                    "rank) or shard it (a Shard placement)"
                )


def _differ(key: str, ranks: Iterable[int], prints: list[dict[str, str]]) -> str:
    """Which of ``ranks`` hold which value of ``key`` ("rank 0 vs rank 1, 2"); "" if one value."""
    groups: dict[str, list[int]] = {}
    for rank in ranks:
        if key in prints[rank]:
            groups.setdefault(prints[rank][key], []).append(rank)
    if len(groups) < 2:
        return ""
    return " vs ".join("rank " + ", ".join(map(str, g)) for g in groups.values())
