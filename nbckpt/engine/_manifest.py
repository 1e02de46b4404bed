"""The manifest: written last, it is what makes a checkpoint count, and what restore trusts. It
lists every file with its size and block checksums, every tensor's chunks and where their bytes
are, the state tree (plain values as JSON) and where the step came from. A checkpoint may be
hostile: :func:`parse` refuses anything that would make a reader leave the step directory, read
past a file, or allocate or recurse without bound, before a byte of tensor data is read.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import torch

from .._errors import CheckpointError
from ._files import FileResult
from ._format import (
    BLOCK_SIZE,
    FORMAT,
    MANIFEST_KEYS,
    MAX_MANIFEST_BYTES,
    METADATA_FILE,
    METRICS,
    READS,
    TREE_KINDS,
    Chunk,
    checksum,
    framing,
    is_data_file,
)
from ._shards import tiles
from ._state import MAX_BYTES_VALUE, MAX_DEPTH, TensorSpec, dtype_from_name, dtype_name, numpy_has

__all__ = ["Manifest", "build", "parse", "provenance", "sign"]

_HEX16_RE = re.compile(r"[0-9a-f]{16}", re.ASCII)
#: A rank as ``str(rank)`` spells it (bounded: int() of a hostile key must stay cheap).
_RANK_RE = re.compile(r"0|[1-9][0-9]{0,17}", re.ASCII)


@dataclass(frozen=True)
class Manifest:
    """A parsed, checked manifest."""

    step: int
    body: dict[str, Any]
    items: dict[str, list[Chunk]] = field(default_factory=dict)
    """Each tensor's chunks and where their bytes are (checked: inside their files, apart from
    each other, making up the whole tensor exactly)."""
    specs: dict[str, TensorSpec] = field(default_factory=dict)
    """Every tensor any rank's tree references: key to the dtype and shape of the whole tensor."""
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    """Each tensor's path of keys in rank 0's tree (DCP's planner data says the same)."""

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = self.body["files"]
        return files

    @property
    def checksummed(self) -> list[str]:
        """The files whose blocks carry checksums: every file of an nbckpt step (parse refuses
        one without); none of a step made from another writer's ``.metadata``."""
        return [name for name, meta in self.files.items() if meta["blocks"] is not None]

    def tree(self, rank: int) -> dict[str, Any]:
        """The state tree rank ``rank`` saved."""
        tree: dict[str, Any] = self.body.get("rank_trees", {}).get(str(rank), self.body["tree"])
        return tree

    def rng(self, rank: int) -> Any:
        return self.body.get("rng", {}).get(str(rank))

    @property
    def checksum(self) -> str:
        return str(self.body["checksum"])

    @property
    def metrics(self) -> dict[str, float]:
        """The values the save was given to rank its step by (none in older manifests)."""
        return {name: float(value) for name, value in self.body.get(METRICS, {}).items()}


# The file is ``{"checksum":"<16 hex>",`` then the rest of the JSON object, whose exact bytes
# (with the opening brace) the checksum covers: checking it never re-serializes anything.
_SIGNED = re.compile(rb'\{"checksum":"([0-9a-f]{16})",')


def sign(body: Mapping[str, Any]) -> bytes:
    """``body`` (without a checksum) as manifest bytes, signed."""
    rest = json.dumps({k: v for k, v in body.items() if k != "checksum"}, separators=(",", ":")).encode()
    digest = checksum(rest).encode()
    return b'{"checksum":"' + digest + b'",' + rest[1:]


def build(
    *,
    step: int,
    nbytes: int,
    world_size: int,
    files: Mapping[str, FileResult],
    items: Mapping[str, list[Chunk]],
    tree: dict[str, Any],
    rank_trees: Mapping[str, Any],
    rng: Mapping[str, Any],
    provenance: Mapping[str, Any],
    timing: Mapping[str, float],
    metrics: Mapping[str, float] | None = None,
) -> bytes:
    """The manifest of a checkpoint whose files have all been written (``metrics``: finite
    numbers by name, checked by the caller)."""
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
        "items": {
            key: [[*chunk[:4], list(chunk.offsets), list(chunk.sizes)] for chunk in chunks]
            for key, chunks in items.items()
        },
        "tree": tree,
        **({"rank_trees": dict(rank_trees)} if rank_trees else {}),
        **({"rng": dict(rng)} if rng else {}),
        "provenance": dict(provenance),
        **({METRICS: {name: float(value) for name, value in metrics.items()}} if metrics else {}),
    }
    assert set(body) <= set(MANIFEST_KEYS), "a manifest key docs/format.md does not describe"
    return sign(body)


def parse(data: bytes, step: int, where: str) -> Manifest:
    """Check a manifest read from ``where`` (``step-NNNNNN/manifest.json``) completely."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{where} is larger than a manifest may be ({MAX_MANIFEST_BYTES} bytes)")
    try:
        body = json.loads(data, object_pairs_hook=_members)
    except RecursionError:
        raise CheckpointError(f"{where} is unreadable (nested too deeply)") from None
    except _Twice as exc:
        raise CheckpointError(f"{where} names a JSON member twice ({exc.args[0]!r})") from None
    except ValueError as exc:
        raise CheckpointError(f"{where} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict) or not str(body.get("format", "")).startswith("nbckpt/"):
        raise CheckpointError(f"{where} is not an nbckpt manifest")
    if body["format"] not in READS:
        raise CheckpointError(
            f"{where} is in format {body['format']}, this nbckpt reads {', '.join(READS)}; "
            "its tensors load with torch.distributed.checkpoint.load"
        )
    signed = _SIGNED.match(data)
    if signed is None or checksum(b"{" + data[signed.end() :]).encode() != signed.group(1):
        raise CheckpointError(f"{where} was modified after it was written (checksum mismatch)")
    if body.get("step") != step:
        raise CheckpointError(f"{where} names step {body.get('step')}, not {step}")
    specs, items, paths = _check_body(body, where)
    return Manifest(step, body, items, specs, paths)


class _Twice(Exception):
    """A JSON object names a member twice."""


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused if it names a member twice: ``json.loads`` would keep the last,
    another reader (or an older nbckpt) the first, and the two would read different steps."""
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Twice(key)
            seen.add(key)
    return members


def _check_body(
    body: dict[str, Any], where: str
) -> tuple[dict[str, TensorSpec], dict[str, list[Chunk]], dict[str, tuple[str | int, ...]]]:
    if body.get("block_size") != BLOCK_SIZE:
        raise CheckpointError(f"{where} uses blocks of {body.get('block_size')} bytes, not {BLOCK_SIZE}")
    files = body.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        raise CheckpointError(f"{where} lists no DCP metadata file")
    for name, meta in files.items():
        if not (name == METADATA_FILE or is_data_file(name)):
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
    specs: dict[str, TensorSpec] = {}
    paths: dict[str, tuple[str | int, ...]] = {}
    data_bytes = sum(meta["size"] for name, meta in files.items() if name != METADATA_FILE)
    for tree in [*rank_trees.values(), body.get("tree")]:  # rank 0's tree last: its paths stay
        _check_tree(tree, specs, paths, data_bytes, where)
    if not isinstance(body.get("rng", {}), dict):
        raise CheckpointError(f"{where} has a malformed RNG record")
    if not _metrics_ok(body.get(METRICS, {})):
        raise CheckpointError(f"{where} has malformed metrics (not a JSON object of finite numbers)")
    chunks = {key: _chunks(items.get(key), spec, files, body["format"], where) for key, spec in specs.items()}
    _check_apart(chunks, specs, where)
    return specs, chunks, paths


def _metrics_ok(metrics: Any) -> bool:
    return isinstance(metrics, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in metrics.values()
    )


def _is_count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _bounded_bytes(shape: Any, itemsize: int, limit: int) -> int:
    """``prod(shape) * itemsize``, stopping once it passes ``limit`` (a hostile shape must not
    become a huge number to compute with, or a huge allocation). A zero anywhere makes it 0: an
    empty tensor of shape (4096, 0) holds no bytes, whatever its leading sizes."""
    if 0 in shape:  # before the product, which would stop at 4096 * itemsize past a small limit
        return 0
    nbytes = itemsize
    for n in shape:
        nbytes *= n
        if nbytes > limit:
            return limit + 1
    return nbytes


def _check_tree(
    tree: Any,
    specs: dict[str, TensorSpec],
    paths: dict[str, tuple[str | int, ...]],
    data_bytes: int,
    where: str,
) -> None:
    """Every node well-formed, every tensor of a known dtype that fits in the files, walked
    without recursion; ``specs`` collects the tensors (a key in two ranks' trees must agree)."""
    if not (isinstance(tree, dict) and tree.get("t") == "dict"):
        raise CheckpointError(f"{where} has a malformed state tree")
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH + 2 or not isinstance(node, dict) or not _is_kind(node.get("t")):
            raise CheckpointError(f"{where} has a malformed state tree")
        kind = node["t"]
        children: list[tuple[Any, tuple[str | int, ...]]] = []
        if kind in ("module", "optimizer", "stateful"):
            children = [(node.get("state"), path)]  # a module is its state dict, at its own path
        elif kind in ("dict", "namespace"):
            pairs = node.get("items")
            keys = (str,) if kind == "namespace" else (str, int)
            if not isinstance(pairs, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], keys) and not isinstance(p[0], bool)
                for p in pairs
            ):
                raise CheckpointError(f"{where} has a malformed state tree")
            _check_unique([key for key, _ in pairs], path, where)
            children = [(child, (*path, str(key))) for key, child in pairs]
        elif kind in ("list", "tuple"):
            listed = node.get("items")
            listed = listed if isinstance(listed, list) else [None]  # None: a malformed child
            children = [(c, (*path, i)) for i, c in enumerate(listed)]
        elif kind in ("tensor", "ndarray"):
            spec = _tensor_spec(node, data_bytes, where)
            if spec.key != ".".join(map(str, path)):  # the key flatten gives a tensor at that path
                raise CheckpointError(f"{where} puts tensor {spec.key!r} at {'.'.join(map(str, path))!r}")
            _check_tensor(kind, spec, specs, where)
            paths[spec.key] = path
        elif "v" not in node or not _value_ok(kind, node["v"]):
            raise CheckpointError(f"{where} has a malformed {kind} value")
        stack.extend(children)


def _check_tensor(kind: str, spec: TensorSpec, specs: dict[str, TensorSpec], where: str) -> None:
    if specs.setdefault(spec.key, spec) != spec:
        raise CheckpointError(f"{where} gives tensor {spec.key!r} two shapes or dtypes")
    if kind == "ndarray" and not numpy_has(spec.dtype):  # decoding it would raise TypeError
        raise CheckpointError(f"{where} names an array of dtype {dtype_name(spec.dtype)}, which numpy lacks")


def _check_unique(keys: list[str | int], path: tuple[str | int, ...], where: str) -> None:
    """A dict lists each key once (a reader keeping the first and one keeping the last disagree)."""
    seen: set[str | int] = set()
    for key in keys:
        if key in seen:
            place = f" in {'.'.join(map(str, path))}" if path else ""
            raise CheckpointError(f"{where} lists key {key!r} twice{place}")
        seen.add(key)


def _is_kind(kind: Any) -> bool:
    return isinstance(kind, str) and kind in TREE_KINDS


def _value_ok(kind: str, value: Any) -> bool:
    """A leaf the decoder turns into a value without an error of the caller's (a float, a path...)."""
    if kind == "value":
        return value is None or isinstance(value, (bool, int, str))
    if kind == "float":
        if isinstance(value, int) and not isinstance(value, bool):
            return _fits_float(value)
        return isinstance(value, float) or value in ("nan", "inf", "-inf")
    if kind == "bytes":
        return _is_base64(value)
    if kind == "path":
        return isinstance(value, str) and "\0" not in value
    if kind == "dtype":
        try:
            dtype_from_name(value)
        except CheckpointError:
            return False
        return True
    if kind == "device":
        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            return False
        return True
    return False


def _is_base64(value: Any) -> bool:
    """Whether ``value`` is base64 text of at most :data:`MAX_BYTES_VALUE` bytes."""
    if not isinstance(value, str) or len(value) > (MAX_BYTES_VALUE + 2) // 3 * 4:
        return False
    try:
        base64.b64decode(value, validate=True)
    except ValueError:
        return False
    return True


def _fits_float(value: int) -> bool:
    """Whether ``float(value)`` is a float (``float(10**400)`` raises OverflowError; JSON ints
    have at most 4,300 digits, so this stays cheap)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _tensor_spec(node: dict[str, Any], data_bytes: int, where: str) -> TensorSpec:
    key, shape = node.get("key"), node.get("shape")
    if not (isinstance(key, str) and isinstance(shape, list) and all(_is_count(n) for n in shape)):
        raise CheckpointError(f"{where} has a malformed tensor entry")
    try:
        dtype = dtype_from_name(node.get("dtype"))
    except CheckpointError as exc:
        raise CheckpointError(f"{where} {str(exc).removeprefix('manifest ')}") from None
    if _bounded_bytes(shape, dtype.itemsize, data_bytes) > data_bytes:
        raise CheckpointError(f"{where} names tensor {key!r} of shape {shape}, larger than its files")
    return TensorSpec(key, dtype, tuple(shape))


def _chunks(entry: Any, spec: TensorSpec, files: dict[str, Any], fmt: str, where: str) -> list[Chunk]:
    """The chunks of one tensor as the manifest lists them, each checked to lie inside its file,
    inside its blob, and together to make up the whole tensor exactly once."""
    key, whole = spec.key, spec.shape
    if fmt == "nbckpt/2":  # one [file, offset] per tensor, its blob framed as this torch frames it
        if not (isinstance(entry, list) and len(entry) == 2 and _is_count(entry[1])):
            raise CheckpointError(f"{where} does not say where tensor {key!r} is")
        if not spec.nbytes:
            return []
        header, trailer = framing(spec.dtype, whole)
        blob_length = len(header) + spec.nbytes + len(trailer)
        entry = [[entry[0], entry[1] - len(header), blob_length, entry[1], [0] * len(whole), list(whole)]]
    if not isinstance(entry, list):
        raise CheckpointError(f"{where} does not say where tensor {key!r} is")
    chunks = [_chunk(raw, spec, files, where) for raw in entry]
    if not tiles([c.region for c in chunks], whole):
        raise CheckpointError(f"{where}: the chunks of tensor {key!r} do not make up its shape {list(whole)}")
    return chunks


def _chunk(raw: Any, spec: TensorSpec, files: dict[str, Any], where: str) -> Chunk:
    key, ndim = spec.key, len(spec.shape)
    if not (
        isinstance(raw, list)
        and len(raw) == 6
        and isinstance(raw[0], str)
        and all(_is_count(n) for n in raw[1:4])
        and all(isinstance(v, list) and len(v) == ndim and all(_is_count(n) for n in v) for v in raw[4:])
    ):
        raise CheckpointError(f"{where} has a malformed entry for tensor {key!r}")
    name, blob_offset, blob_length, data_offset, offsets, sizes = raw
    if name not in files or name == METADATA_FILE:
        raise CheckpointError(f"{where} puts tensor {key!r} in {name!r}, which it does not list")
    size = files[name]["size"]
    nbytes = _bounded_bytes(sizes, spec.dtype.itemsize, size)
    if not (blob_offset <= data_offset and data_offset + nbytes <= blob_offset + blob_length <= size):
        raise CheckpointError(
            f"{where} puts tensor {key!r} at bytes {data_offset}..{data_offset + nbytes} of {name} "
            f"(blob {blob_offset}..{blob_offset + blob_length}), which has {size}"
        )
    return Chunk(name, blob_offset, blob_length, data_offset, tuple(offsets), tuple(sizes))


def _check_apart(chunks: dict[str, list[Chunk]], specs: dict[str, TensorSpec], where: str) -> None:
    """No two blobs share a byte, except one blob two keys name with the same dtype (tied
    weights): so no byte of the files is read into two tensors, and their total is bounded."""
    seen: dict[tuple[str, int], tuple[Chunk, Any]] = {}
    for key, listed in chunks.items():
        for chunk in listed:
            known = seen.setdefault((chunk.file, chunk.blob_offset), (chunk, specs[key].dtype))
            if known != (chunk, specs[key].dtype):
                raise CheckpointError(f"{where} puts two tensors' bytes in one blob of {chunk.file}")
    by_file: dict[str, list[Chunk]] = {}
    for chunk, _ in seen.values():
        by_file.setdefault(chunk.file, []).append(chunk)
    for name, listed in by_file.items():
        listed.sort(key=lambda c: c.blob_offset)
        for before, after in itertools.pairwise(listed):
            if before.blob_offset + before.blob_length > after.blob_offset:
                raise CheckpointError(f"{where} puts tensors' bytes over each other in {name}")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=2.0, check=False)
    except (OSError, subprocess.SubprocessError):  # no git, or a hung network mount
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _program() -> str:
    # Jupyter Server gives each kernel the notebook's path; in a plain interpreter the script.
    notebook = os.environ.get("JPY_SESSION_NAME")
    if notebook:
        return notebook
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    return os.path.abspath(path) if path and path != "-c" else "<interactive>"


def provenance() -> dict[str, Any]:
    """Where a step came from (versions, host, program, git commit and whether it had changes):
    gathered once per Checkpointer, since git takes milliseconds."""
    from .._version import __version__

    record: dict[str, Any] = {
        "nbckpt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "program": _program(),
        "cwd": os.getcwd(),
    }
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no")
        record["git"] = {"commit": commit, "dirty": bool(status) if status is not None else None}
    return record
