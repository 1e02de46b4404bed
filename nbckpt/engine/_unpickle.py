"""Reading pickles of others safely: DCP's ``.metadata`` with an allow-list of DCP's own classes,
``torch.save`` blobs with weights only, and plain values with no global at all.

Nothing here runs code a file names: a global outside the allow-list is refused before it is
looked up, so a hostile checkpoint is a CheckpointError, never an exploit. Nor does a file cost
more than its size: before ``.metadata`` is unpickled, its opcodes are walked once (building
nothing) and refused if anything would nest deeper than :data:`MAX_PICKLE_DEPTH` (building a
dict hashes its keys, and CPython hashes a nested tuple by recursing in C with no guard: a
tuple a million deep is a SIGSEGV) or change an object already put inside another (so none is
cyclic, and no class of the allow-list is ever modified), or if many distinct numbers share one
hash (a dict of colliding keys costs time quadratic in their count: 20,000 int keys in 460 KB
took 9.8 s to unpickle; string and bytes hashes are salted per process, numbers' are not).
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .._errors import CheckpointError, describe_error
from ._torch_compat import STORAGE_INFO_GLOBAL, pickle_record, torch_archive_records

__all__ = [
    "MAX_PICKLE_DEPTH",
    "MAX_SHARED_HASH",
    "MetadataUnpickler",
    "load_blob",
    "load_metadata",
    "plain_blob",
    "scan_pickle",
]


# Everything DCP's .metadata legitimately pickles; any other global is refused.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    STORAGE_INFO_GLOBAL,
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("torch", "strided"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch sizes and dtypes; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


#: How deep a ``.metadata`` pickle may nest objects. DCP's own nest 9 deep (``Metadata``, its
#: state, ``storage_data``, a ``MetadataIndex``, its state, a ``torch.Size``, its arguments...).
MAX_PICKLE_DEPTH = 32

#: How many distinct numbers may share one hash. Distinct ints collide only past 2**61 - 1 (and
#: -1 with -2), distinct floats a few dozen times at most (one per 61 binary exponents), so a
#: legitimate checkpoint never comes near; a crafted dict of colliding keys does at once.
MAX_SHARED_HASH = 64

#: Opcodes that push a number, whose hash :class:`_Scan` counts.
_NUMBERS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})
#: Opcodes that push one new object holding nothing: a string, None, a global.
_LEAVES = frozenset(
    {
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "UNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "GLOBAL",
        "EXT1",
        "EXT2",
        "EXT4",
        "EMPTY_TUPLE",
    }
)
#: Opcodes that make a new object of the top ``n`` objects (None: those above the last mark), and
#: whether more may be put in it later (a list or dict being filled, an object awaiting BUILD).
_MAKERS: dict[str, tuple[int | None, bool]] = {
    "EMPTY_LIST": (0, True),
    "EMPTY_DICT": (0, True),
    "EMPTY_SET": (0, True),
    "TUPLE": (None, False),
    "FROZENSET": (None, False),
    "LIST": (None, True),
    "DICT": (None, True),
    "INST": (None, True),
    "OBJ": (None, True),
    "TUPLE1": (1, False),
    "TUPLE2": (2, False),
    "TUPLE3": (3, False),
    "REDUCE": (2, True),
    "NEWOBJ": (2, True),
    "NEWOBJ_EX": (3, True),
    "STACK_GLOBAL": (2, False),
}
#: Opcodes that put the top ``n`` objects (None: those above the last mark) into the one below.
_FILLERS: dict[str, int | None] = {
    "APPEND": 1,
    "SETITEM": 2,
    "BUILD": 1,
    "APPENDS": None,
    "SETITEMS": None,
    "ADDITEMS": None,
}

#: The opcodes that move objects between the stack and the memo, and those that change nothing.
_STACK_OPS = {
    "MARK": "mark",
    "POP": "pop",
    "STOP": "pop",
    "POP_MARK": "pop_mark",
    "DUP": "dup",
    "PUT": "put",
    "BINPUT": "put",
    "LONG_BINPUT": "put",
    "MEMOIZE": "memoize",
    "GET": "get",
    "BINGET": "get",
    "LONG_BINGET": "get",
    "PROTO": "nothing",
    "FRAME": "nothing",
}


class _Scan:
    """A pickle's stack and memo, holding for each object only how deep it nests, negated once
    it is inside another (or cannot change): what unpickling would build, with nothing built."""

    def __init__(self, persistent: bool) -> None:
        self.depth: list[int] = []
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: list[int] = []  # indices in order (the next, or one stored before)
        self.hashes: dict[int, int | float] = {}  # the first number seen with each hash...
        self.shared: dict[int, set[int | float]] = {}  # ...and, for a hash seen again, them all
        self.table: dict[pickletools.OpcodeInfo, Callable[[Any], None]] = {}
        for op in pickletools.opcodes:
            if op.name in _LEAVES:
                self.table[op] = self.leaf
            elif op.name in _NUMBERS:
                self.table[op] = self.number
            elif op.name in _MAKERS:
                self.table[op] = partial(self.make, *_MAKERS[op.name])
            elif op.name in _FILLERS:
                self.table[op] = partial(self.fill, _FILLERS[op.name])
            elif op.name in _STACK_OPS:
                self.table[op] = getattr(self, _STACK_OPS[op.name])
            elif op.name == "BINPERSID" and persistent:  # how a torch.save blob names a storage
                self.table[op] = partial(self.make, 1, False)

    def leaf(self, _: Any) -> None:
        self.depth.append(-1)
        self.stack.append(len(self.depth) - 1)

    def number(self, value: int | float) -> None:
        code = hash(value)
        # Small ints and integral floats hash to themselves and never collide; a NaN's hash is
        # its object's, a new one each time.
        if code != value and value == value:
            first = self.hashes.setdefault(code, value)
            if first != value:
                same = self.shared.setdefault(code, {first})
                same.add(value)
                if len(same) > MAX_SHARED_HASH:
                    raise ValueError(f"more than {MAX_SHARED_HASH} of its numbers share one hash")
        self.leaf(value)

    def make(self, count: int | None, fillable: bool, _: Any) -> None:
        depth = self.around(self.take(count))
        self.depth.append(depth if fillable else -depth)
        self.stack.append(len(self.depth) - 1)

    def fill(self, count: int | None, _: Any) -> None:
        parts = self.take(count)
        into = self.top()
        if self.depth[into] < 0 or into in parts:
            raise ValueError("it changes an object already inside another (or puts one in itself)")
        self.depth[into] = max(self.depth[into], self.around(parts))

    def around(self, parts: list[int]) -> int:
        """How deep an object holding ``parts`` nests; they are inside it from now on."""
        depth, known = 1, self.depth
        for part in parts:
            inner = known[part]
            if inner > 0:
                known[part] = -inner
            else:
                inner = -inner
            depth = max(depth, inner + 1)
        if depth > MAX_PICKLE_DEPTH:
            raise ValueError(f"it nests objects deeper than {MAX_PICKLE_DEPTH}")
        return depth

    def top(self) -> int:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise ValueError("its stack underflows")
        return self.stack[-1]

    def take(self, count: int | None) -> list[int]:
        """The top ``count`` objects (None: those above the last mark, and the mark), popped."""
        if count is None:
            if not self.marks:
                raise ValueError("it has no mark where one is needed")
            start = self.marks.pop()
        else:
            start = len(self.stack) - count
            if start < (self.marks[-1] if self.marks else 0):
                raise ValueError("its stack underflows")
        parts = self.stack[start:]
        del self.stack[start:]
        return parts

    def mark(self, _: Any) -> None:
        self.marks.append(len(self.stack))

    def pop(self, _: Any) -> None:
        self.take(1)

    def pop_mark(self, _: Any) -> None:
        self.take(None)

    def dup(self, _: Any) -> None:
        self.stack.append(self.top())

    def put(self, index: Any) -> None:
        if not 0 <= index <= len(self.memo):  # the unpickler's memo grows to the index, zeroed
            raise ValueError(f"it stores memo entry {index} of {len(self.memo)}")
        if index == len(self.memo):
            self.memo.append(self.top())
        else:
            self.memo[index] = self.top()

    def memoize(self, _: Any) -> None:
        self.memo.append(self.top())

    def nothing(self, _: Any) -> None:
        pass

    def get(self, index: Any) -> None:
        if not 0 <= index < len(self.memo):
            raise ValueError(f"it reads memo entry {index!r}, never stored")
        self.stack.append(self.memo[index])


def scan_pickle(data: bytes, *, persistent: bool = False) -> int:
    """Walk the opcodes of pickle ``data`` once, building nothing; ValueError if unpickling it
    would nest objects deeper than :data:`MAX_PICKLE_DEPTH`, change an object already inside
    another, store a memo entry past the next, hold more than :data:`MAX_SHARED_HASH` distinct
    numbers with one hash, or read past its end. Returns the objects it
    would make (at most one an opcode: unpickling costs time and memory in proportion to the
    file's size). Out-of-band buffers, and persistent ids unless ``persistent`` (a ``torch.save``
    blob's storages, by BINPERSID), are refused."""
    scan = _Scan(persistent)
    table = scan.table
    try:
        for opcode, arg, _ in pickletools.genops(data):
            step = table.get(opcode)
            if step is None:
                raise ValueError(f"it holds opcode {opcode.name}")
            step(arg)
    except ValueError:
        raise
    except Exception as exc:  # genops on a truncated or garbled stream
        raise ValueError(describe_error(exc)) from None
    return len(scan.depth)


def load_metadata(data: bytes, what: str) -> Any:
    """DCP's ``.metadata`` bytes, unpickled once :func:`scan_pickle` found them bounded, with the
    allow-list of :class:`MetadataUnpickler`; CheckpointError naming ``what`` otherwise."""
    try:
        scan_pickle(data)
        return MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise CheckpointError(f"{what}: unsafe or unreadable DCP metadata ({_reason(exc)})") from None


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, (ValueError, pickle.UnpicklingError)) else describe_error(exc)


def load_blob(data: bytes, what: str) -> Any:
    """A ``torch.save`` blob loaded with weights only (no pickle runs) once its pickle is found
    bounded (torch's own unpickler hashes what it builds too); CheckpointError if refused."""
    try:
        scan_pickle(pickle_record(data), persistent=True)
    except Exception as exc:
        raise CheckpointError(f"{what} is unsafe to load ({_reason(exc)})") from None
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{what} does not load with weights only ({describe_error(exc)})") from None


#: The records of a ``torch.save`` zip that holds no storage.
_BLOB_RECORDS = {
    "data.pkl",
    ".format_version",
    ".storage_alignment",
    "byteorder",
    "version",
    ".data/serialization_id",
}


class _PlainUnpickler(pickle.Unpickler):
    """Plain Python values only: any global or storage reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a storage in a plain value")


def plain_blob(data: bytes, what: str) -> Any:
    """The value a ``torch.save`` blob of a plain value holds, read without running any pickle."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            prefix = names[0].split("/", 1)[0] if names else ""
            records = [n.removeprefix(f"{prefix}/") for n in names]
            if (
                len(set(records)) != len(records)
                or not set(records) <= _BLOB_RECORDS
                or "data.pkl" not in records
            ):
                raise CheckpointError(f"{what} is not a plain value's blob (records {records})")
            if archive.read(f"{prefix}/byteorder") != b"little":
                raise CheckpointError(f"{what} is not little-endian")
            pickled = archive.read(f"{prefix}/data.pkl")
            if torch_archive_records(data).get("data.pkl") != pickled:  # what dcp.load would read
                raise CheckpointError(f"{what}: torch's reader reads another value from it")
            scan_pickle(pickled)
            return _PlainUnpickler(io.BytesIO(pickled)).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what} is unreadable ({_reason(exc)})") from None
