"""Checkpoints ``torch.distributed.checkpoint.save`` wrote (torchtitan's ``step-N`` folders), read
so that a run can move to nbckpt mid-way: :class:`PlainDcpSteps` presents those in a store's
folder as committed steps of a read-only kind, each one a manifest (made here) plus the reads
any manifest's chunks say. The rest of the engine knows nothing of them but what that manifest
says: no block checksums (its files list none), no separate ``.metadata`` to compare with (its
files list none), and chunks whose data only loading the blob finds (``Chunk.located`` false).

Such a step's ``.metadata`` (read with the restricted unpickler) becomes a manifest of nbckpt's
shape, and every blob is read with ``torch.load(weights_only=True)``; a value that does not load
so, or that nbckpt's tree cannot hold (a set, a complex, a BytesIO) is left out, with one warning
naming its key (a restore that asks for it is told it is not there); bytes (torchtitan's pickled
dataloader state) are kept as opaque bytes, never unpickled.

Every field of ``.metadata`` is checked for its type and range before it is used, and no file
costs more than its size: each tensor's chunks lie inside their byte ranges, no two ranges
overlap (so what is allocated never exceeds the data files together), and the planner data
leaves at most one empty list position per key (and :data:`SPARE_HOLES` more).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import reprlib
import stat
import time
import warnings
from typing import Any, TypeGuard

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .._errors import CheckpointError, NbckptError, describe_error
from ._files import Source, damage_named
from ._format import MANIFEST, MAX_METADATA_BYTES, METADATA_FILE, Chunk, is_data_file
from ._manifest import Manifest
from ._shards import tiles
from ._state import MAX_DEPTH, TensorSpec, dtype_from_name, dtype_name, flatten
from ._store import LocalStore, Store
from ._unpickle import load_blob, load_metadata

__all__ = ["PlainDcpSteps", "plain_dcp_steps", "read_dcp_manifest", "said_shared"]

#: The format a manifest made from a plain DCP checkpoint says it is in.
DCP_FORMAT = "dcp"
#: Empty list positions the planner data may leave beyond one per key (a list holding an empty
#: dict has one): a 2 KB file placing a value at position 2**20 - 1 would make a million nodes.
SPARE_HOLES = 1024


#: A step folder of another writer: torchtitan names them ``step-{step}``, without padding.
_DCP_STEP_RE = re.compile(r"step-([0-9]{1,18})", re.ASCII)


class PlainDcpSteps:
    """The steps plain DCP wrote in the folder of ``store`` (a local one: nothing elsewhere), as a
    place the restorer reads committed steps from. Read-only: nbckpt never changes or deletes
    them. Where nbckpt committed a step of the same number there, that one alone counts."""

    def __init__(self, store: Store) -> None:
        self.store, self.url, self.is_local = store, store.url, store.is_local

    def written(self) -> dict[int, str]:
        """Every step folder plain DCP wrote there (beside an nbckpt step of its number too);
        none in an object store, which is never listed for them."""
        return plain_dcp_steps(self.url, self.store.names()) if isinstance(self.store, LocalStore) else {}

    def committed(self) -> dict[int, str]:
        return {s: path for s, path in self.written().items() if self.store.committed_at(s) is None}

    def committed_at(self, step: int) -> str | None:
        location = self.written().get(step)
        return location if location is not None and self.store.committed_at(step) is None else None

    def read_manifest(self, step: int, location: str) -> tuple[Manifest, bytes]:
        """The manifest made from the step's ``.metadata`` (no bytes of a manifest file)."""
        with damage_named(f"{location.rstrip('/').rsplit('/', 1)[-1]}/{METADATA_FILE}"):
            return read_dcp_manifest(self.store, step, location), b""

    def modified(self, location: str, name: str) -> float:
        return self.store.modified(location, name)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        return self.store.read_small(location, name, limit)

    def source(self, location: str, name: str, size: int | None) -> Source:
        return self.store.source(location, name, size)


def said_shared(store: Store, stacklevel: int) -> None:
    """Warn when the directory nbckpt saves into holds step folders plain DCP wrote: torchtitan's
    CheckpointManager takes any name holding ``step-<digits>`` with a ``.metadata`` for that step
    and opens ``step-<int>``, so it would pick nbckpt's ``step-000008`` and open ``step-8``, and
    its ``keep_latest_k`` deletes nbckpt's steps as its own."""
    written = PlainDcpSteps(store).written().values()
    folders = [path for path in written if path.rstrip("/") != store.url.rstrip("/")]
    if folders:
        names = ", ".join(path.rstrip("/").rsplit("/", 1)[-1] for path in folders[-3:])
        warnings.warn(
            f"nbckpt: {store.url} holds step folders plain DCP wrote ({names}); torchtitan reads "
            f"nbckpt's step-NNNNNN there as step-N and fails: save nbckpt's steps in a subfolder "
            "(restore from this one with read_only=True)",
            stacklevel=stacklevel,
        )


def plain_dcp_steps(root: str, names: list[str]) -> dict[int, str]:
    """DCP checkpoints in ``root`` (whose entries are ``names``): ``step-N`` folders with a
    ``.metadata`` and no manifest, or ``root`` itself (its step: the N of its name, else 0)."""
    steps = {}
    if _is_dcp(root):
        match = _DCP_STEP_RE.fullmatch(os.path.basename(root))
        steps[int(match.group(1)) if match else 0] = root
    for name in names:
        match = _DCP_STEP_RE.fullmatch(name)
        if match is not None and _is_dcp(os.path.join(root, name)):
            steps.setdefault(int(match.group(1)), os.path.join(root, name))
    return dict(sorted(steps.items()))


def _is_dcp(path: str) -> bool:
    """A directory (not a link to one) holding DCP's ``.metadata`` and no nbckpt manifest."""
    try:
        if os.path.islink(path) or not stat.S_ISREG(os.lstat(os.path.join(path, METADATA_FILE)).st_mode):
            return False
    except OSError:
        return False
    return not os.path.lexists(os.path.join(path, MANIFEST))


def read_dcp_manifest(store: Any, step: int, location: str) -> Manifest:
    """The manifest of the DCP checkpoint at ``location``: its files, tensors, chunks and tree.
    Anything malformed in ``.metadata`` is a CheckpointError naming it and the field."""
    label = f"{location.rstrip('/').rsplit('/', 1)[-1]}/{METADATA_FILE}"
    data = store.read_small(location, METADATA_FILE, MAX_METADATA_BYTES)
    metadata = load_metadata(data, label)
    try:
        found = _Entries(store, location, label, metadata)
        tree = _Nest(label, len(found.paths)).tree(found)
    except (AttributeError, TypeError, ValueError, LookupError, RuntimeError, OverflowError) as exc:
        # A field of DCP's classes holding what the checks above did not foresee.
        raise CheckpointError(f"{label}: malformed DCP metadata ({describe_error(exc)})") from None
    if found.skipped:
        left = ", ".join(f"{key} ({why})" for key, why in found.skipped.items())
        warnings.warn(f"nbckpt: {label} holds value(s) nbckpt does not read, left out: {left}", stacklevel=5)
    written = store.modified(location, METADATA_FILE)
    items = found.items
    body = {
        "checksum": xxhash.xxh3_64_hexdigest(data),  # what the ranks compare: all read one .metadata
        "format": DCP_FORMAT,
        "step": step,
        "unix_time": written,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(written)),
        "bytes": sum(c.blob_length for chunks in items.values() for c in chunks),
        "world_size": len({name.split("_")[2] for name in found.sizes}),  # __<rank>_<i>.distcp
        "files": {name: {"size": size, "blocks": None} for name, size in sorted(found.sizes.items())},
        "items": {
            key: [[*c[:4], list(c.offsets), list(c.sizes)] for c in chunks] for key, chunks in items.items()
        },
        "tree": tree,
        "provenance": {"program": "torch.distributed.checkpoint.save"},
        **({"left_out": dict(found.skipped)} if found.skipped else {}),
    }
    return Manifest(step, body, items, found.specs)


class _Entries:
    """The entries of a DCP ``Metadata``, each field checked: tensors (their chunks where the
    storage data puts them), plain values (read, and encoded as nbckpt's tree nodes), and the
    values left out, with why."""

    def __init__(self, store: Any, location: str, label: str, metadata: Any) -> None:
        self.store, self.location, self.label = store, location, label
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{label} holds a {type(metadata).__name__}, not DCP's Metadata")
        entries, self.storage = metadata.state_dict_metadata, metadata.storage_data
        planner = metadata.planner_data
        for name, value in (("state_dict_metadata", entries), ("storage_data", self.storage)):
            if not isinstance(value, dict):
                raise CheckpointError(f"{label}: its {name} is a {type(value).__name__}, not a dict")
        self.sizes: dict[str, int] = {}
        self.items: dict[str, list[Chunk]] = {}
        self.specs: dict[str, TensorSpec] = {}
        self.values: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = {}
        self.ranges: list[tuple[str, int, int, str]] = []
        for key, entry in entries.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{label}: an entry is named {key!r}")
            if isinstance(entry, TensorStorageMetadata):
                self.tensor(key, entry)
            elif isinstance(entry, BytesStorageMetadata):
                self.value(key)
            else:
                raise CheckpointError(f"{label}: entry {key!r} is a {type(entry).__name__}")
        self.apart()
        planned = planner if isinstance(planner, dict) else {}
        self.paths = {key: planned.get(key, (key,)) for key in [*self.specs, *self.values, *self.skipped]}
        placed: dict[str, str] = {}
        for key, path in self.paths.items():  # one place, one entry: else two readers read two values
            other = placed.setdefault(repr(tuple(path) if isinstance(path, list) else path), key)
            if other != key:
                raise CheckpointError(f"{label}: its planner data puts {other!r} and {key!r} in one place")

    def tensor(self, key: str, entry: TensorStorageMetadata) -> None:
        label, properties = self.label, entry.properties
        dtype = properties.dtype if isinstance(properties, TensorProperties) else None
        if not isinstance(dtype, torch.dtype):
            raise CheckpointError(f"{label}: the properties of {key!r} name no dtype ({dtype!r})")
        try:  # never a dtype stored in fewer bytes than it has
            dtype = dtype_from_name(dtype_name(dtype))
        except CheckpointError:
            raise CheckpointError(f"{label}: {key!r} has dtype {dtype}, which nbckpt does not read") from None
        shape = _counts(entry.size, label, f"the size of {key!r}")
        if not isinstance(entry.chunks, list):
            raise CheckpointError(f"{label}: the chunks of {key!r} are a {type(entry.chunks).__name__}")
        chunks = [self.chunk(key, chunk, len(shape), dtype.itemsize) for chunk in entry.chunks]
        if not tiles([c.region for c in chunks], shape):
            raise CheckpointError(f"{label}: the chunks of {key!r} do not make up its shape {list(shape)}")
        self.specs[key] = TensorSpec(key, dtype, shape)
        self.items[key] = [c for c in chunks if c.blob_length]

    def chunk(self, key: str, chunk: Any, ndim: int, itemsize: int) -> Chunk:
        what = f"a chunk of {key!r}"
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CheckpointError(f"{self.label}: {what} is a {type(chunk).__name__}")
        offsets = _counts(chunk.offsets, self.label, f"the offsets of {what}")
        extent = _counts(chunk.sizes, self.label, f"the sizes of {what}")
        if len(offsets) != ndim or len(extent) != ndim:
            raise CheckpointError(f"{self.label}: {what} has other dimensions than {key!r} ({list(offsets)})")
        nbytes = math.prod(extent) * itemsize
        if not nbytes:
            return Chunk("", 0, 0, 0, offsets, extent)  # an empty shard: nothing to read
        name, offset, length = self.where(MetadataIndex(key, offsets), key)
        if length < nbytes:  # its blob holds the data and more: never allocate past the files
            raise CheckpointError(
                f"{self.label}: {what} at {list(offsets)} is {nbytes} bytes, its storage entry {length}"
            )
        return Chunk(name, offset, length, -1, offsets, extent)  # not located: its blob is loaded

    def value(self, key: str) -> None:
        name, offset, length = self.where(MetadataIndex(key), key)
        blob = _read(self.store, self.location, name, self.sizes[name], offset, length)
        try:
            value = load_blob(blob, f"{self.label}: value {key!r}")
        except CheckpointError:
            self.skipped[key] = "does not load with weights only"
            return
        try:
            encoded = flatten({"v": value})
        except NbckptError:
            self.skipped[key] = f"a {type(value).__name__}, which nbckpt's tree does not hold"
            return
        if encoded.tensors:
            self.skipped[key] = "holds tensors inside a value"
            return
        self.values[key] = encoded.tree["items"][0][1]

    def where(self, index: MetadataIndex, key: str) -> tuple[str, int, int]:
        """The file and byte range of the storage entry ``index`` of ``key``, checked to lie
        inside a data file of the step."""
        info, label = self.storage.get(index), self.label
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{label}: {key!r} is stored through DCP transforms nbckpt does not read")
        if not (isinstance(name, str) and is_data_file(name)):
            raise CheckpointError(f"{label}: {key!r} is stored in {name!r}, not a DCP data file of the step")
        if name not in self.sizes:
            source = self.store.source(self.location, name, None)
            self.sizes[name] = source.size
            source.close()
        if not (_is_count(offset) and _is_count(length)):
            raise CheckpointError(f"{label}: the storage entry of {key!r} is at {offset!r}, {length!r} bytes")
        if offset + length > self.sizes[name]:
            raise CheckpointError(f"{label}: {key!r} lies past the end of {name} ({self.sizes[name]} bytes)")
        if length:
            self.ranges.append((name, offset, length, key))
        return name, offset, length

    def apart(self) -> None:
        """No byte of the files in two entries: so all a read allocates fits in the files."""
        for before, after in itertools.pairwise(sorted(self.ranges)):
            if before[0] == after[0] and before[1] + before[2] > after[1]:
                raise CheckpointError(
                    f"{self.label}: the storage entries of {before[3]!r} and {after[3]!r} overlap in "
                    f"{after[0]}"
                )


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _counts(value: Any, label: str, what: str) -> tuple[int, ...]:
    """A shape, offsets or sizes of ``.metadata``: at most 64 counts below 2**63."""
    if not (isinstance(value, (tuple, list)) and len(value) <= MAX_DEPTH and all(map(_is_count, value))):
        raise CheckpointError(f"{label}: {what} is not a list of counts ({reprlib.repr(value)})")
    return tuple(value)


def _read(store: Any, location: str, name: str, size: int, offset: int, length: int) -> bytes:
    data = bytearray(length)
    source = store.source(location, name, size)
    try:
        source.readinto(offset, [memoryview(data)])
    finally:
        source.close()
    return bytes(data)


class _Nest:
    """The state as DCP's planner data nests it (mapping keys, list positions), as nbckpt's tree,
    made with at most one empty list position per key (and :data:`SPARE_HOLES` more)."""

    def __init__(self, label: str, keys: int) -> None:
        self.label, self.spare = label, SPARE_HOLES + keys

    def tree(self, found: _Entries) -> dict[str, Any]:
        root: dict[str, Any] = {}
        for key, path in found.paths.items():
            if not (
                isinstance(path, tuple)
                and 0 < len(path) <= MAX_DEPTH
                and all(isinstance(p, str) or _is_count(p) for p in path)
            ):
                raise CheckpointError(f"{self.label}: the planner data of {key!r} is malformed")
            node: Any = root
            for part, after in itertools.pairwise(path):
                node = self.child(node, part, [] if isinstance(after, int) else {})
            if key in found.specs:
                self.child(node, path[-1], found.specs[key])
            elif key in found.values:
                self.child(node, path[-1], _Value(found.values[key]))
        return _node(root)

    def child(self, node: Any, part: Any, new: Any) -> Any:
        """``node[part]``, made ``new`` where it is not there yet (a list grows to reach ``part``)."""
        if isinstance(node, list):
            if not isinstance(part, int):
                raise CheckpointError(f"{self.label}: a DCP path has a list position {part!r}")
            holes = part - len(node)
            if holes > 0:
                self.spare -= holes
                if self.spare < 0:
                    raise CheckpointError(
                        f"{self.label}: the planner data leaves more empty list positions than "
                        f"{SPARE_HOLES} and one per key (position {part})"
                    )
                node.extend([None] * holes)
            if part == len(node):
                node.append(new)
            elif node[part] is None:
                node[part] = new
            return node[part]
        if not isinstance(node, dict):
            raise CheckpointError(f"{self.label}: two DCP paths disagree on what {part!r} is in")
        return node.setdefault(part, new)


class _Value:
    """A plain value's tree node, kept apart from the containers being nested."""

    def __init__(self, node: dict[str, Any]) -> None:
        self.node = node


def _node(value: Any) -> dict[str, Any]:
    if isinstance(value, TensorSpec):
        return {
            "t": "tensor",
            "key": value.key,
            "dtype": dtype_name(value.dtype),
            "shape": list(value.shape),
            "device": "cpu",
        }
    if isinstance(value, dict):
        return {"t": "dict", "items": [[k, _node(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return {"t": "list", "items": [_node(v) for v in value]}
    if isinstance(value, _Value):
        return value.node
    return {"t": "value", "v": None}  # a list position no key fills
