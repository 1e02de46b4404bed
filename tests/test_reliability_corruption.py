"""Corrupt and hostile checkpoints: detected on restore, named, skipped for the previous one.

Hostile files are crafted with a valid manifest checksum, so that what refuses them is the
safety checks (allow-listed unpickling, tensor-only entries, path checks), not the checksum.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nbckpt import Checkpointer, CheckpointError
from nbckpt._dcp import load_metadata, new_hasher
from nbckpt._engine import _manifest_checksum
from nbckpt._store import LocalStore

NUMEL = 4096


def state_of(step: int) -> dict[str, Any]:
    return {
        "w": torch.arange(NUMEL, dtype=torch.float32) * step,
        "b": torch.full((64,), float(step), dtype=torch.float64),
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(NUMEL), "b": torch.zeros(64, dtype=torch.float64), "step": -1}


def assert_is_step(state: dict[str, Any], step: int) -> None:
    expected = state_of(step)
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
    assert state["step"] == step


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A directory with two good checkpoints, steps 1 and 2 (two data files each)."""
    directory = tmp_path / "run"
    with Checkpointer(directory, mode="sync", writer_threads=2) as ckpt:
        for step in (1, 2):
            ckpt.save(state_of(step), step=step)
    assert sorted(os.listdir(directory / "step-000002")) == [
        ".metadata", "__0_0.distcp", "__0_1.distcp", "manifest.json",
    ]
    return directory


def rewrite_manifest(step_dir: Path, edit: Callable[[dict[str, Any]], None] = lambda m: None) -> None:
    """Re-hash every file, apply ``edit`` and re-sign: a manifest that passes its own checksum."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    files = {}
    for entry in sorted(step_dir.iterdir()):
        if entry.name != "manifest.json":
            hasher = new_hasher()
            hasher.update(entry.read_bytes())
            files[entry.name] = {"size": entry.stat().st_size, "xxh3_64": hasher.hexdigest()}
    manifest["files"] = files
    edit(manifest)
    manifest["checksum"] = _manifest_checksum(manifest)
    path.write_text(json.dumps(manifest))


def assert_falls_back(directory: Path, message: str) -> None:
    """restore() warns naming the problem and takes step 1; restore(step=2) refuses."""
    with Checkpointer(directory, mode="sync") as ckpt:
        state = blank()
        with pytest.warns(UserWarning, match=re.escape(message)):
            assert ckpt.restore(state) == 1
        assert_is_step(state, 1)
        with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
            ckpt.restore(blank(), step=2)
        assert "\n" not in str(raised.value)


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garble(path: Path) -> None:
    path.write_bytes(b"\x00garbage{")


def edit_step_keep_checksum(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["step"] = 3
    path.write_text(json.dumps(manifest))


def edit_step_and_resign(path: Path) -> None:
    rewrite_manifest(path.parent, lambda manifest: manifest.update(step=3))


CORRUPTIONS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "flipped byte": ("__0_0.distcp", flip_byte, "step-000002/__0_0.distcp is corrupt"),
    "flipped metadata byte": (".metadata", flip_byte, "step-000002/.metadata is corrupt"),
    "truncated": ("__0_1.distcp", truncate, "step-000002/__0_1.distcp has"),
    "missing": ("__0_1.distcp", Path.unlink, "step-000002/__0_1.distcp is missing"),
    "edited manifest": ("manifest.json", edit_step_keep_checksum, "step-000002/manifest.json was modified"),
    "re-signed manifest": ("manifest.json", edit_step_and_resign, "step-000002/manifest.json names step 3"),
    "empty manifest": ("manifest.json", empty, "step-000002/manifest.json is unreadable"),
    "not json": ("manifest.json", garble, "step-000002/manifest.json is unreadable"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corruption_is_detected_and_skipped(run: Path, case: str) -> None:
    name, corrupt, message = CORRUPTIONS[case]
    corrupt(run / "step-000002" / name)
    assert_falls_back(run, message)


def test_truncated_file_without_verify_still_falls_back(run: Path) -> None:
    truncate(run / "step-000002" / "__0_0.distcp")
    with Checkpointer(run, mode="sync", verify=False) as ckpt:
        state = blank()
        with pytest.warns(UserWarning, match="skipping step-000002"):
            assert ckpt.restore(state) == 1
        assert_is_step(state, 1)


def test_every_checkpoint_corrupt_is_an_error(run: Path) -> None:
    for step_dir in ("step-000001", "step-000002"):
        flip_byte(run / step_dir / "__0_0.distcp")
    with (
        Checkpointer(run, mode="sync") as ckpt,
        pytest.warns(UserWarning, match="skipping"),
        pytest.raises(CheckpointError, match="no valid checkpoint in"),
    ):
        ckpt.restore(blank())


# -- hostile checkpoints ------------------------------------------------------------------------


class RunsCode:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def test_payload_is_live(tmp_path: Path) -> None:
    """The hostile tests below mean something only if the payload really runs when unpickled."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(RunsCode(marker)))
    assert marker.exists()


def evil_metadata_alone(step_dir: Path, marker: Path) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))


def evil_metadata_nested(step_dir: Path, marker: Path) -> None:
    with open(step_dir / ".metadata", "rb") as stream:
        metadata = load_metadata(stream, ".metadata")
    metadata.planner_data = {"hook": RunsCode(marker)}
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def evil_byte_io_entry(step_dir: Path, marker: Path) -> None:
    """A real DCP checkpoint with a non-tensor entry, which DCP writes with torch.save (pickle)."""
    for entry in step_dir.iterdir():
        if entry.name != "manifest.json":
            entry.unlink()
    state = {**{k: v for k, v in state_of(2).items() if k != "step"}, "extra": RunsCode(marker)}
    dcp_save(state, storage_writer=FileSystemWriter(step_dir, overwrite=True), no_dist=True)


HOSTILE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "pickle payload": (evil_metadata_alone, "refusing to load global builtins.exec"),
    "payload inside DCP metadata": (evil_metadata_nested, "refusing to load global builtins.exec"),
    "BYTE_IO entry": (evil_byte_io_entry, "entry 'extra' is not a tensor"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_pickle_is_refused_and_never_runs(run: Path, tmp_path: Path, case: str) -> None:
    craft, message = HOSTILE[case]
    marker = tmp_path / "payload-ran"
    step_dir = run / "step-000002"
    craft(step_dir, marker)
    rewrite_manifest(step_dir)
    with Checkpointer(run, mode="sync") as ckpt:
        assert ckpt.verify(2)["step"] == 2  # checksums pass: only the safety checks stand in the way
    assert_falls_back(run, message)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../step-000001/__0_0.distcp", "/etc/passwd", "sub/__0_0.distcp", ".."])
def test_manifest_paths_outside_the_checkpoint_are_refused(run: Path, name: str) -> None:
    def escape(manifest: dict[str, Any]) -> None:
        manifest["files"][name] = manifest["files"].pop("__0_0.distcp")

    rewrite_manifest(run / "step-000002", escape)
    assert_falls_back(run, f"step-000002/manifest.json names a file outside the checkpoint: {name!r}")


def test_manifest_naming_a_non_dtype_is_refused(run: Path) -> None:
    def poison(manifest: dict[str, Any]) -> None:
        tree = manifest["tree"]["items"]
        node = next(node for key, node in tree if key == "w")
        node["dtype"] = "load"  # torch.load is an attribute of torch, but not a dtype

    rewrite_manifest(run / "step-000002", poison)
    assert_falls_back(run, "manifest names an unknown dtype 'load'")


def drop_checksum_field(manifest: dict[str, Any]) -> None:
    del manifest["files"]["__0_0.distcp"]["xxh3_64"]


def file_entry_not_a_dict(manifest: dict[str, Any]) -> None:
    manifest["files"]["__0_0.distcp"] = 12


def tree_items_not_a_list(manifest: dict[str, Any]) -> None:
    manifest["tree"]["items"] = "w"


def tree_node_not_a_dict(manifest: dict[str, Any]) -> None:
    manifest["tree"]["items"][0][1] = ["tensor"]


def tensor_node_without_key(manifest: dict[str, Any]) -> None:
    node = next(node for key, node in manifest["tree"]["items"] if key == "w")
    del node["key"]


def tensor_shape_not_numbers(manifest: dict[str, Any]) -> None:
    node = next(node for key, node in manifest["tree"]["items"] if key == "w")
    node["shape"] = [None]


MALFORMED = {
    "entry without checksum": drop_checksum_field,
    "entry not a dict": file_entry_not_a_dict,
    "tree items not a list": tree_items_not_a_list,
    "tree node not a dict": tree_node_not_a_dict,
    "tensor without key": tensor_node_without_key,
    "shape not numbers": tensor_shape_not_numbers,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_is_skipped_not_a_crash(run: Path, case: str) -> None:
    """A signed manifest of the wrong shape is a bad checkpoint (CheckpointError), not a KeyError."""
    rewrite_manifest(run / "step-000002", MALFORMED[case])
    assert_falls_back(run, "step-000002")


def test_unreadable_file_is_skipped_not_a_crash(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An I/O error reading a checkpoint (a bad sector, a lost NFS server) is a bad checkpoint."""
    original = LocalStore.open
    broken = str(run / "step-000002")

    def open_failing(store: LocalStore, location: str, name: str) -> Any:
        if location == broken and name == "__0_0.distcp":
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.path.join(location, name))
        return original(store, location, name)

    monkeypatch.setattr(LocalStore, "open", open_failing)
    assert_falls_back(run, "step-000002/__0_0.distcp is unreadable (Input/output error [EIO]")
