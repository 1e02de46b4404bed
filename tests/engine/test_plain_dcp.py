"""Checkpoints plain ``torch.distributed.checkpoint.save`` wrote (torchtitan's ``step-N`` folders, or
any directory ``dcp.save`` wrote): listed, restored, loaded, verified for structure and exported
by nbckpt, read with weights only, and never changed or deleted, so a run can move to nbckpt."""

from __future__ import annotations

import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbckpt import Checkpointer, CheckpointError, ConfigError
from nbckpt.cli import main as cli
from nbckpt.engine._manifest import sign


def dcp_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.003)
    model(torch.randn(2, 6)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}


def test_a_torchtitan_run_is_listed_restored_loaded_verified_and_kept(tmp_path: Path) -> None:
    saved = dcp_state()
    dcp.save(saved, checkpoint_id=tmp_path / "run" / "step-7", no_dist=True)
    fresh = torch.nn.Linear(6, 4)
    optim = torch.optim.AdamW(fresh.parameters(), lr=1.0)
    with pytest.warns(UserWarning, match="torchtitan reads"):
        ckpt = Checkpointer(tmp_path / "run", mode="sync")  # saving here is the mid-way move's
    with ckpt:
        assert ckpt.steps() == [7]
        state = {"model": fresh, "optim": optim, "step": 0}
        assert ckpt.restore(state) == 7
        assert torch.equal(fresh.weight, saved["model"]["weight"]) and state["step"] == 7  # type: ignore[index]
        assert optim.param_groups[0]["lr"] == 0.003
        assert ckpt.verify(7)["format"] == "dcp"
        assert torch.equal(ckpt.load(7)["model"]["bias"], saved["model"]["bias"])  # type: ignore[index]
        with pytest.raises(CheckpointError, match="written by plain DCP; nbckpt never deletes it"):
            ckpt.delete(7)
        ckpt.save({"model": fresh, "optim": optim, "step": 8}, step=8)  # the run goes on in nbckpt
        assert ckpt.steps() == [7, 8]
    assert (tmp_path / "run" / "step-7" / ".metadata").exists()


def test_a_rewind_to_a_plain_dcp_step_sets_the_newer_steps_aside_and_keeps_it(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "run" / "step-10"), no_dist=True)
    with pytest.warns(UserWarning, match="torchtitan reads"):
        ckpt = Checkpointer(tmp_path / "run", mode="sync")
    with ckpt:
        ckpt.save({"w": torch.full((4,), 2.0)}, step=20)
        ckpt.restore({"w": torch.zeros(4)}, step=10)
        with pytest.warns(UserWarning, match="set aside, still restorable, in .*set-aside-1"):
            ckpt.save({"w": torch.full((4,), 3.0)}, step=11)
    with (
        pytest.warns(UserWarning, match="torchtitan reads"),
        Checkpointer(tmp_path / "run", mode="sync") as ckpt,
    ):
        assert ckpt.steps() == [10, 11]
        state = {"w": torch.zeros(4)}
        assert ckpt.restore(state, step=10) == 10 and torch.equal(state["w"], torch.ones(4))


def test_a_plain_dcp_step_never_stands_in_for_nbckpts_damaged_step_of_its_number(tmp_path: Path) -> None:
    """Plain DCP's step-2 beside nbckpt's step-000002 is not a copy of it: when nbckpt's is damaged
    the restore falls back to an older step, as it would without the plain one; nbckpt's is the
    step 2 listed, loaded and verified."""
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync") as ckpt:
        ckpt.save({"w": torch.full((4,), 1.0)}, step=1)
        ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
    dcp.save({"w": torch.full((4,), 7.0)}, checkpoint_id=str(run / "step-2"), no_dist=True)
    with Checkpointer(run, read_only=True) as ckpt:
        assert ckpt.steps() == [1, 2] and ckpt.verify(2)["format"] != "dcp"
        assert torch.equal(ckpt.load(2)["w"], torch.full((4,), 2.0))
    data = next((run / "step-000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    state = {"w": torch.zeros(4)}
    with (
        Checkpointer(run, read_only=True) as ckpt,
        pytest.warns(UserWarning, match="skipping step-000002: .*trying an older checkpoint"),
    ):
        assert ckpt.restore(state) == 1
    assert torch.equal(state["w"], torch.ones(4))


def _no_checksums(body: dict[str, Any]) -> None:
    for meta in body["files"].values():
        meta["blocks"] = None


def _no_metadata(body: dict[str, Any]) -> None:
    del body["files"][".metadata"]


def _not_located(body: dict[str, Any]) -> None:
    for chunks in body["items"].values():
        for chunk in chunks:
            chunk[3] = -1


@pytest.mark.parametrize("edit", [_no_checksums, _no_metadata, _not_located], ids=lambda f: f.__name__)
def test_a_resigned_manifest_cannot_take_the_paths_only_a_plain_dcp_step_takes(
    tmp_path: Path, edit: Callable[[dict[str, Any]], None]
) -> None:
    """The reader skips block checks for files without checksums, the .metadata compare for a
    manifest listing none, and reads a chunk it does not locate by loading its blob: only the
    manifest _plain_dcp makes may say so. One anyone re-signed is refused before a byte is read."""
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
    path = tmp_path / "step-000001" / "manifest.json"
    body = json.loads(path.read_text())
    edit(body)
    path.write_bytes(sign(body))
    with Checkpointer(tmp_path, read_only=True) as ckpt, pytest.raises(CheckpointError, match="manifest"):
        ckpt.verify(1)


def test_a_directory_dcp_save_wrote_is_a_run_of_one_step_for_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dcp.save(dcp_state(), checkpoint_id=tmp_path / "export-me", no_dist=True)
    assert cli(["verify", str(tmp_path / "export-me")]) == 0
    assert cli(["ls", str(tmp_path / "export-me")]) == 0
    assert "torch.distributed.checkpoint.save" in capsys.readouterr().out
    assert cli(["export", str(tmp_path / "export-me"), str(tmp_path / "out.pt")]) == 0
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    assert exported["step"] == 7 and set(exported) == {"model", "optim", "step"}


def test_a_value_that_does_not_load_with_weights_only_is_left_out_with_a_warning(tmp_path: Path) -> None:
    """torchtitan's train state holds a BytesIO; nbckpt never unpickles what weights-only refuses."""
    import io

    state = {"w": torch.ones(3), "blob": io.BytesIO(b"x")}
    dcp.save(state, checkpoint_id=tmp_path / "step-3", no_dist=True)
    with (
        Checkpointer(tmp_path, read_only=True) as ckpt,
        pytest.warns(UserWarning, match=r"left out: blob \(does not load with weights only\)"),
    ):
        loaded = ckpt.load(3)
    assert set(loaded) == {"w"} and torch.equal(loaded["w"], state["w"])  # type: ignore[arg-type]


def test_a_hostile_dcp_metadata_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "step-4").mkdir()

    class RunsCode:
        def __reduce__(self) -> tuple[object, ...]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    (tmp_path / "step-4" / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.steps() == [4]
        with pytest.raises(CheckpointError, match=r"refusing to load global builtins\.exec"):
            ckpt.load(4)
    assert not marker.exists()


def test_bytes_values_are_saved_as_bytes_and_read_by_nbckpt_and_plain_dcp(tmp_path: Path) -> None:
    """torchtitan's data loader state is ``{"dp_rank_0": pickle.dumps(state)}``: opaque bytes."""
    blob = pickle.dumps({"pos": 17})
    state = {"w": torch.ones(3), "loader": {"dp_rank_0": blob}, "raw": bytearray(b"\x00\xff")}
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(state, step=1)
        back = {"w": torch.zeros(3), "loader": {"dp_rank_0": b""}, "raw": b""}
        assert ckpt.restore(back) == 1
        assert back["loader"] == {"dp_rank_0": blob} and back["raw"] == b"\x00\xff"
        assert ckpt.load(1)["loader"]["dp_rank_0"] == blob
        assert ckpt.verify(1)["step"] == 1
    plain: dict[str, object] = {"w": torch.zeros(3), "loader": {"dp_rank_0": b""}, "raw": b""}
    dcp.load(plain, checkpoint_id=tmp_path / "step-000001", no_dist=True)
    assert plain["loader"] == {"dp_rank_0": blob} and plain["raw"] == b"\x00\xff"


class TrainState:
    """torchtitan's TrainState (a Stateful, neither module nor optimizer)."""

    def __init__(self) -> None:
        self.step, self.losses = 0, [0.0]

    def state_dict(self) -> dict[str, object]:
        return {"step": self.step, "global_avg_losses": self.losses}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.step, self.losses = state["step"], state["global_avg_losses"]  # type: ignore[assignment]


class Loader:
    """torchtitan's ParallelAwareDataloader: its state is this rank's pickled loader state."""

    def __init__(self) -> None:
        self.pos = 0

    def state_dict(self) -> dict[str, bytes]:
        return {"dp_rank_0": pickle.dumps({"pos": self.pos})}

    def load_state_dict(self, state: dict[str, bytes]) -> None:
        self.pos = pickle.loads(state["dp_rank_0"])["pos"]  # the test's own bytes


def titan_objects() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda n: 0.5**n)
    return {
        "model": model,
        "optimizer": optim,
        "lr_scheduler": sched,
        "train_state": TrainState(),
        "dataloader": Loader(),
    }


def test_a_torchtitan_shaped_dcp_step_is_restored_completely(tmp_path: Path) -> None:
    """model, optimizer, LR scheduler, train state and a bytes data loader state, as torchtitan's
    CheckpointManager saves them (dcp.save of Stateful objects), each restored through its own
    load_state_dict (before: every object but the model and optimizer replaced by a dict)."""
    saved = titan_objects()
    model, optim, sched = saved["model"], saved["optimizer"], saved["lr_scheduler"]
    for _ in range(3):
        model(torch.randn(2, 6)).sum().backward()  # type: ignore[operator]
        optim.step()  # type: ignore[attr-defined]
        sched.step()  # type: ignore[attr-defined]
    saved["train_state"].step, saved["dataloader"].pos = 3, 96  # type: ignore[attr-defined]
    dcp.save(saved, checkpoint_id=tmp_path / "step-3", no_dist=True)
    state = titan_objects()
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.restore(state) == 3
    assert torch.equal(state["model"].weight, model.weight)  # type: ignore[attr-defined]
    assert state["optimizer"].param_groups[0]["lr"] == 0.01 * 0.5**3  # type: ignore[attr-defined]
    assert isinstance(state["lr_scheduler"], torch.optim.lr_scheduler.LambdaLR)
    assert state["lr_scheduler"].last_epoch == 3
    assert isinstance(state["train_state"], TrainState) and state["train_state"].step == 3
    assert isinstance(state["dataloader"], Loader) and state["dataloader"].pos == 96


def test_a_stateful_object_the_step_holds_no_state_for_is_refused_naming_it(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2), "train_state": 5}, checkpoint_id=tmp_path / "step-1", no_dist=True)
    state = {"w": torch.zeros(2), "train_state": TrainState()}
    with (
        Checkpointer(tmp_path, read_only=True) as ckpt,
        pytest.raises(ConfigError, match="train_state is a TrainState, the checkpoint holds a value"),
    ):
        ckpt.restore(state)
    assert isinstance(state["train_state"], TrainState) and torch.equal(state["w"], torch.zeros(2))


# torchtitan's step discovery, as CheckpointManager does it in pytorch/torchtitan
# torchtitan/components/checkpointer/dcp.py (_find_load_step, _create_checkpoint_id and
# _purge_stale_checkpoints; main at b5bcd76, the same logic as 0.2.2's components/checkpoint.py):
# any entry whose name contains step-<digits> and holds a .metadata is that step, opened as
# folder/step-<int>; keep_latest_k deletes every entry matching step-<digits> but the newest k.
def titan_find_load_step(folder: Path) -> int:
    steps = []
    for filename in os.listdir(folder):
        match = re.search(r"step-(\d+)", filename)
        if match and os.path.isfile(os.path.join(folder, filename, ".metadata")):
            steps.append(int(match.group(1)))
    return max(steps) if steps else -1


def titan_checkpoint_id(folder: Path, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def titan_purged(folder: Path, keep_latest_k: int) -> list[str]:
    found = [(int(m.group(1)), n) for n in os.listdir(folder) if (m := re.search(r"step-(\d+)", n))]
    return [name for _, name in sorted(found)[:-keep_latest_k]]


def test_torchtitan_and_nbckpt_share_a_checkpoint_folder_through_a_subfolder(tmp_path: Path) -> None:
    """torchtitan's finder matched nbckpt's step-000008 and opened step-8: nbckpt's steps go to a
    subfolder torchtitan never lists, and opening its folder itself for saving says so."""
    titan = tmp_path / "checkpoint"
    dcp.save(dcp_state(), checkpoint_id=titan / "step-3", no_dist=True)
    dcp.save(dcp_state(), checkpoint_id=titan / "step-6", no_dist=True)
    fresh = {"model": torch.nn.Linear(6, 4), "step": 0}
    with Checkpointer(titan, read_only=True) as old:  # the run moves to nbckpt at torchtitan's step 6
        assert old.restore(fresh) == 6
    with Checkpointer(titan / "nbckpt", mode="sync") as ckpt:
        ckpt.save({**fresh, "step": 8}, step=8)
        ckpt.save({**fresh, "step": 9}, step=9)
    assert titan_find_load_step(titan) == 6 and os.path.isdir(titan_checkpoint_id(titan, 6))
    assert titan_purged(titan, 1) == ["step-3"]  # never nbckpt's folder
    with pytest.warns(UserWarning, match=r"\(step-3, step-6\); torchtitan reads .* in a subfolder"):
        shared = Checkpointer(titan, mode="sync")
    with shared:
        shared.save({**fresh, "step": 8}, step=8)
    # what the warning is about: torchtitan now picks nbckpt's step 8 and opens a folder not there
    assert titan_find_load_step(titan) == 8 and not os.path.isdir(titan_checkpoint_id(titan, 8))
