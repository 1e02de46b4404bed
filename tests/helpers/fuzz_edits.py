"""The format fuzzer's edits: one family of damage to one file of step 2 of a run, chosen by a
seeded RNG so that a case is reproduced from (seed, case id) alone.

A case id is ``<kind>-<file>-<mutation>/<n>``: ``kind`` is ``native`` (a step nbckpt wrote, whose
manifest is re-signed after the edit three times in four, so that only the reader's checks stand
in the way) or ``dcp`` (a ``step-N/`` folder plain ``torch.distributed.checkpoint.save`` wrote, which
has nothing to re-sign); ``file`` is the manifest, DCP's ``.metadata`` or a ``.distcp`` data file.

``.metadata`` is edited as the objects the allow-list unpickler builds (sizes, offsets, chunk lists,
dtypes, fqns) and pickled again with protocol 2, whose unframed opcodes let a placeholder string be
swapped for opcodes no Python object pickles to: an int past int64 inside a ``torch.Size``, a key
that appears twice, a tuple nested a million deep.
"""

from __future__ import annotations

import json
import pickle
import pickletools
import random
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from helpers.hostile import load_metadata, rewrite_manifest
from nbckpt.engine._format import checksum

__all__ = ["FAMILIES", "STEP_DIRS", "mutate"]

FILES = {"native": ("manifest", "metadata", "distcp"), "dcp": ("metadata", "distcp")}
EDITS = ("flip", "truncate", "field", "dupkey", "extreme", "deep")
#: Every family: data files get flips and truncations only (their bytes are not fields).
FAMILIES = [
    f"{kind}-{file}-{mutation}"
    for kind, files in FILES.items()
    for file in files
    for mutation in (EDITS if file != "distcp" else EDITS[:2])
]
#: Step 2 of each kind of run: what every case edits.
STEP_DIRS = {"native": "step-000002", "dcp": "step-2"}

DTYPES = sorted(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))
VALUES: list[Any] = [
    -1,
    0,
    1,
    3,
    63,
    64,
    65,
    4096,
    1 << 31,
    1 << 62,
    10**30,
    2.5,
    "0",
    "",
    None,
    True,
    [],
    {},
    [0],
    "__0_0.distcp",
    ".metadata",
    "float32",
    "../step-000001/__0_0.distcp",
]
#: Extreme numbers as JSON text (json.loads takes all; 10**5000 is past Python's 4,300 digits).
EXTREME_TEXT = [
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775809",
    "18446744073709551616",
    "1" + "0" * 400,
    "1" + "0" * 5000,
    "1e308",
    "-1e308",
    "1e400",
    "Infinity",
    "-Infinity",
    "NaN",
    "-0.0",
    "5e-324",
    "4096.0",
    "-1",
]
EXTREME_OBJECTS: list[Any] = [
    2**63 - 1,
    2**63,
    -1,
    -(2**63) - 1,
    2**64,
    10**400,
    2**31,
    1e308,
    float("inf"),
    float("nan"),
    -0.0,
    0.5,
]
DEPTHS = [100, 1_000, 100_000, 1_000_000]
#: Pickled nesting: 400,000 tuples overflow the C stack of CPython's tuple hash (100,000 do not),
#: at a third of the unpickling time of the issue's 1,000,000.
PICKLE_DEPTHS = [1_000, 100_000, 400_000]
_SENTINEL = "\x00fuzz\x00"


# -- bytes ----------------------------------------------------------------------------------------------


def flip(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    if not data:
        return data, "flip: empty file"
    out = bytearray(data)
    places = sorted(rng.randrange(len(out)) for _ in range(rng.choice([1, 1, 2, 4, 16])))
    for place in places:
        out[place] ^= rng.randrange(1, 256)
    return bytes(out), f"flip bytes at {places[:6]}{'...' if len(places) > 6 else ''}"


def truncate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    size = rng.choice([0, 1, len(data) // 2, len(data) - 1, rng.randrange(max(1, len(data)))])
    return data[:size], f"truncated to {size} of {len(data)} bytes"


# -- the manifest: JSON ----------------------------------------------------------------------------------


def leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into ``value`` (dict keys and list indices), leaves and inner nodes alike."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield from leaves(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from leaves(child, (*path, index))
    yield path


def at(body: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        body = body[part]
    return body


def with_text(body: dict[str, Any], path: tuple[Any, ...], text: str) -> str:
    """``body`` as JSON with the node at ``path`` replaced by raw ``text``."""
    at(body, path[:-1])[path[-1]] = _SENTINEL
    encoded = json.dumps(body, separators=(",", ":"))
    placeholder = json.dumps(_SENTINEL)
    assert encoded.count(placeholder) == 1
    return encoded.replace(placeholder, text)


def manifest_field(body: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """One field (any depth) set to a dtype, an int nearby, a sibling's value or a stock value."""
    path = rng.choice([p for p in leaves(body) if p])
    parent, old = at(body, path[:-1]), at(body, path)
    choice = rng.random()
    if path[-1] == "dtype" or choice < 0.15:
        new = rng.choice(DTYPES)
    elif choice < 0.3 and isinstance(old, int) and not isinstance(old, bool):
        new = old + rng.choice([-65, -64, -1, 1, 64, 65, 4096])
    elif choice < 0.4 and isinstance(parent, list) and len(parent) > 1:
        new = parent[rng.randrange(len(parent))]  # a sibling's value (a chunk, a shape, a key)
    else:
        new = rng.choice(VALUES)
    parent[path[-1]] = new
    return json.dumps(body, separators=(",", ":")), f"{'/'.join(map(str, path))} = {new!r}"[:120]


def manifest_extreme(body: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """A number set to an extreme one; or, one time in four, a file's size claimed far larger, with
    a block list to match (a 4 KB manifest claiming a 3 GiB ``.metadata``: issue 34 item 8a)."""
    if rng.random() < 0.25:
        name = rng.choice(sorted(body["files"]))
        size = rng.choice([1 << 30, 3 << 30, 1 << 40])
        meta = body["files"][name]
        meta.update(size=size, blocks=meta["blocks"][:1] * -(-size // body["block_size"]))
        return json.dumps(body, separators=(",", ":")), f"files/{name} claims {size} bytes, blocks to match"
    numbers = [p for p in leaves(body) if p and type(at(body, p)) in (int, float)]
    path, text = rng.choice(numbers), rng.choice(EXTREME_TEXT)
    return with_text(body, path, text), f"{'/'.join(map(str, path))} = {text[:24]}"


def manifest_dupkey(body: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    """An object with one key twice (first or last, with another key's value), or a tree listing
    one name twice."""
    objects = [p for p in leaves(body) if isinstance(at(body, p), dict) and at(body, p)]
    tree_lists = [p for p in leaves(body) if p[-1:] == ("items",) and isinstance(at(body, p), list)]
    if tree_lists and rng.random() < 0.3:
        path = rng.choice(tree_lists)
        pairs = at(body, path)
        if pairs:
            name, _ = rng.choice(pairs)
            pairs.insert(rng.randrange(len(pairs) + 1), [name, rng.choice(pairs)[1]])
            return json.dumps(body, separators=(",", ":")), f"{'/'.join(map(str, path))} lists {name!r} twice"
    path = rng.choice(objects)
    obj = at(body, path)
    key = rng.choice(list(obj))
    fake = obj[rng.choice(list(obj))] if rng.random() < 0.7 else rng.choice(VALUES)

    def entry(name: str, value: Any) -> str:
        return f"{json.dumps(name)}:{json.dumps(value, separators=(',', ':'))}"

    entries = [entry(k, v) for k, v in obj.items()]
    first = rng.random() < 0.5
    entries.insert(0 if first else len(entries), entry(key, fake))
    where = "/".join(map(str, path)) or "top"
    text = "{" + ",".join(entries) + "}"
    encoded = text if not path else with_text(body, path, text)
    return encoded, f"{where} has {key!r} twice ({'first' if first else 'last'} fake)"


def manifest_deep(body: dict[str, Any], rng: random.Random) -> tuple[str, str]:
    depth = rng.choice(DEPTHS)
    shape = rng.choice(["list", "object", "tree"])
    if shape == "list":
        text = "[" * depth + "]" * depth
    elif shape == "object":
        text = '{"a":' * depth + "0" + "}" * depth
    else:
        text = '{"t":"dict","items":[["a",' * depth + '{"t":"value","v":1}' + "]]}" * depth
    path = ("tree", "items", 2, 1) if shape == "tree" else rng.choice([p for p in leaves(body) if p])
    return with_text(body, path, text), f"{'/'.join(map(str, path))} = {shape} nested {depth} deep"


MANIFEST_EDITS: dict[str, Callable[[dict[str, Any], random.Random], tuple[str, str]]] = {
    "field": manifest_field,
    "extreme": manifest_extreme,
    "dupkey": manifest_dupkey,
    "deep": manifest_deep,
}


def sign_text(body: bytes) -> bytes:
    """A manifest's body (JSON text from ``{``) signed as nbckpt signs it: the checksum is unkeyed."""
    return b'{"checksum":"' + checksum(body).encode() + b'",' + body[1:]


def edit_manifest(step_dir: Path, mutation: str, signed: bool, rng: random.Random) -> str:
    path = step_dir / "manifest.json"
    data = path.read_bytes()
    prefix = data.index(b",") + 1  # {"checksum":"<16 hex>",
    body = b"{" + data[prefix:]
    if mutation in ("flip", "truncate"):
        edited, what = (flip if mutation == "flip" else truncate)(body if signed else data, rng)
    else:
        text, what = MANIFEST_EDITS[mutation](json.loads(body), rng)
        edited = text.encode()
    if signed:
        edited = sign_text(edited) if edited.startswith(b"{") else edited
    elif mutation not in ("flip", "truncate"):
        edited = data[:prefix] + edited[1:]  # the old checksum over the new body
    path.write_bytes(edited)
    return what


# -- .metadata: the allow-listed objects, pickled with placeholders for raw opcodes -------------------


def opcodes(value: Any) -> bytes:
    """``value``'s pickle opcodes without the protocol header, STOP or any memo slot (which would
    overwrite the outer pickle's)."""
    return pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]


def size_opcodes(dims: list[Any]) -> bytes:
    """A ``torch.Size`` of ``dims``, any ints or floats (torch.Size itself takes only int64s)."""
    marks = [0x5EED0000 + i for i in range(len(dims))]
    raw = opcodes(torch.Size(marks))
    for mark, dim in zip(marks, dims, strict=True):
        raw = raw.replace(opcodes(mark), opcodes(dim) if not isinstance(dim, bytes) else dim, 1)
    return raw


def deep_opcodes(rng: random.Random) -> tuple[bytes, str]:
    depth = rng.choice(PICKLE_DEPTHS)
    if rng.random() < 0.6:
        return b")" + b"\x85" * depth, f"a tuple nested {depth} deep"
    return b"(" * depth + b"]" + b"l" * depth, f"a list nested {depth} deep"


class Metadata:
    """A ``.metadata`` being edited: its objects, and raw opcodes to put where placeholders are."""

    def __init__(self, path: Path) -> None:
        self.value = load_metadata(path)
        self.raw: dict[str, bytes] = {}

    def placeholder(self, raw: bytes) -> str:
        name = f"{_SENTINEL}{len(self.raw)}"
        self.raw[name] = raw
        return name

    def dumps(self) -> bytes:
        data = pickle.dumps(self.value, protocol=2)
        for name, raw in self.raw.items():
            encoded = name.encode()
            string = b"X" + struct.pack("<I", len(encoded)) + encoded
            assert data.count(string) == 1, name
            data = data.replace(string, raw)
        return data

    def tensors(self) -> list[str]:
        return [k for k, v in self.value.state_dict_metadata.items() if hasattr(v, "chunks")]


def _rename_in(mapping: dict[Any, Any], old: Any, new: Any, first: bool) -> None:
    """``mapping`` with ``old`` renamed ``new``, first or in its place, the order otherwise kept."""
    items = [(new if k == old else k, v) for k, v in mapping.items()]
    if first:
        items.sort(key=lambda kv: kv[0] != new)
    mapping.clear()
    mapping.update(items)


def metadata_field(meta: Metadata, rng: random.Random) -> str:
    """An allow-listed field edited: a size, an offset or length, a chunk list, a dtype, an fqn."""
    value, tensor = meta.value, rng.choice(meta.tensors())
    entry = value.state_dict_metadata[tensor]
    index = rng.choice(list(value.storage_data))
    info = value.storage_data[index]
    choice = rng.randrange(9)
    if choice == 0:
        dims = rng.choice([[n + 1 for n in entry.size], [0], [], [entry.size[0] // 2, 2], [entry.size[0], 1]])
        entry.size = torch.Size(dims)
        return f"{tensor}.size = {dims}"
    if choice == 1:
        field = rng.choice(["offset", "length"])
        new = max(0, getattr(info, field) + rng.choice([-700, -64, -1, 1, 64, 700, 1 << 20]))
        setattr(info, field, new)
        return f"storage {index.fqn}.{field} = {new}"
    if choice == 2:
        info.relative_path = rng.choice(
            [
                ".metadata",
                "manifest.json",
                "missing.distcp",
                "/etc/passwd",
                "../step-000001/__0_0.distcp",
                "__0_1.distcp",
                "__0_0.distcp",
            ]
        )
        return f"storage {index.fqn}.relative_path = {info.relative_path!r}"
    if choice == 3:
        how = rng.choice(["none", "twice", "other"])
        other = value.state_dict_metadata[rng.choice(meta.tensors())]
        entry.chunks = {"none": [], "twice": entry.chunks * 2, "other": list(other.chunks)}[how]
        return f"{tensor}.chunks: {how}"
    if choice == 4:
        chunk = entry.chunks[0]
        field = rng.choice(["offsets", "sizes"])
        setattr(chunk, field, torch.Size([n + rng.choice([-1, 1, 64]) for n in getattr(chunk, field)]))
        return f"{tensor}.chunks[0].{field} = {list(getattr(chunk, field))}"
    if choice == 5:
        entry.properties.dtype = getattr(torch, rng.choice(DTYPES))
        return f"{tensor}.dtype = {entry.properties.dtype}"
    if choice == 6:
        new = rng.choice([*value.state_dict_metadata, "x", "w.x", ""])
        _rename_in(value.state_dict_metadata, tensor, new, rng.random() < 0.5)
        return f"state_dict_metadata key {tensor!r} -> {new!r}"
    if choice == 7:
        new = rng.choice([*value.state_dict_metadata, "x", ""])
        info = value.storage_data.pop(index)
        value.storage_data[MetadataIndex(new, index.offset, index.index)] = info
        return f"storage key {index.fqn!r} -> {new!r}"
    value.state_dict_metadata[tensor] = BytesStorageMetadata()
    return f"{tensor} is a bytes entry"


def metadata_extreme(meta: Metadata, rng: random.Random) -> str:
    """An int field (a size, a chunk's offset or size, a storage offset or length) set to a number
    past int64, negative, a float, NaN."""
    value, number = meta.value, rng.choice(EXTREME_OBJECTS)
    tensor = rng.choice(meta.tensors())
    entry = value.state_dict_metadata[tensor]
    choice = rng.randrange(4)
    if choice == 0:
        dims: list[Any] = [*list(entry.size)[:-1], number]
        entry.size = meta.placeholder(size_opcodes(dims))
        return f"{tensor}.size = {dims}"
    if choice in (1, 2):
        field = "offsets" if choice == 1 else "sizes"
        setattr(entry.chunks[0], field, meta.placeholder(size_opcodes([number])))
        return f"{tensor}.chunks[0].{field} = [{number}]"
    index = rng.choice(list(value.storage_data))
    field = rng.choice(["offset", "length"])
    setattr(value.storage_data[index], field, meta.placeholder(opcodes(number)))
    return f"storage {index.fqn}.{field} = {number}"


def metadata_dupkey(meta: Metadata, rng: random.Random) -> str:
    """A dict of ``.metadata`` holding one key twice, the copy (first or last) another entry's value."""
    value, first = meta.value, rng.random() < 0.5
    which = rng.choice(["state_dict_metadata", "storage_data", "planner_data"])
    mapping = getattr(value, which)
    if not mapping:
        return f"{which} is empty"
    key, other = rng.choice(list(mapping)), rng.choice(list(mapping))
    if which == "storage_data":
        fake = MetadataIndex(meta.placeholder(opcodes(key.fqn)), key.offset, key.index)
        label = key.fqn
    else:
        fake, label = meta.placeholder(opcodes(key)), key
    items = list(mapping.items())
    items.insert(0 if first else len(items), (fake, mapping[other]))
    mapping.clear()
    mapping.update(items)
    holder = getattr(other, "fqn", other)
    return f"{which} has {label!r} twice ({'first' if first else 'last'} holds {holder!r}'s)"


def metadata_deep(meta: Metadata, rng: random.Random) -> str:
    """A nested tuple or list where a key, a size or a path belongs (no global, so no allow-list
    sees it)."""
    raw, what = deep_opcodes(rng)
    value, tensor = meta.value, rng.choice(meta.tensors())
    where = rng.choice(
        ["storage key", "state_dict key", "size", "chunk offsets", "relative_path", "planner_data"]
    )
    if where == "storage key":
        index = next(iter(value.storage_data))
        _rename_in(value.storage_data, index, MetadataIndex(meta.placeholder(raw), index.offset), False)
    elif where == "state_dict key":
        _rename_in(value.state_dict_metadata, tensor, meta.placeholder(raw), False)
    elif where == "size":
        value.state_dict_metadata[tensor].size = meta.placeholder(raw)
    elif where == "chunk offsets":
        value.state_dict_metadata[tensor].chunks[0].offsets = meta.placeholder(raw)
    elif where == "relative_path":
        next(iter(value.storage_data.values())).relative_path = meta.placeholder(raw)
    else:
        value.planner_data[tensor] = meta.placeholder(raw)
    return f"{where} of {tensor!r} = {what}"


METADATA_EDITS: dict[str, Callable[[Metadata, random.Random], str]] = {
    "field": metadata_field,
    "extreme": metadata_extreme,
    "dupkey": metadata_dupkey,
    "deep": metadata_deep,
}


def edit_metadata(step_dir: Path, mutation: str, rng: random.Random) -> str:
    path = step_dir / ".metadata"
    if mutation in ("flip", "truncate"):
        edited, what = (flip if mutation == "flip" else truncate)(path.read_bytes(), rng)
    else:
        meta = Metadata(path)
        what = METADATA_EDITS[mutation](meta, rng)
        edited = meta.dumps()
    path.write_bytes(edited)
    return what


def edit_data(step_dir: Path, mutation: str, rng: random.Random) -> str:
    path = rng.choice(sorted(step_dir.glob("*.distcp")))
    edited, what = (flip if mutation == "flip" else truncate)(path.read_bytes(), rng)
    path.write_bytes(edited)
    return f"{path.name}: {what}"


def mutate(step_dir: Path, case: str, seed: int) -> str:
    """Apply case ``case`` (``<family>/<n>``) of ``seed`` to ``step_dir``; what was done, in words."""
    rng = random.Random(f"{seed}/{case}")
    kind, file, mutation = case.split("/")[0].split("-")
    signed = kind == "native" and rng.random() < 0.75
    if file == "manifest":
        what = edit_manifest(step_dir, mutation, signed, rng)
    else:
        what = (edit_metadata if file == "metadata" else edit_data)(step_dir, mutation, rng)
        if signed:
            rewrite_manifest(step_dir)  # every file re-hashed, the manifest re-signed
    return f"{what}{', re-signed' if signed else ''}"
