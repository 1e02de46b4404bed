"""Corrupt and hostile checkpoints: detected on restore, named, skipped for the previous one.

Hostile files are crafted with a valid manifest checksum, so that what refuses them is the
safety checks (allow-listed unpickling, tensor-only entries, path and range checks, regular
files only, bounded reads), not the checksum. Each of the issue's numbered cases is named.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.hostile import (
    RunsCode,
    assert_falls_back,
    assert_is_step,
    blank,
    load_metadata,
    rewrite_manifest,
    state_of,
    two_steps,
)
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine._faults import armed
from nbckpt.engine._format import framing


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A directory with two good checkpoints, steps 1 and 2 (two data files each)."""
    directory = two_steps(tmp_path / "run")
    assert sorted(os.listdir(directory / "step-000002")) == [
        ".metadata",
        "__0_0.distcp",
        "__0_1.distcp",
        "__0_2.distcp",  # the plain values (the step) as DCP byte items
        "manifest.json",
    ]
    return directory


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
    "flipped data byte": ("__0_1.distcp", lambda p: flip_byte(p, 900), "step-000002/__0_1.distcp is corrupt"),
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


def test_payload_is_live(tmp_path: Path) -> None:
    """The hostile tests below mean something only if the payload really runs when unpickled."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(RunsCode(marker)))
    assert marker.exists()


def evil_metadata_alone(step_dir: Path, marker: Path) -> None:
    (step_dir / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))


def evil_metadata_nested(step_dir: Path, marker: Path) -> None:
    metadata = load_metadata(step_dir / ".metadata")
    metadata.planner_data = {"hook": RunsCode(marker)}
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def evil_byte_io_entry(step_dir: Path, marker: Path) -> None:
    """A real DCP checkpoint with a non-tensor entry, which DCP writes with torch.save (pickle)."""
    for entry in step_dir.iterdir():
        if entry.name != "manifest.json":
            entry.unlink()
    state = {**{k: v for k, v in state_of(2).items() if k != "step"}, "extra": RunsCode(marker)}
    dcp_save(state, storage_writer=FileSystemWriter(step_dir, overwrite=True), no_dist=True)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name in list(manifest["files"]):  # list the files DCP wrote instead of nbckpt's
        if name != ".metadata":
            del manifest["files"][name]
    for name in os.listdir(step_dir):
        if name.endswith(".distcp"):
            manifest["files"][name] = {"size": 0, "blocks": []}
    metadata = load_metadata(step_dir / ".metadata")
    for key in manifest["items"]:  # each tensor where DCP put it: only the extra entry is hostile
        info, entry = metadata.storage_data[MetadataIndex(key, (0,))], metadata.state_dict_metadata[key]
        header, _ = framing(entry.properties.dtype, tuple(entry.size))
        data = info.offset + len(header)
        manifest["items"][key] = [[info.relative_path, info.offset, info.length, data, [0], list(entry.size)]]
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def relabel_storage_entry(step_dir: Path, marker: Path) -> None:
    """Item 1: DCP metadata pointing a tensor at a file outside the step directory."""
    metadata = load_metadata(step_dir / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../step-000001/__0_0.distcp"
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def shift_storage_entry(step_dir: Path, marker: Path) -> None:
    """Item 1: DCP metadata whose byte range lies past the end of its file."""
    metadata = load_metadata(step_dir / ".metadata")
    for info in metadata.storage_data.values():
        info.offset += 1 << 30
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))


HOSTILE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "pickle payload": (evil_metadata_alone, "refusing to load global builtins.exec"),
    "payload inside DCP metadata": (evil_metadata_nested, "refusing to load global builtins.exec"),
    "BYTE_IO entry": (evil_byte_io_entry, "entry 'extra' is not in the manifest; refusing to unpickle it"),
    "1: storage entry outside the step": (relabel_storage_entry, "is not where its data is"),
    "1: storage entry past its file": (shift_storage_entry, "is not where its data is"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_metadata_is_refused_and_never_runs(run: Path, tmp_path: Path, case: str) -> None:
    craft, message = HOSTILE[case]
    marker = tmp_path / "payload-ran"
    step_dir = run / "step-000002"
    craft(step_dir, marker)
    rewrite_manifest(step_dir)  # checksums pass: only the safety checks stand in the way
    with Checkpointer(run, mode="sync") as ckpt, pytest.raises(CheckpointError, match=re.escape(message)):
        ckpt.verify(2)  # what a plain dcp.load would meet is refused
    # restore refuses it too (issue 20, item 7): a step that restored would be trusted by the next
    # plain dcp.load, which would run the payload
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
    assert_falls_back(run, "manifest.json names an unknown dtype 'load'")


def drop_checksum_field(manifest: dict[str, Any]) -> None:
    del manifest["files"]["__0_0.distcp"]["blocks"]


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


def rank_key_not_a_rank(manifest: dict[str, Any]) -> None:
    manifest["rank_trees"] = {"00": manifest["tree"]}


MALFORMED = {
    "entry without checksum": drop_checksum_field,
    "entry not a dict": file_entry_not_a_dict,
    "tree items not a list": tree_items_not_a_list,
    "tree node not a dict": tree_node_not_a_dict,
    "tensor without key": tensor_node_without_key,
    "shape not numbers": tensor_shape_not_numbers,
    "rank key not a rank": rank_key_not_a_rank,
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifest_is_skipped_not_a_crash(run: Path, case: str) -> None:
    """A signed manifest of the wrong shape is a bad checkpoint (CheckpointError), not a KeyError."""
    rewrite_manifest(run / "step-000002", MALFORMED[case])
    assert_falls_back(run, "step-000002")


@pytest.mark.timeout(60)
def test_a_huge_world_size_costs_no_memory(run: Path) -> None:
    """Checking the rank keys of a manifest must not build a set as large as its world size."""
    rewrite_manifest(run / "step-000002", lambda m: m.update(world_size=10**15, rank_trees={"0": m["tree"]}))
    with Checkpointer(run, read_only=True) as ckpt:
        state = blank()
        assert ckpt.restore(state) == 2  # signed and consistent: the data is rank 0's, and intact
        assert_is_step(state, 2)


def test_unreadable_file_is_skipped_not_a_crash(run: Path) -> None:
    """An I/O error reading a checkpoint (a bad sector, a lost NFS server) is a bad checkpoint."""
    broken = str(run / "step-000002" / "__0_0.distcp")

    def open_failing(path: str) -> None:
        if path == broken:
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    with armed("file.open", open_failing):
        assert_falls_back(run, "step-000002/__0_0.distcp is unreadable (Input/output error [EIO]")


# -- the numbered cases: hostile directories ----------------------------------------------


def test_1_tensor_range_outside_its_file_is_refused_before_reading(run: Path) -> None:
    def push_out(manifest: dict[str, Any]) -> None:
        chunk = manifest["items"]["w"][0]  # [file, blob offset, blob length, data offset, offsets, sizes]
        chunk[3] = manifest["files"][chunk[0]]["size"]

    rewrite_manifest(run / "step-000002", push_out)
    assert_falls_back(run, "step-000002/manifest.json puts tensor 'w' at bytes")


@pytest.mark.parametrize("value", [-1, 2.5, "0", None, True])
def test_2_bad_offsets_and_sizes_are_refused(run: Path, value: Any) -> None:
    def poison(manifest: dict[str, Any]) -> None:
        manifest["items"]["w"][0][3] = value

    rewrite_manifest(run / "step-000002", poison)
    assert_falls_back(run, "step-000002/manifest.json has a malformed entry for tensor 'w'")


def test_2_a_fifo_in_the_step_never_hangs_restore(run: Path) -> None:
    data = run / "step-000002" / "__0_0.distcp"
    data.unlink()
    os.mkfifo(data)
    assert_falls_back(run, "step-000002/__0_0.distcp is not a regular file")


def test_3_a_deeply_nested_manifest_is_a_bad_checkpoint(run: Path) -> None:
    (run / "step-000002" / "manifest.json").write_text("[" * 200_000)
    assert_falls_back(run, "step-000002/manifest.json is unreadable (nested too deeply)")


def test_3_a_huge_sparse_manifest_is_refused_without_reading_it(run: Path) -> None:
    with open(run / "step-000002" / "manifest.json", "r+b") as stream:
        stream.truncate(30 << 30)  # sparse: 30 GiB on paper, nothing on disk
    assert_falls_back(run, "step-000002/manifest.json has 32212254720 bytes, more than a manifest may")


def test_4_a_symlinked_data_file_is_refused(run: Path, tmp_path: Path) -> None:
    step_dir = run / "step-000002"
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copy(step_dir / "__0_0.distcp", elsewhere)
    (step_dir / "__0_0.distcp").unlink()
    (step_dir / "__0_0.distcp").symlink_to(elsewhere)
    rewrite_manifest(step_dir)  # the hashes of the link's target: only the link check refuses it
    assert_falls_back(
        run, "step-000002/__0_0.distcp is unreadable (Too many levels of symbolic links [ELOOP]"
    )


def test_4_leftovers_that_are_symlinks_are_removed_not_followed(run: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    (run / ".tmp-step-000009-abc123").symlink_to(victim)
    with pytest.warns(UserWarning, match=r"\.tmp-step-000009-abc123"):
        Checkpointer(run).close()
    assert not os.path.lexists(run / ".tmp-step-000009-abc123")
    assert (victim / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("spelling", ["step-2", "step-0000002", "step-00000\u0662", "step-000002 "])
def test_5_only_one_spelling_names_a_step(run: Path, spelling: str) -> None:
    shutil.copytree(run / "step-000001", run / spelling)  # step 1's data under another name for 2
    with Checkpointer(run, mode="sync") as ckpt:
        assert ckpt.steps() == [1, 2]
        state = blank()
        assert ckpt.restore(state, step=2) == 2
        assert_is_step(state, 2)
