"""Two tiers: commit in the run's directory, upload to a mirror in the background, restore from
the mirror when the directory has nothing intact (a second directory, and a real S3 server)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.s3server import SeaweedS3

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine._faults import armed


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.arange(50_000, dtype=torch.float32) + step, "step": step}


def restored(ckpt: Checkpointer, step: int | None = None) -> tuple[int, dict[str, Any]]:
    state: dict[str, Any] = {"w": torch.zeros(50_000), "step": -1}
    return ckpt.restore(state, step=step), state


def test_every_commit_reaches_the_mirror_with_its_own_commit(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror"), keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(state_of(step), step=step)
        ckpt.wait()  # includes the uploads
        kinds = ckpt.timeline.to_pandas().query("kind == 'upload'")
        assert sorted(kinds["step"]) == [1, 2, 3, 4]
    with Checkpointer(tmp_path / "mirror", read_only=True) as mirror:
        assert mirror.steps() == [3, 4]  # the mirror keeps as many steps as the directory
        for step in mirror.steps():
            mirror.verify(step)


def test_uploads_leave_no_file_open(tmp_path: Path) -> None:
    def open_files() -> set[str]:
        fds = Path("/proc/self/fd")
        return {
            str(link.readlink())
            for link in fds.iterdir()
            if link.is_symlink() and str(tmp_path) in str(link.readlink())
        }

    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror"), keep=1) as ckpt:
        for step in range(1, 4):
            ckpt.save(state_of(step), step=step)
        ckpt.wait()  # includes the uploads
        held = open_files()
        assert held and all(name.endswith("/.nbckpt.lock") for name in held), held  # the locks alone


def test_restore_falls_back_to_the_mirror(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror")) as ckpt:
        for step in (1, 2):
            ckpt.save(state_of(step), step=step)
    data = next((tmp_path / "local" / "step-000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror")) as ckpt:
        with pytest.warns(UserWarning, match="skipping step-000002: .* is corrupt.*trying its mirror copy"):
            step, state = restored(ckpt)
        assert step == 2 and torch.equal(state["w"], state_of(2)["w"])  # the mirror's intact copy
        assert ckpt.restored_from is not None and ckpt.restored_from.endswith("mirror")
    shutil.rmtree(tmp_path / "local")  # the machine's disk is gone: a new one restores from the mirror
    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror")) as ckpt:
        step, state = restored(ckpt)
        assert step == 2 and torch.equal(state["w"], state_of(2)["w"])
        assert restored(ckpt, step=1)[0] == 1
        assert ckpt.restored_from is not None and ckpt.restored_from.endswith("mirror")
        assert ckpt.manifest(1)["step"] == 1  # read from the mirror, the only copy
    with Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror")) as ckpt:
        assert ckpt.restored_from is None
        ckpt.save(state_of(3), step=3).wait()
        assert restored(ckpt)[0] == 3 and ckpt.restored_from == ckpt.directory


def test_a_damaged_local_copy_is_never_uploaded(tmp_path: Path) -> None:
    """A local data file damaged after its commit (one byte flipped before the mirror reads it)
    fails its checksums on the way up: the mirror never holds the step."""

    def damaging(location: str, name: str) -> None:
        if name.endswith(".distcp"):
            with open(os.path.join(location, name), "r+b") as data:
                first = data.read(1)
                data.seek(0)
                data.write(bytes([first[0] ^ 0xFF]))

    with (
        armed("mirror.upload", damaging),
        Checkpointer(tmp_path / "local", mirror=str(tmp_path / "mirror")) as ckpt,
    ):
        ckpt.save(state_of(1), step=1).wait()
        with pytest.warns(
            UserWarning, match=r"step 1 is committed locally but not on the mirror .*checksum mismatch"
        ):
            ckpt.wait()
        assert ckpt.steps() == [1]
    with Checkpointer(tmp_path / "mirror", read_only=True) as mirror:
        assert mirror.steps() == []


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
def test_an_s3_mirror_and_a_lost_endpoint(tmp_path: Path, s3_server: SeaweedS3) -> None:
    bucket = f"nbckpt-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    url = f"s3://{bucket}/run"
    options = s3_server.storage_options()
    with Checkpointer(tmp_path / "local", mirror=url, mirror_options=options) as ckpt:
        ckpt.save(state_of(1), step=1).wait()
        ckpt.wait()
    with Checkpointer(url, read_only=True, storage_options=options) as mirror:
        assert mirror.steps() == [1]
        mirror.verify(1)
    shutil.rmtree(tmp_path / "local")
    with Checkpointer(tmp_path / "local", mirror=url, mirror_options=options) as ckpt:
        step, state = restored(ckpt)
        assert step == 1 and torch.equal(state["w"], state_of(1)["w"])
        wrong = {**options, "secret": "wrong"}
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpointer(tmp_path / "other", mirror=url, mirror_options=wrong)
    Checkpointer(tmp_path / "other").close()  # the failed construction let go of the directory
