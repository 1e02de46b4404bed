"""Reliability v4 (issue 34), runs and their folders: the Hugging Face callback never removes a
folder it did not make (4); a rewind past a plain-DCP step starts a new line, and a path naming a
plain-DCP folder reads that folder (8d); a rank's restore template naming a key no step holds is
named, rank and key, on every rank (8e, in tests/engine/test_sharded.py with 8c)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbckpt import Checkpointer, ConfigError


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
