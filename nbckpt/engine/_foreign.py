"""Checkpoints ``torch.distributed.checkpoint.save`` wrote (torchtitan's ``step-N`` folders), read
so that a run can move to nbckpt mid-way. Such a step has no manifest and no checksums: its
``.metadata`` (read with the restricted unpickler) becomes a manifest of nbckpt's shape, and every
blob is read with ``torch.load(weights_only=True)``; a value that does not load so is left out,
with a warning.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import stat
import time
import warnings
from typing import Any

import xxhash
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

from .._errors import CheckpointError
from ._format import MANIFEST, METADATA_FILE, Chunk, is_data_file
from ._manifest import Manifest
from ._shards import Region, tiles
from ._state import TensorSpec, dtype_name, flatten
from ._unpickle import MetadataUnpickler, load_blob

__all__ = ["dcp_steps", "read_dcp_manifest"]

#: The format a manifest made from a plain DCP checkpoint says it is in.
FOREIGN = "dcp"
#: DCP's ``.metadata`` grows with tensors times ranks: far more room than a manifest gets.
MAX_METADATA_BYTES = 1 << 30


#: A step folder of another writer: torchtitan names them ``step-{step}``, without padding.
_DCP_STEP_RE = re.compile(r"step-([0-9]{1,18})", re.ASCII)


def dcp_steps(root: str, names: list[str]) -> dict[int, str]:
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
    """The manifest of the DCP checkpoint at ``location``: its files, tensors, chunks and tree."""
    label = f"{location.rstrip('/').rsplit('/', 1)[-1]}/{METADATA_FILE}"
    data = store.read_small(location, METADATA_FILE, MAX_METADATA_BYTES)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
        entries, storage = metadata.state_dict_metadata, metadata.storage_data
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    except Exception as exc:
        raise CheckpointError(f"{label}: unsafe or unreadable DCP metadata ({exc})") from None
    sizes: dict[str, int] = {}
    items: dict[str, list[Chunk]] = {}
    specs: dict[str, TensorSpec] = {}
    values: dict[str, Any] = {}
    skipped: list[str] = []
    for key, entry in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{label}: an entry is named {key!r}")
        if isinstance(entry, TensorStorageMetadata):
            specs[key] = TensorSpec(key, entry.properties.dtype, tuple(int(n) for n in entry.size))
            items[key] = [
                _chunk(key, chunk, storage, sizes, store, location, label) for chunk in entry.chunks
            ]
            items[key] = [c for c in items[key] if c.blob_length]
            if not tiles([c.region for c in items[key]], specs[key].shape):
                raise CheckpointError(f"{label}: the chunks of {key!r} do not make up its shape")
        elif isinstance(entry, BytesStorageMetadata):
            name, offset, length = _where(storage.get(MetadataIndex(key)), sizes, store, location, label, key)
            blob = _read(store, location, name, sizes[name], offset, length)
            try:
                values[key] = load_blob(blob, f"{label}: value {key!r}")
            except CheckpointError:
                skipped.append(key)
        else:
            raise CheckpointError(f"{label}: entry {key!r} is a {type(entry).__name__}")
    if skipped:
        warnings.warn(f"nbckpt: {label} holds value(s) that do not load with weights only, left out: "
                      f"{', '.join(skipped)}", stacklevel=4)
    tree = _tree(specs, values, paths, label)
    written = store.modified(location, METADATA_FILE)
    body = {
        "checksum": xxhash.xxh3_64_hexdigest(data),  # what the ranks compare: all read one .metadata
        "format": FOREIGN,
        "step": step,
        "unix_time": written,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(written)),
        "bytes": sum(c.blob_length for chunks in items.values() for c in chunks),
        "world_size": len({name.split("_")[2] for name in sizes}),  # __<rank>_<i>.distcp
        "files": {name: {"size": size, "blocks": None} for name, size in sorted(sizes.items())},
        "items": {
            key: [[*c[:4], list(c.offsets), list(c.sizes)] for c in chunks] for key, chunks in items.items()
        },
        "tree": tree,
        "provenance": {"program": "torch.distributed.checkpoint.save"},
    }
    return Manifest(step, body, items, specs, foreign=True)


def _where(
    info: Any, sizes: dict[str, int], store: Any, location: str, label: str, key: str
) -> tuple[str, int, int]:
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{label}: {key!r} is stored through DCP transforms nbckpt does not read")
    if not (isinstance(name, str) and is_data_file(name)):
        raise CheckpointError(f"{label}: {key!r} is stored in {name!r}, not a DCP data file of the step")
    if name not in sizes:
        source = store.source(location, name, None)
        sizes[name] = source.size
        source.close()
    if not (isinstance(offset, int) and isinstance(length, int) and offset >= 0 and length >= 0):
        raise CheckpointError(f"{label}: the storage entry of {key!r} is malformed")
    if offset + length > sizes[name]:
        raise CheckpointError(f"{label}: {key!r} lies past the end of {name} ({sizes[name]} bytes)")
    return name, offset, length


def _chunk(
    key: str, chunk: Any, storage: Any, sizes: dict[str, int], store: Any, location: str, label: str
) -> Chunk:
    offsets, extent = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
    if not Region(offsets, extent).numel:
        return Chunk("", 0, 0, 0, offsets, extent)  # an empty shard: nothing to read
    name, offset, length = _where(
        storage.get(MetadataIndex(key, offsets)), sizes, store, location, label, key
    )
    return Chunk(name, offset, length, -1, offsets, extent)


def _read(store: Any, location: str, name: str, size: int, offset: int, length: int) -> bytes:
    data = bytearray(length)
    source = store.source(location, name, size)
    try:
        source.readinto(offset, [memoryview(data)])
    finally:
        source.close()
    return bytes(data)


def _tree(
    specs: dict[str, TensorSpec], values: dict[str, Any], paths: dict[Any, Any], label: str
) -> dict[str, Any]:
    """The state as DCP's planner data nests it (mapping keys, list positions), as nbckpt's tree."""
    root: dict[str, Any] = {}
    for key in [*specs, *values]:
        path = paths.get(key, (key,))
        if not (isinstance(path, tuple) and path and all(isinstance(p, (str, int)) for p in path)):
            raise CheckpointError(f"{label}: the planner data of {key!r} is malformed")
        node: Any = root
        for part, after in itertools.pairwise(path):
            node = _child(node, part, [] if isinstance(after, int) else {}, label)
        _child(node, path[-1], specs[key] if key in specs else _Value(values[key]), label)
    return _node(root)


class _Value:
    """A plain value from a DCP byte item, kept apart from the containers being nested."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _child(node: Any, part: Any, new: Any, label: str) -> Any:
    """``node[part]``, made ``new`` where it is not there yet (a list grows to reach ``part``)."""
    if isinstance(node, list):
        if not isinstance(part, int) or not 0 <= part < 1 << 20:
            raise CheckpointError(f"{label}: a DCP path has a list position {part!r}")
        node.extend([None] * (part + 1 - len(node)))
        if node[part] is None:
            node[part] = new
        return node[part]
    if not isinstance(node, dict):
        raise CheckpointError(f"{label}: two DCP paths disagree on what {part!r} is in")
    return node.setdefault(part, new)


def _node(value: Any) -> dict[str, Any]:
    if isinstance(value, TensorSpec):
        return {"t": "tensor", "key": value.key, "dtype": dtype_name(value.dtype), "shape": list(value.shape),
                "device": "cpu"}
    if isinstance(value, dict):
        return {"t": "dict", "items": [[k, _node(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return {"t": "list", "items": [_node(v) for v in value]}
    plain = value.value if isinstance(value, _Value) else value
    encoded = flatten({"v": plain})
    if encoded.tensors:  # a byte item that holds tensors: nbckpt has no place for them
        return {"t": "value", "v": None}
    node: dict[str, Any] = encoded.tree["items"][0][1]
    return node
