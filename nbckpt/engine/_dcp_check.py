"""A step's DCP metadata and plain values' byte items say exactly what its manifest says.

Both readers of a checkpoint agree on every byte: nbckpt's (the manifest) and a plain
``torch.distributed.checkpoint.load`` (the ``.metadata`` pickle, the blobs' framing). A step
whose ``.metadata`` says anything the manifest does not, or whose byte items
(:mod:`._dcp_values`) hold other values, is refused like a damaged one, by ``restore`` and
``load`` as by ``verify``.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from .._errors import CheckpointError, describe_error
from ._dcp_values import dcp_values
from ._format import METADATA_FILE
from ._manifest import Manifest
from ._reader import Readable, read_file, stat_files, step_file_label
from ._unpickle import load_metadata, plain_blob

__all__ = ["check_dcp_metadata", "check_values"]


def all_values(manifest: Manifest) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """Every rank's plain values not stored as tensors, each key once: the lowest rank's."""
    rank_trees = manifest.body.get("rank_trees", {})
    trees = [manifest.tree(0), *(rank_trees[rank] for rank in sorted(rank_trees, key=int))]
    found: dict[str, tuple[str, tuple[str | int, ...], Any]] = {}
    for tree in trees:
        for key, path, value in dcp_values(tree):
            if key not in manifest.specs:
                found.setdefault(key, (key, path, value))
    return list(found.values())


class ValueSpan(NamedTuple):
    """Where DCP's metadata says a plain value's byte item is, and the value it must hold."""

    key: str
    file: str
    offset: int
    length: int
    value: Any


def check_dcp_metadata(data: bytes, manifest: Manifest, where: str) -> list[ValueSpan]:
    """Refuse DCP metadata that says other than the manifest: only DCP's classes unpickle; every
    tensor the manifest lists and nothing else, with its dtype, shape and chunks, each stored
    where the manifest puts its blob; each plain value a byte item. Returns where those are."""
    metadata = load_metadata(data, where)
    try:
        return _check(metadata, manifest, where)
    except (AttributeError, TypeError, ValueError, LookupError, RuntimeError, OverflowError) as exc:
        # DCP's classes with other fields in them
        raise CheckpointError(f"{where}: malformed DCP metadata ({describe_error(exc)})") from None


def _check(metadata: Any, manifest: Manifest, where: str) -> list[ValueSpan]:
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.storage_data, dict)
        and isinstance(metadata.state_dict_metadata, dict)
    ):
        raise CheckpointError(f"{where}: DCP metadata is a {type(metadata).__name__}")
    specs = manifest.specs
    found = all_values(manifest)
    values = {key: value for key, _, value in found}
    entries = metadata.state_dict_metadata
    for key in entries:
        if key not in specs and key not in values:
            raise CheckpointError(f"{where}: entry {key!r} is not in the manifest; refusing to unpickle it")
    planned = {**{key: path for key, path, _ in found}, **{key: manifest.paths[key] for key in specs}}
    if not isinstance(metadata.planner_data, dict) or metadata.planner_data != planned:
        raise CheckpointError(f"{where}: the planner data does not nest the state as the manifest does")
    storage = metadata.storage_data
    expected = 0
    for key, spec in specs.items():
        entry = entries.get(key)
        chunks = manifest.items[key]
        if not (
            isinstance(entry, TensorStorageMetadata)
            and tuple(entry.size) == spec.shape
            and entry.properties.dtype == spec.dtype
            and sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            == sorted((c.offsets, c.sizes) for c in chunks)
        ):
            raise CheckpointError(f"{where}: entry {key!r} does not match the manifest")
        for chunk in chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if (
                getattr(info, "relative_path", None),
                getattr(info, "offset", None),
                getattr(info, "length", None),
            ) != (chunk.file, chunk.blob_offset, chunk.blob_length):
                raise CheckpointError(
                    f"{where}: the storage entry of {key!r} at {list(chunk.offsets)} is not where its data "
                    f"is ({chunk.file} bytes {chunk.blob_offset}..{chunk.blob_offset + chunk.blob_length})"
                )
        expected += len(chunks)
    spans = [_value_span(key, value, entries, storage, manifest, where) for key, value in values.items()]
    if len(storage) != expected + len(spans):
        raise CheckpointError(f"{where}: has storage entries the manifest does not list")
    return spans


def _value_span(
    key: str, value: Any, entries: dict[str, Any], storage: dict[Any, Any], manifest: Manifest, where: str
) -> ValueSpan:
    info = storage.get(MetadataIndex(key))
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(entries.get(key), BytesStorageMetadata):
        raise CheckpointError(f"{where}: value {key!r} is not a DCP byte item")
    if not isinstance(name, str) or name == METADATA_FILE or name not in manifest.files:
        raise CheckpointError(f"{where}: a storage entry names a file the manifest does not list: {name!r}")
    if not (
        isinstance(offset, int)
        and isinstance(length, int)
        and offset >= 0
        and 0 < length <= MAX_VALUE_BYTES
        and offset + length <= manifest.files[name]["size"]
    ):
        raise CheckpointError(f"{where}: the storage entry of {key!r} is outside its data")
    return ValueSpan(key, name, offset, length, value)


#: A plain value's byte item (a float, a list of parameter names) is small; a larger one is refused.
MAX_VALUE_BYTES = 16 << 20


def check_values(store: Readable, location: str, manifest: Manifest, spans: list[ValueSpan]) -> None:
    """Read each plain value's DCP byte item and check it holds that value and nothing else: a
    pickle with no global in it, so a plain ``dcp.load`` runs no code of anyone's."""
    stat_files(store, location, manifest, (span.file for span in spans))  # before allocating
    by_file: dict[str, list[tuple[ValueSpan, bytearray]]] = {}
    for span in spans:
        by_file.setdefault(span.file, []).append((span, bytearray(span.length)))
    for name, found in by_file.items():
        found.sort(key=lambda f: f[0].offset)
        for (before, _), (after, _) in itertools.pairwise(found):
            if before.offset + before.length > after.offset:
                raise CheckpointError(f"{step_file_label(location, name)}: two values' byte items overlap")
        read_file(store, location, name, manifest, [(s.offset, memoryview(b)) for s, b in found], True)
        for span, data in found:
            if not same_value(
                plain_blob(bytes(data), f"{step_file_label(location, name)}: value {span.key!r}"), span.value
            ):
                raise CheckpointError(
                    f"{step_file_label(location, name)}: the byte item of {span.key!r} does not hold "
                    "the manifest's value"
                )


def same_value(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (a tuple is not a list; NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)
