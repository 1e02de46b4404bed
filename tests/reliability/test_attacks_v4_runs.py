"""Reliability v4 (issue 34), runs and their folders: the Hugging Face callback never removes a
folder it did not make (4); a rewind past a plain-DCP step starts a new line, and a path naming a
plain-DCP folder reads that folder (8d); a rank's restore template naming a key no step holds is
named, rank and key, on every rank (8e, in tests/engine/test_sharded.py with 8c)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbckpt import Checkpointer, ConfigError
from nbckpt.cli import main as cli
from nbckpt.integrations import load


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- 4: resume_checkpoint(folder=...) --------------------------------------------------------


def test_resume_checkpoint_never_removes_a_folder_nbckpt_did_not_make(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from integrations.hf_app import digest, train

    from nbckpt.integrations.hf import RESUME_MARKER, NbckptCallback

    out = tmp_path / "out"  # the Trainer's output_dir, holding the nbckpt run and a file of the user's
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    first = NbckptCallback(out / "nbckpt")
    train(out, [first], stop_at=6)
    first.close()
    before = _files(out)
    assert any(name.startswith("nbckpt/step-000004/") for name in before)

    second = NbckptCallback(out / "nbckpt")
    with pytest.raises(ConfigError, match=r"holds the nbckpt run") as refused:
        second.resume_checkpoint(folder=out)
    assert "\n" not in str(refused.value)
    elsewhere = tmp_path / "other"  # a folder of the user's, not holding the run: refused too
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_bytes(b"\x01\x02")
    with pytest.raises(ConfigError, match=rf"not a folder nbckpt made \(no {RESUME_MARKER}"):
        second.resume_checkpoint(folder=elsewhere)
    with pytest.raises(ConfigError, match=r"is inside the nbckpt run"):
        second.resume_checkpoint(folder=out / "nbckpt" / "resume")
    assert _files(out) == before
    assert _files(elsewhere) == {"data.bin": b"\x01\x02"}

    # A folder nbckpt makes: the Trainer resumes from it, then it is gone and nothing else is.
    folder = second.resume_checkpoint(folder=out / "resume")
    assert folder == str(out / "resume" / "checkpoint-4")
    resumed = train(out, [second], resume=folder)
    second.close()
    assert resumed.state.global_step == 12
    assert not (out / "resume").exists()
    after = _files(out)
    assert {name: after.get(name) for name in before if not name.startswith("nbckpt/")} == {
        name: data for name, data in before.items() if not name.startswith("nbckpt/")
    }
    with Checkpointer(out / "nbckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [4, 8, 12]
        assert digest(ckpt.load(12)["model"]) == digest(resumed.model)

    # An older folder of nbckpt's is replaced, but not once something of the user's is in it.
    third = NbckptCallback(out / "nbckpt")
    again = third.resume_checkpoint(folder=out / "resume")
    assert again is not None and (out / "resume" / RESUME_MARKER).is_file()
    (out / "resume" / "mine.txt").write_text("put here by the user")
    with pytest.raises(ConfigError, match=r"holds 'mine.txt', which nbckpt did not write"):
        third.resume_checkpoint(folder=out / "resume")
    assert (out / "resume" / "mine.txt").read_text() == "put here by the user"
    third.close()


# -- 8d: plain-DCP steps in a run ------------------------------------------------------------


def test_a_rewind_below_a_plain_dcp_step_sets_it_aside_too(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync") as ckpt:
        ckpt.save({"w": torch.full((4,), 1.0)}, step=1)
    dcp.save({"w": torch.full((4,), 9.0)}, checkpoint_id=str(run / "step-9"), no_dist=True)
    with pytest.warns(UserWarning, match="torchtitan reads"):
        ckpt = Checkpointer(run, mode="sync")
    with ckpt:
        state = {"w": torch.zeros(4)}
        assert ckpt.restore(state, step=1) == 1
        with pytest.warns(UserWarning, match="set aside, still restorable, in .*set-aside-1"):
            ckpt.save({"w": torch.full((4,), 2.0)}, step=2)
        ckpt.save({"w": torch.full((4,), 3.0)}, step=3)
        assert ckpt.restore(state) == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    with Checkpointer(run, mode="sync") as ckpt:  # no plain-DCP folder left beside nbckpt's steps
        assert ckpt.restore(state) == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    # the plain-DCP step moved whole (never deleted): it loads from the set-aside run
    assert (run / "set-aside-1" / "step-9" / ".metadata").is_file()
    with Checkpointer(run / "set-aside-1", read_only=True) as reader:
        assert reader.restore(state) == 9 and torch.equal(state["w"], torch.full((4,), 9.0))


def test_a_path_naming_a_plain_dcp_folder_reads_that_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync") as ckpt:
        ckpt.save({"w": torch.full((4,), 2.0)}, step=2)  # step-000002
    dcp.save({"w": torch.full((4,), 7.0)}, checkpoint_id=str(run / "step-2"), no_dist=True)
    assert torch.equal(load(run / "step-2")["w"], torch.full((4,), 7.0))
    assert torch.equal(load(run / "step-000002")["w"], torch.full((4,), 2.0))
    assert cli(["export", str(run / "step-2"), str(tmp_path / "out.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.full((4,), 7.0))
    # a name that is not nbckpt's spelling of a step, without .metadata, names no step at all
    (run / "step-02").mkdir()
    with pytest.raises(ConfigError, match="step-02"):
        load(run / "step-02")
