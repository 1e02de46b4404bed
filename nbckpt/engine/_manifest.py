"""The manifest: written last, it is what makes a checkpoint count, and what restore trusts.

It lists every file with its size and block checksums, every tensor with the file and
offset of its bytes, and the state tree (plain values as JSON). A checkpoint someone hands
you may be hostile: :func:`parse` refuses anything that would make a reader leave the step
directory, read past a file, allocate without bound, or recurse without bound, before a
single byte of tensor data is read.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

import xxhash

from .._errors import CheckpointError
from ._files import BLOCK_SIZE, FileResult
from ._layout import METADATA_FILE
from ._state import MAX_DEPTH, TensorSpec, dtype_from_name, tree_specs

__all__ = ["FORMAT", "MAX_MANIFEST_BYTES", "Manifest", "build", "parse", "sign"]

FORMAT = "nbckpt/2"
#: A manifest holds about 100 bytes per tensor: 64 MiB is room for half a million of them.
MAX_MANIFEST_BYTES = 64 << 20
_DATA_FILE_RE = re.compile(r"__[0-9]{1,6}_[0-9]{1,6}\.distcp", re.ASCII)
_HEX16_RE = re.compile(r"[0-9a-f]{16}", re.ASCII)
#: A rank as ``str(rank)`` spells it (bounded: int() of a hostile key must stay cheap).
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,17}", re.ASCII)
_KINDS = {
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
    "path",
    "dtype",
    "device",
}


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked manifest."""

    step: int
    body: dict[str, Any]

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.body["files"]
        return files

    @property
    def items(self) -> dict[str, list[Any]]:
        items: dict[str, list[Any]] = self.body["items"]
        return items

    def tree(self, rank: int) -> dict[str, Any]:
        """The state tree rank ``rank`` saved."""
        tree: dict[str, Any] = self.body.get("rank_trees", {}).get(str(rank), self.body["tree"])
        return tree

    @property
    def specs(self) -> dict[str, TensorSpec]:
        """Every tensor any rank's tree references: key to spec."""
        specs: dict[str, TensorSpec] = {}
        for tree in [self.body["tree"], *self.body.get("rank_trees", {}).values()]:
            specs.update(tree_specs(tree))
        return specs

    def rng(self, rank: int) -> Any:
        return self.body.get("rng", {}).get(str(rank))

    @property
    def checksum(self) -> str:
        return str(self.body["checksum"])


# The file is ``{"checksum":"<16 hex>",`` then the rest of the JSON object, whose exact bytes
# (with the opening brace) the checksum covers: checking it never re-serializes anything.
_SIGNED = re.compile(rb'\{"checksum":"([0-9a-f]{16})",')


def sign(body: Mapping[str, Any]) -> bytes:
    """``body`` (without a checksum) as manifest bytes, signed."""
    rest = json.dumps({k: v for k, v in body.items() if k != "checksum"}, separators=(",", ":")).encode()
    digest = xxhash.xxh3_64_hexdigest(rest).encode()
    return b'{"checksum":"' + digest + b'",' + rest[1:]


def build(
    *,
    step: int,
    nbytes: int,
    world_size: int,
    files: Mapping[str, FileResult],
    items: Mapping[str, tuple[str, int]],
    tree: dict[str, Any],
    rank_trees: Mapping[str, Any],
    rng: Mapping[str, Any],
    provenance: Mapping[str, Any],
    timing: Mapping[str, float],
) -> bytes:
    """The manifest of a checkpoint whose files have all been written."""
    body: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "unix_time": time.time(),
        "timing": dict(timing),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "bytes": nbytes,
        "world_size": world_size,
        "block_size": BLOCK_SIZE,
        "files": {
            name: {"size": result.size, "blocks": result.blocks} for name, result in sorted(files.items())
        },
        "items": {key: [name, offset] for key, (name, offset) in items.items()},
        "tree": tree,
        **({"rank_trees": dict(rank_trees)} if rank_trees else {}),
        **({"rng": dict(rng)} if rng else {}),
        "provenance": dict(provenance),
    }
    return sign(body)


def parse(data: bytes, step: int, where: str) -> Manifest:
    """Check a manifest read from ``where`` (``step-NNNNNN/manifest.json``) completely."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where} is larger than a manifest may be ({MAX_MANIFEST_BYTES} bytes)")
    try:
        body = json.loads(data)
    except RecursionError:
        raise CheckpointError(f"{where} is unreadable (nested too deeply)") from None
    except ValueError as exc:
        raise CheckpointError(f"{where} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict) or not str(body.get("format", "")).startswith("nbckpt/"):
        raise CheckpointError(f"{where} is not an nbckpt manifest")
    if body["format"] != FORMAT:
        raise CheckpointError(
            f"{where} is in format {body['format']}, this nbckpt reads {FORMAT}; "
            "its tensors load with torch.distributed.checkpoint.load"
        )
    signed = _SIGNED.match(data)
    if signed is None or xxhash.xxh3_64_hexdigest(b"{" + data[signed.end() :]).encode() != signed.group(1):
        raise CheckpointError(f"{where} was modified after it was written (checksum mismatch)")
    if body.get("step") != step:
        raise CheckpointError(f"{where} names step {body.get('step')}, not {step}")
    _check_body(body, where)
    return Manifest(step, body)


def _check_body(body: dict[str, Any], where: str) -> None:
    if body.get("block_size") != BLOCK_SIZE:
        raise CheckpointError(f"{where} uses blocks of {body.get('block_size')} bytes, not {BLOCK_SIZE}")
    files = body.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        raise CheckpointError(f"{where} lists no DCP metadata file")
    for name, meta in files.items():
        if not (name == METADATA_FILE or _DATA_FILE_RE.fullmatch(name)):
            raise CheckpointError(f"{where} names a file outside the checkpoint: {name!r}")
        size = meta.get("size") if isinstance(meta, dict) else None
        blocks = meta.get("blocks") if isinstance(meta, dict) else None
        if not (
            _is_count(size)
            and isinstance(blocks, list)
            and len(blocks) == -(-size // BLOCK_SIZE)
            and all(isinstance(b, str) and _HEX16_RE.fullmatch(b) for b in blocks)
        ):
            raise CheckpointError(f"{where} has a malformed entry for {name!r}")
    items = body.get("items")
    if not isinstance(items, dict):
        raise CheckpointError(f"{where} has no list of tensors")
    world_size = body.get("world_size")
    rank_trees = body.get("rank_trees", {})
    if not (
        _is_count(world_size)
        and isinstance(rank_trees, dict)
        # Not ``rank in {str(r) for r in range(world_size)}``: a hostile world size would make that
        # set a huge allocation, built again for every rank.
        and all(_RANK_RE.fullmatch(rank) and int(rank) < world_size for rank in rank_trees)
    ):
        raise CheckpointError(f"{where} has a malformed state tree")
    trees = [body.get("tree"), *rank_trees.values()]
    for tree in trees:
        _check_tree(tree, files, items, where)
    if not isinstance(body.get("rng", {}), dict):
        raise CheckpointError(f"{where} has a malformed RNG record")


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_tree(tree: Any, files: dict[str, Any], items: dict[str, Any], where: str) -> None:
    """Every node well-formed and every tensor inside its file, walked without recursion."""
    if not (isinstance(tree, dict) and tree.get("t") == "dict"):
        raise CheckpointError(f"{where} has a malformed state tree")
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH + 2 or not isinstance(node, dict) or node.get("t") not in _KINDS:
            raise CheckpointError(f"{where} has a malformed state tree")
        kind = node["t"]
        children: list[Any] = []
        if kind in ("module", "optimizer", "stateful"):
            children = [node.get("state")]
        elif kind in ("dict", "namespace"):
            pairs = node.get("items")
            if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int)) for p in pairs
            ):
                raise CheckpointError(f"{where} has a malformed state tree")
            children = [child for _, child in pairs]
        elif kind in ("list", "tuple"):
            listed = node.get("items")
            children = listed if isinstance(listed, list) else [None]
        elif kind in ("tensor", "ndarray"):
            _check_tensor(node, files, items, where)
        stack.extend((child, depth + 1) for child in children)


def _check_tensor(node: dict[str, Any], files: dict[str, Any], items: dict[str, Any], where: str) -> None:
    key, shape = node.get("key"), node.get("shape")
    if not (isinstance(key, str) and isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise CheckpointError(f"{where} has a malformed tensor entry")
    dtype = dtype_from_name(node.get("dtype"))
    entry = items.get(key)
    if not (isinstance(entry, list) and len(entry) == 2 and _is_count(entry[1])):
        raise CheckpointError(f"{where} does not say where tensor {key!r} is")
    name, offset = entry
    if name not in files or name == METADATA_FILE:
        raise CheckpointError(f"{where} puts tensor {key!r} in {name!r}, which it does not list")
    size = files[name]["size"]
    # Bounded before multiplying: a hostile shape must not become a huge allocation.
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
        if nbytes > size:
            break
    if offset + nbytes > size:
        raise CheckpointError(
            f"{where} puts tensor {key!r} at bytes {offset}..{offset + nbytes} of {name}, which has {size}"
        )
