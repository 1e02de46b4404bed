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
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

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

#: Opcodes that push a number that may share its hash with another: the ones read whole, their
#: value decoded, for :meth:`_Scan.number` (BININT, BININT1 and BININT2 fit in 32 bits, and
#: distinct ints that small hash apart but for -1 and -2: leaves).
_NUMBERS = frozenset({"INT", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})
#: Opcodes that push one new object holding nothing: a small number, a string, None, a global.
_LEAVES = frozenset(
    {
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
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

# What each opcode does to the scan, as a small number (the scan's loop branches on it).
_LEAF, _MAKE, _FILL, _MARK, _POP, _POP_MARK, _DUP, _PUT, _MEMOIZE, _NOTHING, _GET, _STOP, _NUMBER = range(13)
_MOVES = {
    "MARK": _MARK,
    "POP": _POP,
    "POP_MARK": _POP_MARK,
    "DUP": _DUP,
    "PUT": _PUT,
    "BINPUT": _PUT,
    "LONG_BINPUT": _PUT,
    "MEMOIZE": _MEMOIZE,
    "GET": _GET,
    "BINGET": _GET,
    "LONG_BINGET": _GET,
    "PROTO": _NOTHING,
    "FRAME": _NOTHING,
    "STOP": _STOP,
}


class _Op(NamedTuple):
    """One opcode as the scan sees it: what it does, with how many objects (None: those above
    the last mark) and whether what it makes may be filled later, and its argument: ``size``
    bytes, or (``size`` < 0) read by pickletools' own reader ``read``."""

    does: int
    takes: int | None
    fillable: bool
    size: int
    name: str
    read: Callable[[Any], Any] | None


def _op_table(persistent: bool) -> list[_Op | None]:
    """Each opcode byte's :class:`_Op` (None: refused)."""
    table: list[_Op | None] = [None] * 256
    for op in pickletools.opcodes:
        count: int | None = 0
        fillable = False
        size = op.arg.n if op.arg is not None else 0
        if op.name in _LEAVES:
            does = _LEAF
        elif op.name in _NUMBERS:
            does, size = _NUMBER, -1  # its value, read by pickletools' own reader
        elif op.name in _MAKERS:
            does, (count, fillable) = _MAKE, _MAKERS[op.name]
        elif op.name in _FILLERS:
            does, count = _FILL, _FILLERS[op.name]
        elif op.name in _MOVES:
            does = _MOVES[op.name]
        elif op.name == "BINPERSID" and persistent:  # how a torch.save blob names a storage
            does, count = _MAKE, 1
        else:
            continue
        table[ord(op.code)] = _Op(does, count, fillable, size, op.name, op.arg.reader if op.arg else None)
    return table


_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}

# How the scan's loop takes each opcode byte: the commonest opcodes inline, each on its way to
# success only (anything else, and one of them about to fail, goes through :func:`_step`).
_GENERAL, _GET1, _GET4, _MEMO, _BARE, _SHORT, _MARK_IT, _MAKE_N, _FILL_1, _FILL_MARKED = range(10)


class _Tables(NamedTuple):
    """Per opcode byte: its :class:`_Op` (None: refused), how the loop takes it, and for the
    opcodes it takes inline, the size of its argument, how many objects it takes, and whether
    what it makes may be filled later."""

    ops: list[_Op | None]
    ways: list[int]
    sizes: list[int]
    counts: list[int]
    fillable: list[bool]


def _tables(persistent: bool) -> _Tables:
    ops = _op_table(persistent)
    ways = [_GENERAL] * 256
    for code, op in enumerate(ops):
        if op is None:
            continue
        if op.does == _GET:
            ways[code] = {1: _GET1, 4: _GET4}.get(op.size, _GENERAL)
        elif op.does == _MEMOIZE:
            ways[code] = _MEMO
        elif op.does == _LEAF:
            ways[code] = _BARE if op.size >= 0 else _SHORT if op.size == -2 else _GENERAL
        elif op.does == _MARK:
            ways[code] = _MARK_IT
        elif op.does == _MAKE:
            ways[code] = _GENERAL if op.takes is None else _MAKE_N
        elif op.does == _FILL:
            ways[code] = _FILL_1 if op.takes == 1 else _FILL_MARKED if op.takes is None else _GENERAL
    return _Tables(
        ops,
        ways,
        [op.size if op else 0 for op in ops],
        [op.takes or 0 if op else 0 for op in ops],
        [op.fillable if op else False for op in ops],
    )


_TABLES = {persistent: _tables(persistent) for persistent in (False, True)}
_U32 = struct.Struct("<I").unpack_from


class _Scan:
    """A pickle's stack and memo, holding for each object only how deep it nests, negated once
    it is inside another (or cannot change): what unpickling would build, with nothing built."""

    def __init__(self) -> None:
        self.depth: list[int] = []
        self.stack: list[int] = []
        self.marks: list[int] = []
        self.memo: list[int] = []  # indices in order (the next, or one stored before)
        self.hashes: dict[int, int | float] = {}  # the first number seen with each hash...
        self.shared: dict[int, set[int | float]] = {}  # ...and, for a hash seen again, them all

    def number(self, value: int | float) -> None:
        """A leaf, its hash counted: ValueError past :data:`MAX_SHARED_HASH` distinct numbers."""
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
        self.depth.append(-1)
        self.stack.append(len(self.depth) - 1)

    def build(self, does: int, count: int | None, fillable: bool) -> None:
        """A maker (a new object of the top ``count`` objects) or a filler (they go into the
        object below them); either way they are inside another from now on."""
        known, parts = self.depth, self.take(count)
        depth = _inside(known, parts)
        if does == _MAKE:
            known.append(depth if fillable else -depth)
            self.stack.append(len(known) - 1)
            return
        into = self.top()
        if known[into] < 0 or into in parts:
            raise ValueError("it changes an object already inside another (or puts one in itself)")
        if depth > known[into]:
            known[into] = depth

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

    def top(self) -> int:
        if not self.stack or (self.marks and self.marks[-1] == len(self.stack)):
            raise ValueError("its stack underflows")
        return self.stack[-1]

    def move(self, does: int, arg: Any) -> None:
        """The opcodes that only move objects between the stack, the marks and the memo."""
        if does == _MEMOIZE:
            self.memo.append(self.top())
        elif does == _MARK:
            self.marks.append(len(self.stack))
        elif does in (_POP, _STOP):
            self.take(1)
        elif does == _POP_MARK:
            self.take(None)
        elif does == _DUP:
            self.stack.append(self.top())
        elif does == _PUT:
            if not 0 <= arg <= len(self.memo):  # the unpickler's memo grows to the index, zeroed
                raise ValueError(f"it stores memo entry {arg} of {len(self.memo)}")
            self.memo[arg : arg + 1] = [self.top()]


def _inside(depth: list[int], parts: list[int]) -> int:
    """How deep an object holding ``parts`` nests, each of them marked as inside another from
    now on; ValueError past :data:`MAX_PICKLE_DEPTH`."""
    made = 1
    for part in parts:
        inner = depth[part]
        if inner > 0:
            depth[part] = -inner
        else:
            inner = -inner
        if inner >= made:
            made = inner + 1
    if made > MAX_PICKLE_DEPTH:
        raise ValueError(f"it nests objects deeper than {MAX_PICKLE_DEPTH}")
    return made


def _fillable(stack: list[int], start: int, floor: int, depth: list[int]) -> bool:
    """Whether a filler may put the objects from ``start`` on into the object below them: that
    one is above ``floor`` (the mark before, or the stack's bottom), may still be filled, and is
    not among them."""
    if start <= floor:
        return False
    into = stack[start - 1]
    return depth[into] > 0 and into not in stack[start:]


def _argument(data: bytes, at: int, op: _Op) -> tuple[Any, int]:
    """The argument of ``op`` at byte ``at`` (its value where the scan needs it) and where the
    next opcode starts; ValueError if it runs past the end."""
    size = op.size
    if size == -2:  # one byte of length, then that many bytes (short strings)
        size = data[at] + 1 if at < len(data) else 1
    if size >= 0:
        if at + size > len(data):
            raise ValueError(f"{op.name} expected {size} bytes of argument, but only {len(data) - at} remain")
        return int.from_bytes(data[at : at + size], "little"), at + size
    stream = io.BytesIO(data)  # a length of 4 or 8 bytes, or a line: pickletools' own reader
    stream.seek(at)
    assert op.read is not None
    return op.read(stream), stream.tell()


def scan_pickle(data: bytes, *, persistent: bool = False) -> int:
    """Walk the opcodes of pickle ``data`` once, building nothing; ValueError if unpickling it
    would nest objects deeper than :data:`MAX_PICKLE_DEPTH`, change an object already inside
    another, store a memo entry past the next, hold more than :data:`MAX_SHARED_HASH` distinct
    numbers with one hash, or read past its end. Returns the objects it
    would make (at most one an opcode: unpickling costs time and memory in proportion to the
    file's size). Out-of-band buffers, and persistent ids unless ``persistent`` (a ``torch.save``
    blob's storages, by BINPERSID), are refused."""
    try:
        return _walk(data, _TABLES[persistent])
    except ValueError:
        raise
    except Exception as exc:  # a garbled argument (a line that is not a number)
        raise ValueError(describe_error(exc)) from None


def _walk(data: bytes, tables: _Tables) -> int:
    """:func:`scan_pickle`'s loop. The opcodes DCP's metadata is made of are taken inline, each
    as :func:`_step` takes it when it succeeds: the walk of a 10,000-tensor ``.metadata`` took
    0.35 CPU s of a 0.95 s restore at a call and a tuple an opcode (610,000 of them); 0.17 s now
    (540,000, since nbckpt's indices share their torch.Size; 0.23 s one at a time)."""
    scan, at, end = _Scan(), 0, len(data)
    depth, stack, marks, memo = scan.depth, scan.stack, scan.marks, scan.memo
    ways, sizes, counts, fillable = tables.ways, tables.sizes, tables.counts, tables.fillable
    while at < end:
        code = data[at]
        way = ways[code]
        if way == _GET4 and at + 5 <= end and (index := _U32(data, at + 1)[0]) < len(memo):
            stack.append(memo[index])
            at += 5
        elif way == _MEMO and stack and not (marks and marks[-1] == len(stack)):
            memo.append(stack[-1])
            at += 1
        elif way == _GET1 and at + 2 <= end and (index := data[at + 1]) < len(memo):
            stack.append(memo[index])
            at += 2
        elif way == _MAKE_N and (start := len(stack) - counts[code]) >= (marks[-1] if marks else 0):
            made = _inside(depth, stack[start:]) if start < len(stack) else 1  # EMPTY_DICT: 1
            del stack[start:]
            depth.append(made if fillable[code] else -made)
            stack.append(len(depth) - 1)
            at += 1
        elif way == _BARE and at + 1 + sizes[code] <= end:
            depth.append(-1)
            stack.append(len(depth) - 1)
            at += 1 + sizes[code]
        elif way == _MARK_IT:
            marks.append(len(stack))
            at += 1
        elif (
            way == _FILL_MARKED
            and marks
            and _fillable(stack, marks[-1], marks[-2] if len(marks) > 1 else 0, depth)
        ):
            depth[stack[marks[-1] - 1]] = max(depth[stack[marks[-1] - 1]], _inside(depth, stack[marks[-1] :]))
            del stack[marks.pop() :]
            at += 1
        elif way == _FILL_1 and _fillable(stack, len(stack) - 1, marks[-1] if marks else 0, depth):
            depth[stack[-2]] = max(depth[stack[-2]], _inside(depth, stack[-1:]))
            stack.pop()
            at += 1
        elif way == _SHORT and at + 1 < end and at + 2 + data[at + 1] <= end:
            depth.append(-1)
            stack.append(len(depth) - 1)
            at += 2 + data[at + 1]
        elif (at := _step(scan, data, at, tables.ops)) < 0:
            return len(depth)
    raise ValueError("it ends before its STOP opcode")


def _step(scan: _Scan, data: bytes, at: int, table: list[_Op | None]) -> int:
    """The opcode at byte ``at``, any opcode, every check made: where the next one starts (-1
    after STOP); ValueError saying what is wrong."""
    op = table[data[at]]
    if op is None:
        raise ValueError(f"it holds opcode {_NAMES.get(data[at], repr(chr(data[at])))}")
    does, count, fillable, size = op[:4]
    at += 1
    arg: Any = None
    if 0 < size <= len(data) - at:  # a fixed-size argument: a memo index, a number
        arg = int.from_bytes(data[at : at + size], "little")
        at += size
    elif size:
        arg, at = _argument(data, at, op)
    if does == _GET:
        if not 0 <= arg < len(scan.memo):
            raise ValueError(f"it reads memo entry {arg!r}, never stored")
        scan.stack.append(scan.memo[arg])
    elif does == _LEAF:
        scan.depth.append(-1)
        scan.stack.append(len(scan.depth) - 1)
    elif does <= _FILL:
        scan.build(does, count, fillable)
    elif does == _NUMBER:
        scan.number(arg)
    elif does == _STOP:
        scan.move(_STOP, None)
        return -1
    else:
        scan.move(does, arg)
    return at


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
