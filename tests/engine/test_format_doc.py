"""docs/format.md is enough to write a reader, names every constant of the format, and says what
the optional `metrics` key of a manifest holds.

The reader below was written from that page alone: json, xxhash and numpy, nothing of nbckpt's
format code. It finds the committed steps of a run, checks the manifest's checksum and every
block of every file, and assembles each tensor from its chunks; the tests compare what it reads
with what nbckpt was asked to save (a few dtypes in one process, DTensor shards on 2 ranks).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from helpers import ROOT
from helpers.ranks import run_ranks

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine import _format, _manifest

DOC = ROOT / "docs" / "format.md"

# -- The reader: everything it knows is on docs/format.md ---------------------------------------
STEP_RE = re.compile(r"step-([0-9]{6,19})")
BLOCK_SIZE = 16777216
MANIFEST_LIMIT = 67108864
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


class Damaged(Exception):
    """A step that the page says a reader must refuse."""


def committed_steps(run: Path) -> dict[int, Path]:
    steps = {}
    for entry in os.scandir(run):
        match = STEP_RE.fullmatch(entry.name)
        if match is None or f"step-{int(match.group(1)):06d}" != entry.name:
            continue  # not the one spelling of a step
        manifest = Path(entry.path, "manifest.json")
        if entry.is_dir(follow_symlinks=False) and manifest.is_file() and not manifest.is_symlink():
            steps[int(match.group(1))] = Path(entry.path)
    return dict(sorted(steps.items()))


def read_manifest(step_dir: Path, step: int) -> dict[str, Any]:
    data = (step_dir / "manifest.json").read_bytes()
    if len(data) > MANIFEST_LIMIT or not data.startswith(b'{"checksum":"') or data[29:31] != b'",':
        raise Damaged("not a manifest")
    if xxhash.xxh3_64_hexdigest(b"{" + data[31:]) != data[13:29].decode():
        raise Damaged("manifest checksum")
    body: dict[str, Any] = json.loads(data)
    if (body["format"], body["step"], body["block_size"]) != ("nbckpt/3", step, BLOCK_SIZE):
        raise Damaged("format, step or block size")
    return body


def check_files(step_dir: Path, body: dict[str, Any]) -> None:
    for name, entry in body["files"].items():
        if not (name == ".metadata" or re.fullmatch(r"__[0-9]{1,6}_[0-9]{1,6}\.distcp", name)):
            raise Damaged(f"file name {name}")
        path = step_dir / name
        if path.is_symlink() or not path.is_file() or path.stat().st_size != entry["size"]:
            raise Damaged(f"{name} is not a file of {entry['size']} bytes")
        if len(entry["blocks"]) != math.ceil(entry["size"] / BLOCK_SIZE):
            raise Damaged(f"{name}: block count")
        with open(path, "rb") as f:
            for index, expected in enumerate(entry["blocks"]):
                if xxhash.xxh3_64_hexdigest(f.read(BLOCK_SIZE)) != expected:
                    raise Damaged(f"{name}: block {index} checksum")


def tensor_bytes(step_dir: Path, chunks: list[Any], dtype: str, shape: list[int]) -> bytes:
    """The whole tensor, row-major, from its chunks (each a block of it at its offsets)."""
    itemsize = ITEMSIZE[dtype]
    whole = np.zeros((*shape, itemsize), dtype=np.uint8)
    for file, blob_offset, blob_length, data_offset, offsets, sizes in chunks:
        nbytes = math.prod(sizes) * itemsize
        if not blob_offset <= data_offset <= data_offset + nbytes <= blob_offset + blob_length:
            raise Damaged("chunk outside its blob")
        with open(step_dir / file, "rb") as f:
            f.seek(data_offset)
            data = f.read(nbytes)
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
        whole[region] = np.frombuffer(data, dtype=np.uint8).reshape(*sizes, itemsize)
    return whole.tobytes()


def value(node: dict[str, Any], step_dir: Path, items: dict[str, Any]) -> Any:
    """A tree node as the page's table says; a tensor as (dtype, shape, its bytes)."""
    kind = node["t"]
    if kind in ("dict", "namespace"):
        return {key: value(child, step_dir, items) for key, child in node["items"]}
    if kind in ("list", "tuple"):
        return [value(child, step_dir, items) for child in node["items"]]
    if kind in ("module", "optimizer", "stateful"):
        return value(node["state"], step_dir, items)
    if kind in ("tensor", "ndarray"):
        dtype, shape = node["dtype"], node["shape"]
        return dtype, shape, tensor_bytes(step_dir, items[node["key"]], dtype, shape)
    if kind == "float":
        return float(node["v"])
    return node["v"]  # value, path, dtype, device: the JSON value itself


def read_step(step_dir: Path, step: int) -> Any:
    body = read_manifest(step_dir, step)
    check_files(step_dir, body)
    return value(body["tree"], step_dir, body["items"])


# -- What nbckpt was given, as the reader gives it back ------------------------------------------
def as_read(obj: Any) -> Any:
    if isinstance(obj, torch.nn.Module):
        return as_read(obj.state_dict())
    if isinstance(obj, dict):
        return {key: as_read(item) for key, item in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [as_read(item) for item in obj]
    if isinstance(obj, np.ndarray):
        obj = torch.from_numpy(obj)
    if isinstance(obj, torch.Tensor):
        data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return str(obj.dtype).removeprefix("torch."), list(obj.shape), data
    return obj


def test_a_reader_written_from_the_page_reads_a_step_and_checks_every_checksum(tmp_path: Path) -> None:
    torch.manual_seed(0)
    state = {
        "model": torch.nn.Linear(4, 3),
        "big": torch.arange(5_000_000, dtype=torch.int32),  # 20 MB: two checksum blocks
        "half": torch.randn(3, 5).to(torch.bfloat16),
        "mask": torch.tensor([[True, False], [False, True]]),
        "codes": torch.arange(-6, 6, dtype=torch.int16).reshape(3, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "array": np.linspace(0.0, 1.0, 7),
        "lr": 0.125,
        "name": "run-a",
        "history": [1, "two", None, True],
    }
    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        ckpt.save({**state, "lr": 1.0}, 1)
        ckpt.save(state, 2)
        ckpt.wait()
    # What the page says never counts: a save in progress, a step without a manifest, another
    # spelling of a step, a symlink to a step.
    shutil.copytree(run / "step-000002", run / ".tmp-step-000009-ab12")
    (run / "step-000003").mkdir()
    shutil.copy(run / "step-000002" / "__0_0.distcp", run / "step-000003")
    shutil.copytree(run / "step-000001", run / "step-4")
    (run / "step-000005").symlink_to(run / "step-000001")

    steps = committed_steps(run)
    with Checkpointer(run, read_only=True) as reader:
        assert list(steps) == reader.steps() == [1, 2]
    assert read_step(steps[2], 2) == as_read(state)
    assert read_step(steps[1], 1) == as_read({**state, "lr": 1.0})

    # The reader's checks can fail: one byte changed in the big tensor's second block.
    body = json.loads((steps[2] / "manifest.json").read_bytes())
    file, _, _, data_offset, _, _ = body["items"]["big"][0]
    with open(steps[2] / file, "r+b") as f:
        f.seek(data_offset + BLOCK_SIZE + 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(Damaged, match="block 1 checksum"):
        read_step(steps[2], 2)


SHARDED_WORKER = """
import json, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from nbckpt import Checkpointer
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
rows = torch.arange(35, dtype=torch.float32).reshape(7, 5)
cols = torch.arange(24, dtype=torch.int64).reshape(4, 6)
state = {"rows": distribute_tensor(rows, mesh, [Shard(0)]), "cols": distribute_tensor(cols, mesh, [Shard(1)]),
         "same": distribute_tensor(torch.ones(3, dtype=torch.float16), mesh, [Replicate()]), "step": 5}
with Checkpointer(sys.argv[2]) as ckpt:
    ckpt.save(state, 5)
    ckpt.wait()
dist.destroy_process_group()
print(json.dumps({"saved": True}))
"""


@pytest.mark.timeout(300)
def test_the_reader_assembles_dtensor_shards_two_ranks_saved(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(SHARDED_WORKER)
    results = run_ranks("save", tmp_path / "run", 2, timeout=240, worker=worker)
    for rank, (code, seen, err) in results.items():
        assert code == 0 and seen == {"saved": True}, f"rank {rank}: {err}"

    steps = committed_steps(tmp_path / "run")
    body = read_manifest(steps[5], 5)
    assert {len(body["items"][key]) for key in ("rows", "cols")} == {2}  # one chunk per rank
    assert len(body["items"]["same"]) == 1  # a replicated chunk is written once
    assert read_step(steps[5], 5) == as_read(
        {
            "rows": torch.arange(35, dtype=torch.float32).reshape(7, 5),
            "cols": torch.arange(24, dtype=torch.int64).reshape(4, 6),
            "same": torch.ones(3, dtype=torch.float16),
            "step": 5,
        }
    )


# -- Every constant of the format is on the page -------------------------------------------------
def literals(constant: Any) -> list[str]:
    """How the page must spell a constant's value: each string, number or pattern as code."""
    if isinstance(constant, re.Pattern):
        return [constant.pattern]
    if isinstance(constant, (tuple, frozenset)):
        return [text for item in sorted(constant, key=str) for text in literals(item)]
    return [str(constant)]


CONSTANTS = {
    name: constant
    for name, constant in vars(_format).items()
    if name.lstrip("_").isupper() and isinstance(constant, (str, int, tuple, frozenset, re.Pattern))
}


def test_the_page_spells_every_constant_of_the_format() -> None:
    page = DOC.read_text()
    assert {"FORMAT", "BLOCK_SIZE", "MANIFEST_KEYS", "POINTER_FORMAT", "_STEP_RE"} <= set(CONSTANTS)
    missing = {
        name: text
        for name, constant in CONSTANTS.items()
        for text in literals(constant)
        if f"`{text}`" not in page
    }
    assert not missing, f"docs/format.md does not spell these constants of _format.py: {missing}"


def test_metrics_are_an_optional_object_of_finite_numbers_as_the_page_says(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(2)}, 1)
    data = (tmp_path / "step-000001" / "manifest.json").read_bytes()
    assert _manifest.parse(data, 1, "manifest").metrics == {}  # absent: no metrics
    body = json.loads(data)
    good = _manifest.sign({**body, "metrics": {"loss": 0.25, "accuracy": 1}})
    assert _manifest.parse(good, 1, "manifest").metrics == {"loss": 0.25, "accuracy": 1.0}
    for bad in ({"loss": "low"}, {"loss": float("nan")}, {"loss": True}, [0.5]):
        with pytest.raises(CheckpointError, match="malformed metrics"):
            _manifest.parse(_manifest.sign({**body, "metrics": bad}), 1, "manifest")

    written = json.loads(
        _manifest.build(
            step=1,
            nbytes=0,
            world_size=1,
            files={},
            items={},
            tree={"t": "dict", "items": []},
            rank_trees={},
            rng={},
            provenance={},
            timing={},
            metrics={"loss": 0.5},
        )
    )
    assert written["metrics"] == {"loss": 0.5}
    assert set(written) <= set(_format.MANIFEST_KEYS)
