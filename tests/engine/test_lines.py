"""Lines of a run: training on from an older step goes on in a branch, and "newest" stays right."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from nbckpt import Checkpointer


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step)), "step": step}


def restored(ckpt: Checkpointer, step: int | None = None) -> int:
    state: dict[str, Any] = {"w": torch.zeros(8), "step": -1}
    got = ckpt.restore(state, step=step)
    assert state["step"] == got and torch.equal(state["w"], state_of(got)["w"])
    return got


def test_saving_after_a_rewind_goes_on_in_a_branch(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (10, 20, 30, 100):
            ckpt.save(state_of(step), step=step)
        assert restored(ckpt, step=20) == 20
        with pytest.warns(UserWarning, match=r"saves now go to a new line, branch-1 .*newer steps stay"):
            ckpt.save(state_of(25), step=25).wait()
        ckpt.save(state_of(30), step=30).wait()  # no clash with main's step 30, no warning
        assert ckpt.steps() == [10, 20, 25, 30]  # main's steps after 20 are not this line's
        assert restored(ckpt) == 30 and ckpt.load()["w"][0] == 30.0
        lines = ckpt.lines()
        assert lines["branch-1"] == {"parent": "main", "from_step": 20, "steps": [25, 30], "current": True}
        assert lines["main"]["steps"] == [10, 20, 30, 100] and not lines["main"]["current"]
    assert sorted(os.listdir(tmp_path / "branch-1")) == ["branch.json", "step-000025", "step-000030"]


def test_a_reopened_run_goes_on_in_the_line_committed_to_last(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(state_of(step), step=step)
        restored(ckpt, step=10)
        with pytest.warns(UserWarning, match="branch-1"):
            ckpt.save(state_of(15), step=15).wait()
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.line_name == "branch-1" and restored(ckpt) == 15
    with Checkpointer(tmp_path, line="main") as ckpt:
        assert restored(ckpt) == 30


def test_branches_of_branches_and_retention_within_a_line(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_of(step), step=step)
        restored(ckpt, step=2)
        with pytest.warns(UserWarning, match="branch-1"):
            ckpt.save(state_of(10), step=10)
        for step in (11, 12):
            ckpt.save(state_of(step), step=step)
        ckpt.wait()
        assert ckpt.lines()["branch-1"]["steps"] == [11, 12]  # keep=2, within the branch only
        assert ckpt.lines()["main"]["steps"] == [2, 3]
        restored(ckpt, step=11)
        with pytest.warns(UserWarning, match="branch-2"):
            ckpt.save(state_of(20), step=20).wait()
        assert ckpt.lines()["branch-2"]["parent"] == "branch-1" and ckpt.steps() == [2, 11, 20]


def test_restoring_the_newest_step_or_reading_never_branches(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(state_of(step), step=step)
        restored(ckpt)
        ckpt.save(state_of(3), step=3).wait()
    with Checkpointer(tmp_path, read_only=True) as reader:
        restored(reader, step=1)
    assert sorted(os.listdir(tmp_path)) == [".nbckpt.lock", "step-000001", "step-000002", "step-000003"]


@pytest.mark.timeout(60)
def test_a_cycle_of_branch_records_ends_the_walk_instead_of_hanging(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_of(step), step=step)
        restored(ckpt, step=2)
        with pytest.warns(UserWarning, match="branch-1"):
            ckpt.save(state_of(10), step=10)
        ckpt.save(state_of(11), step=11).wait()
        restored(ckpt, step=10)
        with pytest.warns(UserWarning, match="branch-2"):
            ckpt.save(state_of(20), step=20).wait()
    # a hand-edited (or damaged) record makes branch-1 the child of its own child
    (tmp_path / "branch-1" / "branch.json").write_text(json.dumps({"parent": "branch-2", "from_step": 20}))
    with Checkpointer(tmp_path, line="branch-2", read_only=True) as reader:
        assert reader.steps() == [10, 20]  # its own steps, then branch-1's up to the fork; no loop
        assert restored(reader) == 20 and restored(reader, step=10) == 10
