"""A stray save (issue 22, item 3): a state of other names than the run's newest step, or with no
tensor, is said before it commits; retention keeps the newest ``keep`` of each set of names, so it
never rotates the run's model checkpoints out; restore takes the newest step that holds the
names it is asked for, and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nbckpt import Checkpointer, ConfigError


def model_state(step: int) -> dict[str, torch.Tensor]:
    return {"model": torch.full((4,), float(step)), "opt": torch.full((2,), float(step))}


def test_a_stray_save_is_said_and_never_rotates_the_model_out(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, mode="sync", keep=3) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(model_state(step), step=step)
        with pytest.warns(
            UserWarning,
            match=r"step 40 holds 'x', the newest step \(30\) holds 'model', 'opt'; "
            r"retention keeps the newest 3 of each",
        ):
            ckpt.save({"x": torch.ones(1)}, step=40)
        for step in (50, 60, 70):
            ckpt.save({"x": torch.ones(1)}, step=step)
        ckpt.wait()
        assert ckpt.steps() == [10, 20, 30, 50, 60, 70]  # before: 50, 60, 70 only

        state = {"model": torch.zeros(4), "opt": torch.zeros(2)}
        with pytest.warns(
            UserWarning, match=r"restored step 30, the newest holding 'model', 'opt' \(step 70 holds 'x'\)"
        ):
            assert ckpt.restore(state) == 30
        assert torch.equal(state["model"], model_state(30)["model"])
        with pytest.raises(
            ConfigError, match=r"no step in .* holds 'modle' \(the newest, step 70, holds 'x'\)"
        ):
            ckpt.restore({"modle": torch.zeros(4)})


def test_a_state_without_a_tensor_is_said(tmp_path: Path) -> None:
    with (
        Checkpointer(tmp_path, mode="sync") as ckpt,
        pytest.warns(UserWarning, match=r"step 1 holds no tensor \('device', 'width'\)"),
    ):
        ckpt.save({"width": 3, "device": "cpu"}, step=1)


def test_a_re_save_keeps_keep_steps(tmp_path: Path) -> None:
    """Found on the network mount: a re-save counted its own step twice, leaving keep - 1."""
    with Checkpointer(tmp_path, mode="sync", keep=2) as ckpt:
        for step in (3, 4):
            ckpt.save(model_state(step), step=step)
        ckpt.save(model_state(4), step=4, overwrite=True)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]
