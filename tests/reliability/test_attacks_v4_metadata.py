"""Reliability v4 (issue 34), DCP's ``.metadata`` under attack: items 1, 2, 5, 6 and 8a, each
test named after its item.

A ``.metadata`` is a pickle: a plain-DCP ``step-N/`` folder beside a run's own steps is read
without any checksum, and a native step's ``.metadata`` passes once its manifest is re-signed.
What must hold: the process never crashes, no file costs more than its size, a value nbckpt
cannot hold is left out with a warning, and a bad step is one CheckpointError naming the file,
``restore()`` falling back to the older step.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import random
import re
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.hostile import assert_is_step, blank, load_metadata, rewrite_manifest, run_child
from torch.distributed.checkpoint.metadata import MetadataIndex

from nbckpt import Checkpointer, CheckpointError, ConfigError
from nbckpt.cli import main as cli
from nbckpt.engine import _shards, _unpickle
from nbckpt.engine._shards import Region
from nbckpt.engine._unpickle import MAX_PICKLE_DEPTH, MAX_SHARED_HASH, scan_pickle


def dcp_step(run: Path, step: int, state: dict[str, Any]) -> Path:
    """``state`` saved by plain ``dcp.save`` as torchtitan names its steps, beside the run's own."""
    folder = run / f"step-{step}"
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    return folder


def edit_metadata(folder: Path, edit: Any) -> None:
    metadata = load_metadata(folder / ".metadata")
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def assert_skips_newest(run: Path, newest: int, message: str) -> None:
    """restore() warns naming the problem and takes step 2; load(newest) refuses in one line."""
    with Checkpointer(run, read_only=True) as ckpt:
        state = blank()
        with pytest.warns(UserWarning, match=re.escape(message)):
            assert ckpt.restore(state) == 2
        assert_is_step(state, 2)
        with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
            ckpt.load(newest)
        assert "\n" not in str(raised.value)


def deep_key(depth: int) -> bytes:
    """A pickle of ``{((...(),)...): 1}``, the key a tuple ``depth`` deep: no global at all, so an
    allow-list never sees it; building the dict hashes the key, which CPython does recursing in C."""
    return b"\x80\x04}" + b")" + b"\x85" * depth + b"K\x01s."


# -- item 1: a 1 MB .metadata crashes the interpreter ----------------------------------------------

READ_EVERY_WAY = """
    import sys, warnings
    import torch
    from nbckpt import Checkpointer, CheckpointError
    from nbckpt.cli import main as cli
    warnings.simplefilter("ignore")
    run, step = sys.argv[1], int(sys.argv[2])
    with Checkpointer(run, read_only=True) as ckpt:
        state = {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.float64), "step": -1}
        print("restored", ckpt.restore(state), state["step"])
        for read in (ckpt.load, ckpt.verify):
            try:
                read(step)
                print("read")
            except CheckpointError as exc:
                print("refused", str(exc).splitlines()[0])
    print("cli", cli(["verify", run, str(step)]))
"""


@pytest.mark.parametrize("where", ["plain DCP step", "native step, re-signed"])
def test_item01_a_tuple_nested_a_million_deep_is_refused_without_a_crash(run: Path, where: str) -> None:
    if where == "plain DCP step":
        (run / "step-9").mkdir()
        (run / "step-9" / ".metadata").write_bytes(deep_key(1_000_000))
        step, older, label = 9, 2, "step-9/.metadata"
    else:
        (run / "step-000002" / ".metadata").write_bytes(deep_key(1_000_000))
        rewrite_manifest(run / "step-000002")
        step, older, label = 2, 1, "step-000002/.metadata"
    child = run_child(READ_EVERY_WAY, str(run), str(step))
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])  # before the fix: -11, SIGSEGV
    lines = child.stdout.splitlines()
    refusal = f"{label}: unsafe or unreadable DCP metadata (it nests objects deeper than {MAX_PICKLE_DEPTH})"
    assert lines[0] == f"restored {older} {older}", child.stdout
    assert lines[1].removeprefix("refused ") == refusal, child.stdout
    assert lines[2].endswith(refusal), child.stdout
    assert lines[-1] == "cli 1", child.stdout


def test_item01_the_prescan_bounds_what_a_pickle_builds() -> None:
    """Nesting, cycles, a memo index that would grow the unpickler's memo, persistent ids: each
    refused before anything is built; DCP's own metadata passes, one object an opcode at most."""
    assert scan_pickle(deep_key(MAX_PICKLE_DEPTH - 2)) <= len(deep_key(MAX_PICKLE_DEPTH - 2))
    refused = {
        deep_key(MAX_PICKLE_DEPTH): "nests objects deeper than",
        b"\x80\x04]\x94h\x00a.": "changes an object already inside another",  # a list holding itself
        b"\x80\x04]r\xff\xff\xff\x0f.": "stores memo entry 268435455 of 0",  # 2 GB of memo, zeroed
        b"\x80\x04K\x01Q.": "holds opcode BINPERSID",
        b"\x80\x04B\xff\xff\xff\x7f.": "expected 2147483647 bytes",  # a length past the file's end
    }
    for data, reason in refused.items():
        with pytest.raises(ValueError, match=reason):
            scan_pickle(data)
    state = {"w": torch.ones(3), "nested": {"a": [torch.zeros(2), 5]}}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with zipfile.ZipFile(buffer) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert scan_pickle(pickled, persistent=True) > 0


def test_item01_numbers_sharing_one_hash_are_refused_before_a_dict_is_built() -> None:
    """A dict of 20,000 int keys that all hash alike (460 KB) took 9.8 s to unpickle, quadratic
    in their count; numbers' hashes are not salted. Refused by the scan, building nothing;
    large numbers that merely repeat, random 64-bit ints, fractions and NaNs still pass."""
    collide = 2**61 - 1  # ints equal modulo this hash alike
    crafted = pickle.dumps({1 + k * collide: 0 for k in range(20_000)}, protocol=4)
    with pytest.raises(CheckpointError, match=f"x/.metadata: .*more than {MAX_SHARED_HASH} of its numbers"):
        _unpickle.load_metadata(crafted, "x/.metadata")
    # The scan stops at the first number past the bound (before the fix it built the whole dict).
    just_over = pickle.dumps([1 + k * collide for k in range(1, MAX_SHARED_HASH + 2)], protocol=4)
    with pytest.raises(ValueError, match="share one hash"):
        scan_pickle(just_over)
    scan_pickle(pickle.dumps([1 + k * collide for k in range(1, MAX_SHARED_HASH + 1)], protocol=4))
    generator = random.Random(0)
    legitimate = {
        "seeds": {generator.getrandbits(64): 2**63 - 5 for _ in range(20_000)},
        "repeated": [2**63 - 5] * 1000,
        "fractions": [i / 3 for i in range(10_000)],
        "nans": [float("nan")] * 100,
    }
    assert scan_pickle(pickle.dumps(legitimate, protocol=4)) > 20_000


def test_item01_a_plain_value_nested_a_million_deep_is_left_out_without_a_crash(tmp_path: Path) -> None:
    """torch's weights-only unpickler hashes what it builds too: a value's blob is scanned first."""
    folder = dcp_step(tmp_path, 9, {"w": torch.ones(3), "v": 5})
    metadata = load_metadata(folder / ".metadata")
    buffer = io.BytesIO()
    torch.save({"k": 1}, buffer)
    with zipfile.ZipFile(buffer) as archive, zipfile.ZipFile(hostile := io.BytesIO(), "w") as out:
        for name in archive.namelist():
            out.writestr(name, deep_key(1_000_000) if name.endswith("data.pkl") else archive.read(name))
    info = metadata.storage_data[MetadataIndex("v")]
    with open(folder / info.relative_path, "ab") as data:
        offset = data.tell()
        data.write(hostile.getvalue())
    info.offset, info.length = offset, len(hostile.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    child = run_child(
        """
        import sys, warnings
        from nbckpt import Checkpointer
        with Checkpointer(sys.argv[1], read_only=True) as ckpt, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            print(sorted(ckpt.load(9)))
        print([str(w.message) for w in seen if "left out" in str(w.message)])
        """,
        str(tmp_path),
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])  # before the fix: SIGSEGV
    loaded, warned = child.stdout.splitlines()
    assert loaded == "['w']"
    assert "left out: v (does not load with weights only)" in warned


# -- item 2: a 2 KB .metadata stalls every restore ------------------------------------------------


def test_item02_list_positions_far_past_the_keys_are_refused_at_once(run: Path) -> None:
    folder = dcp_step(run, 9, {f"k{i}": [torch.ones(1)] for i in range(4)})
    edit_metadata(
        folder, lambda m: m.planner_data.update({f"k{i}.0": (f"k{i}", 2**20 - 1) for i in range(4)})
    )
    tracemalloc.start()
    try:
        assert_skips_newest(
            run, 9, "step-9/.metadata: the planner data leaves more empty list positions than 1024"
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Refused while nesting, before the holes are made: 4 million list positions would hold
    # 32 MB of pointers alone (and a tree node each, about 1 GB, before the fix).
    assert peak < 8 << 20, f"{peak / 2**20:.1f} MiB allocated"


def test_item02_a_list_with_a_few_empty_positions_still_reads(tmp_path: Path) -> None:
    """An empty dict in a list leaves a position no key fills: within the bound, as before."""
    folder = dcp_step(tmp_path, 9, {"x": [torch.ones(1), torch.ones(2)]})
    edit_metadata(folder, lambda m: m.planner_data.update({"x.1": ("x", 1000)}))
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        loaded = ckpt.load(9)
    assert len(loaded["x"]) == 1001 and loaded["x"][500] is None
    assert torch.equal(loaded["x"][1000], torch.ones(2))


# -- item 5: a value nbckpt does not save itself makes a plain DCP step unreadable ------------------


def torchtitan_like() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6.0)},
        "dataloader": {"dp_rank_0": pickle.dumps({"sample": 17})},  # torchtitan's dataloader state
        "odd": {"a_set": {1, 2}, "a_complex": 1 + 2j, "a_bytearray": bytearray(b"xy")},
        "step": 9,
    }


LEFT_OUT = "odd.a_set (a set, which nbckpt's tree does not hold)"


def test_item05_values_nbckpt_does_not_hold_are_left_out_with_one_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bytes (torchtitan's dataloader state) and a bytearray are read as bytes (issue 31, item 12);
    a set and a complex are left out."""
    dcp_step(tmp_path, 9, torchtitan_like())
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        with pytest.warns(UserWarning, match=re.escape(LEFT_OUT)) as warned:
            loaded = ckpt.load(9)
        (message,) = [str(w.message) for w in warned if "left out" in str(w.message)]
        assert "odd.a_complex (a complex" in message
        assert "bytearray" not in message and "dataloader" not in message
        assert torch.equal(loaded["model"]["w"], torch.arange(6.0)) and loaded["step"] == 9
        assert loaded["dataloader"]["dp_rank_0"] == pickle.dumps({"sample": 17})
        assert loaded["odd"] == {"a_bytearray": b"xy"}
        state = {"model": {"w": torch.zeros(6)}, "step": 0}
        with pytest.warns(UserWarning, match="left out"):
            assert ckpt.restore(state) == 9  # before the fix: a ConfigError about *saving* 'v'
        assert torch.equal(state["model"]["w"], torch.arange(6.0)) and state["step"] == 9
        with pytest.warns(UserWarning, match="left out"):
            assert ckpt.verify(9)["left_out"]["odd.a_set"].startswith("a set")
        with (
            pytest.warns(UserWarning, match="left out"),
            pytest.raises(ConfigError, match=re.escape("the checkpoint has no entry 'odd.a_set'")),
        ):
            ckpt.restore({"odd": {"a_set": None}}, step=9)
    with pytest.warns(UserWarning, match="left out"):
        assert cli(["verify", str(tmp_path), "9"]) == 0
        assert cli(["export", str(tmp_path / "step-9"), str(tmp_path / "out.pt")]) == 0
    assert "step 9: ok (left out: odd.a_set, odd.a_complex" in capsys.readouterr().out
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert exported["step"] == 9 and torch.equal(exported["model"]["w"], torch.arange(6.0))
    assert exported["dataloader"]["dp_rank_0"] == pickle.dumps({"sample": 17})


# -- item 6: odd but allow-listed fields give raw errors and no fallback ---------------------------


def _entry(metadata: Any) -> Any:
    return metadata.state_dict_metadata["w"]


ODD_FIELDS = {
    "entries a list": (lambda m: setattr(m, "state_dict_metadata", []), "its state_dict_metadata is a list"),
    "storage a list": (lambda m: setattr(m, "storage_data", [1]), "its storage_data is a list"),
    "size of letters": (
        lambda m: setattr(_entry(m), "size", "ab"),
        "the size of 'w' is not a list of counts",
    ),
    "negative size": (
        lambda m: setattr(_entry(m), "size", [-4096]),
        "the size of 'w' is not a list of counts",
    ),
    "no properties": (
        lambda m: setattr(_entry(m), "properties", None),
        "the properties of 'w' name no dtype",
    ),
    "dtype a string": (
        lambda m: setattr(_entry(m).properties, "dtype", "float32"),
        "the properties of 'w' name no dtype",
    ),
    "quantized dtype": (
        lambda m: setattr(_entry(m).properties, "dtype", torch.quint4x2),
        "'w' has dtype torch.quint4x2",
    ),
    "chunks None": (lambda m: setattr(_entry(m), "chunks", None), "the chunks of 'w' are a NoneType"),
    "chunk a string": (lambda m: setattr(_entry(m), "chunks", ["x"]), "a chunk of 'w' is a str"),
    "chunk of floats": (
        lambda m: setattr(_entry(m).chunks[0], "sizes", [4096.0]),
        "the sizes of a chunk of 'w' is not a list",
    ),
    "chunk of 2 dims": (
        lambda m: setattr(_entry(m).chunks[0], "sizes", [4096, 1]),
        "a chunk of 'w' has other dimensions",
    ),
    "storage offset a string": (
        lambda m: m.storage_data.update(
            {
                MetadataIndex("w", [0]): dataclasses.replace(
                    m.storage_data[MetadataIndex("w", [0])], offset="0"
                )
            }
        ),
        "the storage entry of 'w' is at '0'",
    ),
    "metadata a dict": (lambda m: None, "holds a dict, not DCP's Metadata"),
    "planner data a bool": (
        lambda m: m.planner_data.update(w=("w", True)),
        "the planner data of 'w' is malformed",
    ),
    "a terabyte tensor": (
        lambda m: (setattr(_entry(m), "size", [1 << 40]), setattr(_entry(m).chunks[0], "sizes", [1 << 40])),
        "a chunk of 'w' at [0] is 4398046511104 bytes, its storage entry",
    ),
    "two entries over one range": (
        lambda m: m.storage_data.__setitem__(
            MetadataIndex("b", [0]), m.storage_data[MetadataIndex("w", [0])]
        ),
        "the storage entries of 'b' and 'w' overlap",
    ),
}


@pytest.mark.parametrize("case", ODD_FIELDS)
def test_item06_an_odd_metadata_field_is_a_checkpoint_error_and_restore_falls_back(
    run: Path, case: str
) -> None:
    edit, message = ODD_FIELDS[case]
    folder = dcp_step(run, 9, {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.float64), "step": 9})
    if case == "metadata a dict":
        (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    else:
        edit_metadata(folder, edit)
    assert_skips_newest(run, 9, f"step-9/.metadata{' ' if case == 'metadata a dict' else ': '}{message}")


# -- item 8a: a re-signed manifest claiming a huge .metadata allocates it -------------------------


@pytest.mark.parametrize("claimed", [3 << 30, 900 << 20])
def test_item08a_a_manifest_claiming_a_huge_metadata_allocates_nothing(run: Path, claimed: int) -> None:
    """Under an address-space limit 512 MB above what the process has: the claim is refused
    before a buffer exists (by the bound on DCP metadata, or by the file's real size)."""
    real = (run / "step-000002" / ".metadata").stat().st_size

    def huge(manifest: dict[str, Any]) -> None:
        meta = manifest["files"][".metadata"]
        meta["size"] = claimed
        meta["blocks"] = meta["blocks"] + ["0" * 16] * (-(-claimed // (16 << 20)) - len(meta["blocks"]))

    rewrite_manifest(run / "step-000002", huge)
    child = run_child(
        """
        import resource, sys, warnings
        import torch
        from nbckpt import Checkpointer, CheckpointError
        warnings.simplefilter("ignore")
        with open("/proc/self/status") as status:
            vm = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        with Checkpointer(sys.argv[1], read_only=True) as ckpt:
            state = {"w": torch.zeros(4096), "b": torch.zeros(64, dtype=torch.float64), "step": -1}
            print("restored", ckpt.restore(state), state["step"])
            try:
                ckpt.load(2)
                print("read")
            except CheckpointError as exc:
                print("refused", str(exc).splitlines()[0])
        """,
        str(run),
    )
    assert child.returncode == 0, child.stderr[-2000:]  # before the fix: a raw MemoryError
    refusal = (
        f"has {claimed} bytes, more than DCP metadata may (1073741824)"
        if claimed > 1 << 30
        else f"has {real} bytes, manifest says {claimed}"
    )
    assert child.stdout.splitlines() == ["restored 1 1", f"refused step-000002/.metadata {refusal}"]


def test_item02_chunks_in_columns_are_checked_without_comparing_each_pair(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20,000 chunks that all span the first dimension (1 MB of ``.metadata`` or a manifest) were
    compared each with each: 200 million comparisons, many minutes. Past the sweep's budget,
    straight cuts tell a tiling apart in n log n; an overlap is still found."""
    limit = _shards.SWEEP_BUDGET + 2 * 20_000  # the sweep's budget, and each chunk inside the tensor
    compared = 0
    real_overlap = _shards.overlap

    def counted(a: Region, b: Region) -> Region | None:
        nonlocal compared
        compared += 1
        assert compared <= limit, "comparing each chunk with each"
        return real_overlap(a, b)

    def tiles(chunks: list[Region], shape: tuple[int, ...], budget: int = _shards.SWEEP_BUDGET) -> bool:
        nonlocal compared
        compared = 0
        return _shards.tiles(chunks, shape, budget=budget)

    # The one private-name patch left here (tests/test_layout.py's PATCHED lists it): it counts
    # the calls of a pure function in the sweep's inner loop; a seam there would cost every
    # restore of a sharded tensor a call per pair of chunks compared.
    monkeypatch.setattr(_shards, "overlap", counted)
    columns = [Region((0, i), (1, 1)) for i in range(20_000)]
    assert tiles(columns, (1, 20_000))
    wide = [Region((0, 0), (1, 2)), *columns[1:-1]]  # overlaps column 1, leaves 19,999 out
    assert not tiles(wide, (1, 20_000))
    grid = [Region((i, j), (2, 3)) for i in range(0, 8, 2) for j in range(0, 9, 3)]
    assert tiles(grid[::-1], (8, 9))
    pinwheel = [
        Region((0, 0), (2, 1)),
        Region((0, 1), (1, 2)),
        Region((1, 2), (2, 1)),
        Region((2, 0), (1, 2)),
    ]
    assert tiles([*pinwheel, Region((1, 1), (1, 1))], (3, 3))  # no straight cut: the sweep's, within budget
    # straight cuts only: the same answers
    assert tiles(grid[::-1], (8, 9), budget=0) and not tiles(wide, (1, 20_000), budget=0)
