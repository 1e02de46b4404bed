"""Reading a checkpoint back: each byte read once and checked in the same pass; the caller's
tensors are written only once every byte a rank needs is checked (a failed restore changes none).
What is read is what the manifest says, whoever made it: a chunk whose data's place in its blob
it does not give is read by loading its blob (weights only), files without block checksums have
none to check.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch

from .._errors import CheckpointError
from ._files import damage_named, read_into
from ._format import MAX_METADATA_BYTES, METADATA_FILE, Chunk, framing
from ._manifest import Manifest
from ._shards import Region, overlap, runs
from ._store import Readable
from ._unpickle import load_blob
from ._workers import Pool, run_all

__all__ = [
    "ReadPlan",
    "Readable",
    "check_read",
    "fill",
    "plan_read",
    "read_file",
    "read_metadata",
    "read_tensors",
    "stat_files",
    "step_file_label",
    "tensor_files",
    "verify_files",
    "verify_framing",
]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (keep ``tensor`` alive meanwhile):
    by ctypes in 1 µs, not numpy's 10 µs (and none for bfloat16), for 10,000 tensors a restore."""
    if not tensor.nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


def step_file_label(location: str, name: str) -> str:
    return f"{location.rstrip('/').rsplit('/', 1)[-1]}/{name}"


def read_file(
    store: Readable,
    location: str,
    name: str,
    manifest: Manifest,
    wanted: list[tuple[int, memoryview]],
    verify: bool,
    *,
    whole: bool = False,
    cover: Sequence[tuple[int, int]] = (),
) -> float:
    meta = manifest.files[name]
    label = step_file_label(location, name)
    with damage_named(label):
        source = store.source(location, name, meta["size"])
    source.name = label
    try:
        with damage_named(label):
            return read_into(source, wanted, meta["blocks"] if verify else None, whole=whole, cover=cover)
    finally:
        source.close()


class _Load(NamedTuple):
    """A chunk the manifest does not locate in its blob: the blob is loaded (weights only) and
    the part of it inside ``region`` copied into ``tensor`` (which holds ``region``)."""

    key: str
    chunk: Chunk
    box: Region
    region: Region
    tensor: torch.Tensor


class _Blob(NamedTuple):
    """A chunk being read whose framing is checked: the bytes around its data, as read."""

    key: str
    chunk: Chunk
    header: bytearray
    trailer: bytearray

    def framed(self, dtype: torch.dtype) -> bool:
        """Whether the bytes around the data are those this torch frames such a chunk with."""
        header, trailer = framing(dtype, self.chunk.sizes)
        return self.header == header and self.trailer == trailer


@dataclass
class ReadPlan:
    """What one rank reads of a step: the tensor each key fills, and per file the byte runs that
    go into them (and the framing bytes around each chunk)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    data: dict[str, list[tuple[int, memoryview]]] = field(default_factory=dict)
    framing: dict[str, list[tuple[int, memoryview]]] = field(default_factory=dict)
    blobs: list[_Blob] = field(default_factory=list)
    direct: bool = False
    """Some tensors are the caller's own memory: every byte is checked before any is written there."""
    later: dict[str, Region | None] = field(default_factory=dict)
    """Tied tensors wanted in another region than their first key: read on their own, fresh."""
    loads: list[_Load] = field(default_factory=list)
    """Chunks read by loading their blobs, into fresh tensors (never the caller's own)."""


def plan_read(
    manifest: Manifest, wanted: Mapping[str, Region | None], into: Mapping[str, torch.Tensor] | None = None
) -> ReadPlan:
    """The runs that fill region ``wanted[key]`` (None: all of it) of each tensor from the bytes
    of each saved chunk's overlap with it, into ``into[key]`` where given (the caller's own,
    contiguous CPU tensor of that shape and dtype), else a fresh one; tied keys get one tensor."""
    plan = ReadPlan()
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    claimed: set[tuple[str, int]] = set()
    for key, asked in wanted.items():
        spec = manifest.specs[key]
        region = asked or Region.whole(spec.shape)
        chunks = manifest.items[key]
        same = (spec.dtype, region, tuple(chunks))
        if same in made:
            plan.tensors[key] = made[same]
            continue
        if any((chunk.file, chunk.blob_offset) in claimed for chunk in chunks):
            plan.later[key] = asked
            continue
        target = (into or {}).get(key)
        if target is not None and not all(chunk.located for chunk in chunks):
            target = None  # a blob loaded is checked only as it loads: never into the caller's memory
        plan.direct |= target is not None
        tensor = made[same] = plan.tensors[key] = (
            target if target is not None else _fresh(region.sizes, spec.dtype)
        )
        view = byte_view(tensor)
        for chunk in chunks:
            whole = chunk.sizes == region.sizes and chunk.offsets == region.offsets  # the common case
            box = region if whole else overlap(chunk.region, region)
            if box is None:
                continue
            claimed.add((chunk.file, chunk.blob_offset))
            if chunk.located:
                _plan_runs(plan, key, chunk, spec.dtype, region, box, view)
            else:
                plan.loads.append(_Load(key, chunk, box, region, tensor))
    return plan


def _plan_runs(
    plan: ReadPlan, key: str, chunk: Chunk, dtype: torch.dtype, region: Region, box: Region, view: memoryview
) -> None:
    """The byte runs of ``chunk``'s part ``box`` of ``region`` into ``view`` (the bytes of the
    tensor holding ``region``), and the framing bytes around the chunk's data."""
    runs_here = plan.data.setdefault(chunk.file, [])
    if box is region:  # all of it, in one run
        runs_here.append((chunk.data_offset, view))
    else:
        src, dst, length = runs(box, chunk.region, region, dtype.itemsize)
        for s, d in zip(src.tolist(), dst.tolist(), strict=True):
            runs_here.append((chunk.data_offset + s, view[d : d + length]))
    plan.blobs.append(_framing_views(key, chunk, dtype, plan.framing.setdefault(chunk.file, [])))


def check_read(
    store: Readable, io: Pool, location: str, manifest: Manifest, plan: ReadPlan, *, verify: bool
) -> float:
    """What must hold before a direct plan writes a byte into the caller's memory: every block
    its bytes lie in read (into scratch) and checked, every chunk's framing checked, the tied
    tensors read apart. A plan into fresh tensors only reads its tied ones here, and the chunks
    it loads from their blobs."""
    cpu = 0.0
    if plan.direct:
        cpu += _read_files(store, io, location, manifest, plan.framing, verify, cover=plan.data)
        _check_blobs(store, location, manifest, plan.blobs, verify)
    for load in plan.loads:
        blob = _Blob(load.key, load.chunk, bytearray(), bytearray())
        loaded, _ = _load_chunk(store, location, manifest, blob, verify)
        load.tensor[_slices(load.box, load.region)] = loaded[_slices(load.box, load.chunk.region)]
    if plan.later:
        more, more_cpu = read_tensors(store, io, location, manifest, plan.later, verify=verify)
        plan.tensors.update(more)
        cpu += more_cpu
    return cpu


def fill(
    store: Readable, io: Pool, location: str, manifest: Manifest, plan: ReadPlan, *, verify: bool
) -> float:
    """Read the plan's bytes into its tensors: checked in the same pass (with the framing), or,
    for a direct plan that :func:`check_read` checked already, just read."""
    if plan.direct:
        return _read_files(store, io, location, manifest, plan.data, False)
    both = {
        name: [*plan.data.get(name, []), *plan.framing.get(name, [])] for name in {*plan.data, *plan.framing}
    }
    cpu = _read_files(store, io, location, manifest, both, verify)
    _check_blobs(store, location, manifest, plan.blobs, verify)
    return cpu


def _read_files(
    store: Readable,
    io: Pool,
    location: str,
    manifest: Manifest,
    views: Mapping[str, list[tuple[int, memoryview]]],
    verify: bool,
    *,
    cover: Mapping[str, list[tuple[int, memoryview]]] | None = None,
) -> float:
    """Each file's ``views`` read in parallel, a file a thread (and the blocks around ``cover``'s
    ranges read and checked, into scratch); the CPU seconds spent."""
    jobs = [
        partial(
            read_file,
            store,
            location,
            name,
            manifest,
            sorted(views.get(name, []), key=lambda w: w[0]),
            verify,
            cover=[(offset, len(view)) for offset, view in (cover or {}).get(name, [])],
        )
        for name in dict.fromkeys([*views, *(cover or {})])  # in order: the first damage is named
    ]
    return float(sum(run_all(io, jobs)))


def read_tensors(
    store: Readable,
    io: Pool,
    location: str,
    manifest: Manifest,
    wanted: Mapping[str, Region | None],
    *,
    verify: bool,
) -> tuple[dict[str, torch.Tensor], float]:
    """Region ``wanted[key]`` (None: all of it) of each tensor, read into fresh CPU tensors and
    checked in the same pass; returns them and the CPU seconds spent."""
    stat_files(store, location, manifest, tensor_files(manifest, wanted))
    plan = plan_read(manifest, wanted)
    cpu = fill(store, io, location, manifest, plan, verify=verify)
    cpu += check_read(store, io, location, manifest, plan, verify=verify)
    return plan.tensors, cpu


def _fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor to read into, refused unless its storage holds every byte read into it."""
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.untyped_storage().nbytes() < tensor.numel() * dtype.itemsize:
        raise CheckpointError(f"dtype {dtype} stores fewer bytes than it reports; nbckpt never writes it")
    return tensor


def _framing_views(key: str, chunk: Chunk, dtype: torch.dtype, wanted: list[tuple[int, memoryview]]) -> _Blob:
    """Ask for the bytes of ``chunk``'s blob around its data, to compare with its framing."""
    nbytes = math.prod(chunk.sizes) * dtype.itemsize
    header = bytearray(chunk.data_offset - chunk.blob_offset)
    trailer = bytearray(chunk.blob_offset + chunk.blob_length - chunk.data_offset - nbytes)
    wanted.append((chunk.blob_offset, memoryview(header)))
    wanted.append((chunk.data_offset + nbytes, memoryview(trailer)))
    return _Blob(key, chunk, header, trailer)


def _check_blobs(
    store: Readable, location: str, manifest: Manifest, blobs: Iterable[_Blob], verify: bool
) -> None:
    """Every chunk read must read the same through ``torch.load``: its framing is the one this
    torch writes, or else the whole blob, loaded with weights only, holds exactly the chunk's
    bytes (a checkpoint of another torch version frames its blobs its own way)."""
    for blob in blobs:
        if blob.framed(manifest.specs[blob.key].dtype):
            continue
        loaded, data = _load_chunk(store, location, manifest, blob, verify)
        start = blob.chunk.data_offset - blob.chunk.blob_offset
        if not torch.equal(_bits(loaded), data[start : start + loaded.nbytes]):
            raise CheckpointError(
                f"{step_file_label(location, blob.chunk.file)}: tensor {blob.key!r} reads "
                "differently through torch.load (its blob's framing was changed)"
            )


def _load_chunk(
    store: Readable, location: str, manifest: Manifest, blob: _Blob, verify: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's blob as a plain ``torch.load`` (weights only) reads it, checked to be that
    chunk's dtype and shape; and the blob's bytes."""
    chunk, spec = blob.chunk, manifest.specs[blob.key]
    data = torch.empty(chunk.blob_length, dtype=torch.uint8)
    read_file(store, location, chunk.file, manifest, [(chunk.blob_offset, byte_view(data))], verify)
    what = f"{step_file_label(location, chunk.file)}: the blob of tensor {blob.key!r}"
    loaded = load_blob(bytes(byte_view(data)), what)
    if (
        not isinstance(loaded, torch.Tensor)
        or loaded.dtype != spec.dtype
        or tuple(loaded.shape) != chunk.sizes
    ):
        found = (
            f"{loaded.dtype} {tuple(loaded.shape)}"
            if isinstance(loaded, torch.Tensor)
            else type(loaded).__name__
        )
        raise CheckpointError(f"{what} holds {found}, the manifest says {spec.dtype} {chunk.sizes}")
    return loaded, data


def verify_framing(store: Readable, io: Pool, location: str, manifest: Manifest) -> None:
    """Check the framing of every chunk of the step (a plain ``torch.load`` of each blob gives
    exactly the chunk's bytes; a chunk not located in its blob: the blob loads as that chunk)."""
    framing_views: dict[str, list[tuple[int, memoryview]]] = {}
    blobs: dict[tuple[str, int], _Blob] = {}
    for key, chunks in manifest.items.items():
        for chunk in chunks:
            if not chunk.located:
                _load_chunk(store, location, manifest, _Blob(key, chunk, bytearray(), bytearray()), True)
            elif (chunk.file, chunk.blob_offset) not in blobs:
                views, dtype = framing_views.setdefault(chunk.file, []), manifest.specs[key].dtype
                blobs[(chunk.file, chunk.blob_offset)] = _framing_views(key, chunk, dtype, views)
    _read_files(store, io, location, manifest, framing_views, True)
    _check_blobs(store, location, manifest, blobs.values(), True)


def _slices(box: Region, within: Region) -> tuple[slice, ...]:
    return tuple(
        slice(o - w, o - w + n) for o, n, w in zip(box.offsets, box.sizes, within.offsets, strict=True)
    )


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, to compare bit for bit (NaN equals itself, -0.0 is not 0.0)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def verify_files(
    store: Readable, io: Pool, location: str, manifest: Manifest, names: Iterable[str] | None = None
) -> float:
    """Check the size and every block of each file (by default every one with block checksums:
    all of an nbckpt step's)."""
    jobs = [
        (lambda name=name: read_file(store, location, name, manifest, [], True, whole=True))
        for name in (manifest.checksummed if names is None else names)
    ]
    return float(sum(run_all(io, jobs)))


def read_metadata(store: Readable, location: str, manifest: Manifest) -> bytes:
    """The DCP metadata file, checked against its block checksums: no larger than a plain DCP
    step's may be, and its real size the manifest's before a buffer is made for it."""
    size = manifest.files[METADATA_FILE]["size"]
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(
            f"{step_file_label(location, METADATA_FILE)} has {size} bytes, more than DCP metadata may "
            f"({MAX_METADATA_BYTES})"
        )
    stat_files(store, location, manifest, [METADATA_FILE])
    data = bytearray(size)
    read_file(store, location, METADATA_FILE, manifest, [(0, memoryview(data))], True)
    return bytes(data)


def tensor_files(manifest: Manifest, keys: Iterable[str]) -> list[str]:
    """The files the chunks of tensors ``keys`` are in."""
    return list(dict.fromkeys(chunk.file for key in keys for chunk in manifest.items[key]))


def stat_files(store: Readable, location: str, manifest: Manifest, names: Iterable[str]) -> None:
    """Each file of ``names`` is there with the size the manifest says: checked before memory is
    made to read it into, so a re-signed manifest that claims a huge file allocates nothing."""
    for name in dict.fromkeys(names):
        label = step_file_label(location, name)
        with damage_named(label):
            source = store.source(location, name, manifest.files[name]["size"])
        source.close()
