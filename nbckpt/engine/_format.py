"""nbckpt's on-disk format in one place: every name, constant and limit of a run directory, and
the DCP layout of a step's data files (docs/format.md describes the same; a test checks it
names every constant here). No other module defines a name of the format.

The data files are DCP's, so a plain ``torch.distributed.checkpoint.load`` reads them: one
``torch.save`` blob per chunk of a tensor, named by a pickled ``.metadata``. nbckpt asks
``torch.save`` once per shape and dtype for a blob's framing (``skip_data``: zip headers with
a hole for the bytes) and lays each file out as an image whose holes staging fills: a save is
one sequential write per file. A chunk several ranks hold, or a tied tensor, is written once.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NamedTuple, cast

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.serialization import skip_data

from .._errors import CheckpointError
from ._shards import Region, tiles
from ._state import TensorSpec, dtype_name
from ._torch_compat import storage_info
from ._workers import balance, deferred_interrupt

__all__ = [
    "BLOCK_SIZE",
    "DCP_VERSION",
    "FORMAT",
    "LEFTOVER_RE",
    "LOCK_FILE",
    "MANIFEST",
    "MANIFEST_KEYS",
    "MAX_MANIFEST_BYTES",
    "MAX_METADATA_BYTES",
    "MAX_STEP",
    "METADATA_FILE",
    "METRICS",
    "OLD_PREFIX",
    "POINTER_FORMAT",
    "POINTER_LIMIT",
    "PROBE_PREFIX",
    "RANKS_PROBE",
    "READS",
    "SMALL_LEFTOVER_RE",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "TREE_KINDS",
    "Chunk",
    "FileLayout",
    "Item",
    "Layout",
    "RankPlan",
    "block_hasher",
    "checksum",
    "data_file",
    "framing",
    "is_data_file",
    "pad",
    "parse_step",
    "plan",
    "step_name",
    "torch_save",
]

# -- A run directory -------------------------------------------------------------------------
#: The manifest: written last, it is what makes a step count.
MANIFEST = "manifest.json"
#: DCP's pickled index of a step's blobs.
METADATA_FILE = ".metadata"
#: Held (flock) by the one process writing a local run.
LOCK_FILE = ".nbckpt.lock"
#: Prefixes of what never counts: a save being written, a step being deleted, the previous copy
#: of a step being saved again, the probe that proves a root writable.
TMP_PREFIX, TRASH_PREFIX, OLD_PREFIX, PROBE_PREFIX = ".tmp-", ".trash-", ".old-", ".nbckpt-probe-"
#: Written by rank 0 as several ranks open a root, read back by the others: they share it.
RANKS_PROBE = ".nbckpt-ranks"
#: The highest step: an int64, as a step counter is in torch and in most JSON readers. Its name
#: (19 digits) fits any file system; 10**300 would not (ENAMETOOLONG).
MAX_STEP = 2**63 - 1
_STEP_RE = re.compile(r"step-([0-9]{6,19})", re.ASCII)
#: ``.tmp-step-000140-ab12`` and its kin: leftovers an open cleans up (or puts back, ``.old-``).
LEFTOVER_RE = re.compile(r"\.(tmp|trash|old)-(step-[0-9]{6,19})-[0-9a-f]+", re.ASCII)
#: ``.tmp-.set-aside-intent.json-1a2b3c4d``: a small file being replaced (the file a local
#: ``write_small`` renames over it), left by a crash: an open removes it too.
SMALL_LEFTOVER_RE = re.compile(r"\.tmp-(?!step-)[^/]+-[0-9a-f]{8}", re.ASCII)
_DATA_FILE_RE = re.compile(r"__[0-9]{1,6}_[0-9]{1,6}\.distcp", re.ASCII)


def step_name(step: int) -> str:
    """The one spelling of a step's directory: ``step-`` and at least six digits."""
    return f"step-{step:06d}"


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None (``step-2``, ``step-0000002`` never count)."""
    match = _STEP_RE.fullmatch(name)
    if match is None or int(match.group(1)) > MAX_STEP or step_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def data_file(rank: int, index: int) -> str:
    """DCP's name for a rank's data file."""
    return f"__{rank}_{index}.distcp"


def is_data_file(name: str) -> bool:
    """Whether ``name`` is a DCP data file's name (``__{rank}_{index}.distcp``), nothing else."""
    return _DATA_FILE_RE.fullmatch(name) is not None


# -- Pointers --------------------------------------------------------------------------------
#: The format of an integration's pointer file (a Lightning ``.ckpt``), and its size limit.
POINTER_FORMAT = "nbckpt-pointer/1"
POINTER_LIMIT = 64 << 10

# -- The manifest ----------------------------------------------------------------------------
FORMAT = "nbckpt/3"
#: Formats this nbckpt reads (nbckpt/2: one ``[file, data_offset]`` per tensor, no shards).
READS = (FORMAT, "nbckpt/2")
#: A manifest holds about 100 bytes per tensor: 64 MiB is room for half a million of them.
MAX_MANIFEST_BYTES = 64 << 20
#: DCP's ``.metadata`` grows with tensors times ranks: far more room than a manifest gets.
MAX_METADATA_BYTES = 1 << 30
#: The values a save was given to rank its step by (keep-best retention): ``{name: float}``.
METRICS = "metrics"
#: Every key a manifest may hold (``rank_trees``, ``rng`` and ``metrics`` only when there are some).
MANIFEST_KEYS = (
    "checksum",
    "format",
    "step",
    "unix_time",
    "timing",
    "time",
    "bytes",
    "world_size",
    "block_size",
    "files",
    "items",
    "tree",
    "rank_trees",
    "rng",
    "provenance",
    METRICS,
)
#: The node kinds of a state tree (``{"t": kind, ...}``).
TREE_KINDS = frozenset(
    {
        "tensor",
        "ndarray",
        "module",
        "optimizer",
        "stateful",
        "dict",
        "namespace",
        "list",
        "tuple",
        "value",
        "float",
        "bytes",
        "path",
        "dtype",
        "device",
    }
)
#: Every file is checksummed in blocks of this many bytes (the last one shorter), so a rank that
#: needs part of a file reads and checks only the blocks holding its tensors.
BLOCK_SIZE = 16 << 20
#: The checksum of a block and of the manifest: xxh3-64, as 16 lowercase hex digits.
CHECKSUM = "xxh3-64"
checksum = xxhash.xxh3_64_hexdigest
block_hasher = xxhash.xxh3_64

# -- The DCP layout --------------------------------------------------------------------------
DCP_VERSION = "1.0.0"
#: Blobs start on this boundary, so every tensor's bytes in an image are aligned for any dtype.
ALIGN = 64


@dataclass(frozen=True)
class Item:
    """One chunk in a file: its bytes at ``offset``, inside a blob DCP knows by its range."""

    key: str
    offset: int
    nbytes: int
    blob_offset: int
    blob_length: int
    offsets: tuple[int, ...]
    """Where the chunk starts in the whole tensor (all zeros for a plain tensor)."""


class Chunk(NamedTuple):
    """Where the bytes of one chunk of a tensor are: a manifest item, and DCP's storage entry."""

    file: str
    blob_offset: int
    blob_length: int
    data_offset: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def region(self) -> Region:
        return Region(self.offsets, self.sizes)

    @property
    def located(self) -> bool:
        """Whether the manifest says where the data lies inside its blob (every chunk of an
        nbckpt manifest: parse refuses one that does not); else ``data_offset`` is -1 and only
        loading the whole blob (``torch.load``, weights only) finds it: a blob another writer framed."""
        return self.data_offset >= 0


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
    dcp: Metadata
    locations: Mapping[str, list[Chunk]]
    """Each tensor key: its chunks and where their bytes are (the manifest's items)."""
    nbytes: int
    """Tensor bytes in all the ranks' files (a replicated chunk, a tied tensor count once)."""
    shared: frozenset[str] = frozenset()
    """Plain tensors several ranks hold under one key: replicated, so their values must agree."""
    replicated: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """DTensors a chunk of which several ranks hold (a Replicate placement): each such group of
    ranks, whose values of that chunk must agree (it is written once)."""

    @functools.cached_property
    def metadata(self) -> bytes:
        """The pickled DCP metadata when the state has no plain values to add."""
        return pickle.dumps(self.dcp, protocol=pickle.HIGHEST_PROTOCOL)


#: torch's own ``save`` as it was when nbckpt was imported: every blob nbckpt makes (a tensor's
#: framing, a plain value) comes from it, so a test that patches ``torch.save`` later (Lightning's
#: own tests run under ``mock.patch("torch.save")``) neither breaks a save nor sees nbckpt's calls.
#: Taken from ``torch.serialization``, which such a patch leaves alone. Not a framing nbckpt builds
#: itself: that would have to follow torch's zip layout (records, alignment, ids) release by
#: release, and the plain values need torch's pickling anyway.
torch_save = torch.serialization.save


@functools.lru_cache(maxsize=4096)
def framing(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` writes before and after a tensor's data (same for every value)."""
    recorder = _Recorder()
    with deferred_interrupt(), skip_data():
        torch_save(torch.empty(shape, dtype=dtype), cast(IO[bytes], recorder))
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


def pad(offset: int) -> int:
    return -offset % ALIGN


def _file_layout(name: str, specs: Sequence[TensorSpec]) -> FileLayout:
    items, pieces = [], []
    offset = 0
    pending = bytearray()  # framing since the last tensor's bytes: written as one piece
    for spec in specs:
        header, trailer = framing(spec.dtype, spec.shape)
        pending += bytes(pad(offset + len(pending)))
        blob_offset = offset + len(pending)
        pending += header
        data_offset = offset + len(pending)
        pieces.append((offset, bytes(pending)))
        blob_length = len(header) + spec.nbytes + len(trailer)
        items.append(Item(spec.key, data_offset, spec.nbytes, blob_offset, blob_length, spec.chunk.offsets))
        offset = data_offset + spec.nbytes
        pending = bytearray(trailer)
    if pending:
        pieces.append((offset, bytes(pending)))
    return FileLayout(name, offset + len(pending), tuple(items), tuple(pieces))


#: Each DTensor key: the groups of ranks that hold one chunk of it.
Replicas = dict[str, tuple[tuple[int, ...], ...]]


class RankPlan(NamedTuple):
    """What one rank says of its state when a save is planned (its part of the agreement)."""

    specs: tuple[TensorSpec, ...]
    aliases: tuple[tuple[str, str], ...]
    """(key, the earlier key naming the same tensor) of every tied tensor."""
    cold: frozenset[str] = frozenset()
    """Keys expected not to change between saves (incremental saves): laid out in files of their
    own, before the others, so that a file of them can be shared whole with the step before."""


def _assign(
    ranks: Sequence[RankPlan],
) -> tuple[list[list[TensorSpec]], dict[str, list[TensorSpec]], frozenset[str], Replicas]:
    """Which rank writes each chunk (one several ranks hold is replicated, as DCP assumes, and
    written once, by the holder with the fewest bytes so far): each rank's chunks to write in
    its state's order, every key's distinct chunks, the plain tensors several ranks hold, and
    the groups of ranks holding one chunk of a DTensor."""
    holders: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    spec_of: dict[tuple[str, tuple[int, ...]], TensorSpec] = {}
    kind_of: dict[str, tuple[int, TensorSpec]] = {}  # each key's first holder and spec: all must agree
    for rank, plan_ in enumerate(ranks):
        for spec in plan_.specs:
            first = kind_of.setdefault(spec.key, (rank, spec))
            if (first[1].dtype, first[1].whole, first[1].sharded) != (spec.dtype, spec.whole, spec.sharded):
                raise CheckpointError(_disagree(spec.key, *first, rank, spec))
            index = (spec.key, spec.chunk.offsets)
            known = spec_of.setdefault(index, spec)
            if known.shape != spec.shape:
                raise CheckpointError(_disagree(spec.key, holders[index][0], known, rank, spec))
            holders.setdefault(index, []).append(rank)
    chunks: dict[str, list[TensorSpec]] = {}
    for (key, _), spec in spec_of.items():
        chunks.setdefault(key, []).append(spec)
    for key, parts in chunks.items():
        if parts[0].sharded and not tiles([p.chunk for p in parts], parts[0].whole):
            held = sum(p.chunk.numel for p in parts)
            raise CheckpointError(
                f"the ranks' shards of {key!r} do not make up the whole tensor {list(parts[0].whole)} "
                f"({held} of {math.prod(parts[0].whole)} elements); every rank holding part of it must "
                "save it"
            )
    load = [0] * len(ranks)
    owner: dict[tuple[str, tuple[int, ...]], int] = {}
    for index in sorted(spec_of, key=lambda i: (-spec_of[i].nbytes, i)):
        rank = min(holders[index], key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += spec_of[index].nbytes
    shared = frozenset(
        key for (key, _), ranks_ in holders.items() if len(ranks_) > 1 and not kind_of[key][1].sharded
    )
    replicated: Replicas = {}
    for (key, _), ranks_ in holders.items():
        if len(ranks_) > 1 and kind_of[key][1].sharded:
            replicated[key] = (*replicated.get(key, ()), tuple(ranks_))
    # Each rank keeps its own order of keys: files then follow the state's order. An empty
    # chunk (an uneven shard's last ranks) has no bytes: nothing is written for it.
    writes = [
        [s for s in p.specs if owner[(s.key, s.chunk.offsets)] == rank and s.nbytes]
        for rank, p in enumerate(ranks)
    ]
    return writes, chunks, shared, replicated


def _disagree(key: str, rank_a: int, a: TensorSpec, rank_b: int, b: TensorSpec) -> str:
    def what(spec: TensorSpec) -> str:
        shard = f" shard {list(spec.shape)} at {list(spec.chunk.offsets)}" if spec.sharded else ""
        return f"{dtype_name(spec.dtype)} {list(spec.whole)}{shard}"

    return f"ranks disagree on {key!r}: {what(a)} on rank {rank_a}, {what(b)} on rank {rank_b}"


def _aliases(ranks: Sequence[RankPlan], chunks: Mapping[str, list[TensorSpec]]) -> dict[str, str]:
    """Tied tensors, as every rank that holds them says: key -> the key whose bytes it shares."""
    said: dict[str, set[str]] = {}
    for plan_ in ranks:
        for key, first in plan_.aliases:
            said.setdefault(key, set()).add(first)
    aliases = {}
    for key, firsts in said.items():
        if len(firsts) > 1 or key in chunks:  # another rank holds it as a tensor of its own
            raise CheckpointError(f"ranks disagree on whether {key!r} is the same tensor as another key")
        aliases[key] = firsts.pop()
    return aliases


def plan(
    ranks: Sequence[RankPlan], paths: Mapping[str, tuple[str | int, ...]], files_per_rank: int
) -> Layout:
    """The layout of every rank's files and the DCP metadata for them; ``paths`` maps each key
    to its path of keys in the state (so DCP's tools can nest the tensors again)."""
    writes, chunks, shared, replicated = _assign(ranks)
    aliases = _aliases(ranks, chunks)
    files: dict[int, tuple[FileLayout, ...]] = {}
    for rank, specs in enumerate(writes):
        cold = ranks[rank].cold
        groups = [
            group
            for part in ([s for s in specs if s.key in cold], [s for s in specs if s.key not in cold])
            for group in balance(part, files_per_rank, lambda spec: spec.nbytes)
        ]
        files[rank] = tuple(_file_layout(data_file(rank, index), group) for index, group in enumerate(groups))
    placed: dict[tuple[str, tuple[int, ...]], tuple[str, Item]] = {
        (item.key, item.offsets): (layout.name, item)
        for rank_files in files.values()
        for layout in rank_files
        for item in layout.items
    }
    locations: dict[str, list[Chunk]] = {}
    for key, parts in chunks.items():
        locations[key] = [
            Chunk(name, item.blob_offset, item.blob_length, item.offset, item.offsets, spec.shape)
            for spec in parts
            if (found := placed.get((key, spec.chunk.offsets))) is not None
            for name, item in [found]
        ]
    for key, first in aliases.items():
        locations[key] = locations[first]
        chunks[key] = chunks[first]
    nbytes = sum(item.nbytes for _, item in placed.values())
    metadata = _metadata(chunks, locations, paths)
    return Layout(files, metadata, locations, nbytes, shared, replicated)


def _metadata(
    chunks: Mapping[str, list[TensorSpec]],
    locations: Mapping[str, list[Chunk]],
    paths: Mapping[str, tuple[str | int, ...]],
) -> Metadata:
    """DCP's record of every tensor: its whole size and chunks, and where each chunk's blob is."""
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[MetadataIndex, Any] = {}
    # One torch.Size per distinct shape: pickle then writes each once (10,000 tensors of 100
    # shapes pickle 5x faster), and DCP's reader sees the same values.
    sizes: dict[tuple[int, ...], torch.Size] = {}
    # One TensorProperties per dtype and one ChunkStorageMetadata per chunk shape too (DCP only
    # reads them): each restore walks the pickle's opcodes before unpickling it, and 10,000
    # tensors of 100 shapes pickle in 540,000 opcodes instead of 850,000.
    properties: dict[torch.dtype, TensorProperties] = {}
    pieces: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata] = {}
    for key, placed in locations.items():
        spec = chunks[key][0]
        whole = sizes.setdefault(spec.whole, torch.Size(spec.whole))
        listed = []
        for chunk in placed:
            origin = sizes.setdefault(chunk.offsets, torch.Size(chunk.offsets))
            extent = sizes.setdefault(chunk.sizes, torch.Size(chunk.sizes))
            listed.append(
                pieces.setdefault((chunk.offsets, chunk.sizes), ChunkStorageMetadata(origin, extent))
            )
            index = MetadataIndex(key)
            # Its offset the one torch.Size too (MetadataIndex makes a new one of what it is
            # given): 7 opcodes fewer a chunk, 11 % of a restore's walk of the pickle.
            object.__setattr__(index, "offset", origin)
            storage_data[index] = storage_info(chunk.file, chunk.blob_offset, chunk.blob_length)
        shared = properties.setdefault(spec.dtype, TensorProperties(dtype=spec.dtype))
        state_dict_metadata[key] = TensorStorageMetadata(shared, whole, listed)
    return Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={key: paths.get(key, (key,)) for key in state_dict_metadata},
        storage_data=storage_data,
        version=DCP_VERSION,
    )
