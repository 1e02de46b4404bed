"""Where every byte of a checkpoint goes, planned once per state structure and then reused.

A checkpoint is in PyTorch DCP's format, so a plain ``torch.distributed.checkpoint.load``
reads it: per rank, files ``__{rank}_{i}.distcp`` holding one ``torch.save`` blob per
tensor, and a ``.metadata`` pickle naming each blob's file, offset and length. DCP writes
every blob by running ``torch.save`` (a zip writer that also computes a CRC32 of every byte,
which ``torch.load`` never checks). nbckpt instead asks ``torch.save`` once per tensor shape
for the blob's framing only (``torch.serialization.skip_data``: the zip headers, with a hole
where the bytes go) and lays each file out as an image: framing bytes fixed at planning time,
tensor bytes copied into their holes by staging. A save is then one sequential write of each
image, and the plan is cached: the same structure is never planned twice.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import skip_data

from .._errors import CheckpointError
from ._state import TensorSpec
from ._torch_compat import storage_info

__all__ = ["ALIGN", "DCP_VERSION", "METADATA_FILE", "FileLayout", "Item", "Layout", "data_file", "plan"]

METADATA_FILE = ".metadata"
DCP_VERSION = "1.0.0"
#: Blobs start on this boundary, so every tensor's bytes in an image are aligned for any dtype.
ALIGN = 64


def data_file(rank: int, index: int) -> str:
    """DCP's name for a rank's data file."""
    return f"__{rank}_{index}.distcp"


@dataclass(frozen=True)
class Item:
    """One tensor in a file: its bytes at ``offset``, inside a blob DCP knows by its range."""

    key: str
    offset: int
    nbytes: int
    blob_offset: int
    blob_length: int


@dataclass(frozen=True)
class FileLayout:
    """One data file: its size, its tensors, and the framing bytes between them."""

    name: str
    size: int
    items: tuple[Item, ...]
    framing: tuple[tuple[int, bytes], ...]
    """(offset, bytes) of everything in the file that is not tensor data."""


@dataclass(frozen=True)
class Layout:
    """Every rank's files for one state structure, and the DCP metadata that describes them."""

    files: Mapping[int, tuple[FileLayout, ...]]
    metadata: bytes
    locations: Mapping[str, tuple[str, int]]
    """Each tensor key: the file that holds its bytes and their offset (the manifest's items)."""
    nbytes: int
    """Tensor bytes in all the ranks' files (a replicated tensor counts once)."""


@functools.lru_cache(maxsize=4096)
def _framing(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` writes before and after a tensor's data (same for every value)."""
    recorder = _Recorder()
    with skip_data():
        torch.save(torch.empty(shape, dtype=dtype), cast(IO[bytes], recorder))
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if recorder.holes == [] and nbytes == 0:
        return bytes(recorder.data), b""
    if len(recorder.holes) != 1 or recorder.holes[0][1] != nbytes:
        raise CheckpointError(
            f"torch {torch.__version__} frames a {dtype} tensor in a way nbckpt does not know"
        )
    at = recorder.holes[0][0]
    return bytes(recorder.data[:at]), bytes(recorder.data[at + nbytes :])


class _Recorder(io.RawIOBase):
    """A stream that keeps what torch.save writes and notes where it skips (the data)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.holes: list[tuple[int, int]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.data += view
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = offset if whence == io.SEEK_SET else len(self.data) + offset
        if whence not in (io.SEEK_SET, io.SEEK_CUR) or target < len(self.data):
            raise io.UnsupportedOperation("torch.save seeks backwards")
        if target > len(self.data):
            self.holes.append((len(self.data), target - len(self.data)))
            self.data += bytes(target - len(self.data))
        return len(self.data)

    def tell(self) -> int:
        return len(self.data)


def _pad(offset: int) -> int:
    return -offset % ALIGN


def _file_layout(name: str, specs: Sequence[TensorSpec]) -> FileLayout:
    items, framing = [], []
    offset = 0
    pending = bytearray()  # framing since the last tensor's bytes: written as one piece
    for spec in specs:
        header, trailer = _framing(spec.dtype, spec.shape)
        pending += bytes(_pad(offset + len(pending)))
        blob_offset = offset + len(pending)
        pending += header
        data_offset = offset + len(pending)
        framing.append((offset, bytes(pending)))
        items.append(
            Item(spec.key, data_offset, spec.nbytes, blob_offset, len(header) + spec.nbytes + len(trailer))
        )
        offset = data_offset + spec.nbytes
        pending = bytearray(trailer)
    if pending:
        framing.append((offset, bytes(pending)))
    return FileLayout(name, offset + len(pending), tuple(items), tuple(framing))


def _assign(rank_specs: Sequence[Sequence[TensorSpec]]) -> list[list[TensorSpec]]:
    """Which rank writes each tensor: a key held by several ranks is replicated (as DCP assumes)
    and written once, by the holder with the fewest bytes so far."""
    holders: dict[str, list[int]] = {}
    spec_of: dict[str, TensorSpec] = {}
    for rank, specs in enumerate(rank_specs):
        for spec in specs:
            known = spec_of.setdefault(spec.key, spec)
            if known != spec:
                raise CheckpointError(
                    f"ranks disagree on {spec.key!r}: {known.dtype} {list(known.shape)} on rank "
                    f"{holders[spec.key][0]}, {spec.dtype} {list(spec.shape)} on rank {rank}"
                )
            holders.setdefault(spec.key, []).append(rank)
    load = [0] * len(rank_specs)
    owner: dict[str, int] = {}
    for key in sorted(spec_of, key=lambda k: (-spec_of[k].nbytes, k)):
        rank = min(holders[key], key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += spec_of[key].nbytes
    # Each rank keeps its own order of keys: files then follow the state's order.
    return [[s for s in specs if owner[s.key] == rank] for rank, specs in enumerate(rank_specs)]


def _bins(specs: Sequence[TensorSpec], count: int) -> list[list[TensorSpec]]:
    """Split into ``count`` files of similar size (largest tensor to the lightest file first)."""
    bins: list[list[TensorSpec]] = [[] for _ in range(count)]
    sizes = [0] * count
    placed: dict[str, int] = {}
    for spec in sorted(specs, key=lambda s: -s.nbytes):
        index = min(range(count), key=lambda i: (sizes[i], i))
        placed[spec.key] = index
        sizes[index] += spec.nbytes
    for spec in specs:
        bins[placed[spec.key]].append(spec)
    return [b for b in bins if b]


def plan(
    rank_specs: Sequence[Sequence[TensorSpec]],
    paths: Mapping[str, tuple[str | int, ...]],
    files_per_rank: int,
) -> Layout:
    """The layout of every rank's files and the DCP metadata for them.

    ``rank_specs`` holds each rank's tensors in its state's order; ``paths`` maps each key
    to its path of keys in the state (so DCP's tools can nest the tensors again).
    """
    files: dict[int, tuple[FileLayout, ...]] = {}
    for rank, specs in enumerate(_assign(rank_specs)):
        files[rank] = tuple(
            _file_layout(data_file(rank, index), group)
            for index, group in enumerate(_bins(specs, min(files_per_rank, max(len(specs), 1))))
        )
    spec_of = {spec.key: spec for specs in rank_specs for spec in specs}
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, Any] = {}
    # One torch.Size per distinct shape: pickle then writes each once (10,000 tensors of 100
    # shapes pickle 5x faster), and DCP's reader sees the same values.
    sizes: dict[tuple[int, ...], torch.Size] = {}
    for rank_files in files.values():
        for layout in rank_files:
            for item in layout.items:
                spec = spec_of[item.key]
                size = sizes.setdefault(spec.shape, torch.Size(spec.shape))
                origin = sizes.setdefault((0,) * len(spec.shape), torch.Size((0,) * len(spec.shape)))
                state_dict_metadata[item.key] = TensorStorageMetadata(
                    TensorProperties(dtype=spec.dtype), size, [ChunkStorageMetadata(origin, size)]
                )
                storage_data[MetadataIndex(item.key, origin)] = storage_info(
                    layout.name, item.blob_offset, item.blob_length
                )
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={key: paths.get(key, (key,)) for key in state_dict_metadata},
        storage_data=storage_data,
        version=DCP_VERSION,
    )
    items = [(f.name, item) for fs in files.values() for f in fs for item in f.items]
    locations = {item.key: (name, item.offset) for name, item in items}
    nbytes = sum(item.nbytes for _, item in items)
    return Layout(files, pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL), locations, nbytes)
