"""The walk of a ``.metadata`` pickle before it is unpickled (``_unpickle``): the opcodes DCP's
metadata is made of are taken inline, so each must come out as the one-opcode-at-a-time path
takes it, results and errors alike; and nbckpt's own metadata pickles each shape once."""

from __future__ import annotations

import io
import pickle
import pickletools
import random
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from nbckpt import Checkpointer
from nbckpt._errors import describe_error
from nbckpt.engine import _unpickle
from nbckpt.engine._unpickle import MAX_PICKLE_DEPTH, scan_pickle


def one_at_a_time(data: bytes, *, persistent: bool) -> int:
    """The walk with no opcode taken inline: every one through ``_step``, every check made."""
    scan, at, ops = _unpickle._Scan(), 0, _unpickle._TABLES[persistent].ops
    while at < len(data):
        at = _unpickle._step(scan, data, at, ops)
        if at < 0:
            return len(scan.depth)
    raise ValueError("it ends before its STOP opcode")


def outcome(walk: Any, data: bytes, persistent: bool) -> tuple[str, Any]:
    """What a walk of ``data`` gives, as :func:`scan_pickle` says it (an error as its line)."""
    try:
        return "made", walk(data, persistent=persistent)
    except ValueError as exc:
        return "refused", str(exc)
    except Exception as exc:  # scan_pickle says these as a ValueError of their description
        return "refused", describe_error(exc)


def pickles(tmp_path: Path) -> list[bytes]:
    """nbckpt's own metadata (tensors of a few shapes, plain values), plain DCP's, a torch.save
    blob's, Python values at every protocol, and the hand-made refusals of the attack tests."""
    state = {f"w{i}": torch.ones(3 + i % 2, 2) for i in range(6)}
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save({**state, "lr": 0.5, "names": ["a", "b"]}, step=1).wait()
    dcp.save(
        {"w": torch.ones(3), "b": torch.zeros(2, 2), "n": 4}, checkpoint_id=tmp_path / "dcp", no_dist=True
    )
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(3), "nested": {"a": [torch.zeros(2), 5]}}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        blob = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    values: list[Any] = [
        {"a": [1, 2, (3, 4)], "b": {1: 2.5, "x": None}, "c": {5, 6}, "d": frozenset({7})},
        [[[[]]]],
        (1,) * 40,
        {i: str(i) for i in range(300)},
        [2**70, -1, -2, 1.5, float("nan"), b"xy", bytearray(b"z"), True],
        torch.Size([3, 4]),
    ]
    deep = [
        b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."
        for depth in range(MAX_PICKLE_DEPTH - 2, MAX_PICKLE_DEPTH + 1)
    ]
    made = [
        b"\x80\x04]\x94h\x00a.",  # a list holding itself
        b"\x80\x04K\x01K\x02a.",  # appending to a number
        b"\x80\x04(K\x01K\x02u.",  # items with no dict below their mark
        b"\x80\x04}\x94(K\x01h\x00u.",  # a dict holding itself
        b"\x80\x04\x85.",  # a tuple of nothing on the stack
        b"\x80\x04(\x85.",  # ... of nothing above the mark
        b"\x80\x04h\x05.",  # a memo entry never stored
        b"\x80\x04]\x94j\x00\x00\x00",  # cut inside an argument
        b"\x80\x04\x8c\x05ab.",  # a string past the end
        b"\x80\x04]\x94(K\x01K\x02e\x94.",  # appends into a list, memoized
        b"\x80\x04]" + b"]" * (MAX_PICKLE_DEPTH + 1) + b"a" * (MAX_PICKLE_DEPTH + 1) + b".",  # lists in lists
    ]
    return [
        *(p.read_bytes() for p in sorted((tmp_path / "run").rglob(".metadata"))),
        (tmp_path / "dcp" / ".metadata").read_bytes(),
        blob,
        *(pickle.dumps(value, protocol=protocol) for value in values for protocol in range(6)),
        *deep,
        *made,
    ]


def mutated(data: bytes, rng: random.Random) -> bytes:
    """``data`` with one byte changed, inserted or removed, a span copied elsewhere, or cut short."""
    edited = bytearray(data)
    at = rng.randrange(len(edited))
    kind = rng.randrange(5)
    if kind == 0:
        edited[at] = rng.randrange(256)
    elif kind == 1:
        edited.insert(at, rng.randrange(256))
    elif kind == 2:
        del edited[at]
    elif kind == 3:
        start = rng.randrange(len(edited))
        edited[at:at] = edited[start : start + rng.randrange(1, 24)]
    else:
        del edited[at:]
    return bytes(edited)


def test_the_opcodes_taken_inline_give_what_one_opcode_at_a_time_gives(tmp_path: Path) -> None:
    rng = random.Random(0)
    cases = 0
    refusals = set()
    for data in pickles(tmp_path):
        # A large pickle's start holds every opcode it has; its mutations cut it there.
        head = data[:4000] + b"." if len(data) > 4000 else data
        for edited in [data, *(mutated(head, rng) for _ in range(100))]:
            for persistent in (False, True):
                expected = outcome(one_at_a_time, edited, persistent)
                assert outcome(scan_pickle, edited, persistent) == expected, edited
                refusals.add(expected[1].split(" ", 3)[:3].__str__() if expected[0] == "refused" else "")
                cases += 1
    assert cases > 10_000
    assert len(refusals) > 10  # the mutations reach many of the walk's refusals, not one


def test_nbckpts_metadata_pickles_each_shape_once(tmp_path: Path) -> None:
    """Each distinct shape and offset one torch.Size, which the storage entries' indices share
    (a torch.Size is the 8 opcodes of a REDUCE, one an index before: 11 % of the walk)."""

    def reduces(tensors: int) -> int:
        run = tmp_path / f"run-{tensors}"
        with Checkpointer(run) as ckpt:
            ckpt.save({f"w{i}": torch.ones(4 + i % 2) for i in range(tensors)}, step=1).wait()
        data = next(run.rglob(".metadata")).read_bytes()
        ops = [op.name for op, _, _ in pickletools.genops(data)]
        loaded = _unpickle.load_metadata(data, "x")
        assert all(index.offset == torch.Size([0]) for index in loaded.storage_data)
        return ops.count("REDUCE")

    assert reduces(10) == reduces(40)  # before: a torch.Size more each tensor (15 and 45)
