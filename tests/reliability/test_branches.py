"""Reliability v3, the lines of a run: a ``branch-N`` that is a symlink is never followed out of the
run (item 4), and leftovers inside a branch are cleaned up with the warning the main directory
gets (item 19). Each test failed before the fix."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.states import assert_holds, state_of

from nbckpt import Checkpointer, ConfigError


def snapshot(directory: Path) -> dict[str, list[str]]:
    """Every entry under ``directory``, folder by folder (to prove nothing there changed)."""
    return {
        str(Path(root).relative_to(directory)): sorted(dirs + files)
        for root, dirs, files in os.walk(directory)
    }


def test_item04_a_branch_that_is_a_symlink_is_never_followed_out_of_the_run(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    with Checkpointer(run) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(state_of(step), step=step).wait()
    # Outside the run: what looks like a branch of it, newer than main, with a leftover look-alike.
    with Checkpointer(elsewhere) as other:
        other.save(state_of(25), step=25).wait()
    (elsewhere / "branch.json").write_text(json.dumps({"parent": "main", "from_step": 20, "created": 0}))
    (elsewhere / ".tmp-step-000026-0abc").mkdir()
    (run / "branch-1").symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(elsewhere)

    with Checkpointer(run) as ckpt:
        assert ckpt.line_name == "main" and "branch-1" not in ckpt.lines()
        assert ckpt.restore(state_of(0)) == 30  # not the newer step behind the link
        assert_holds(ckpt, 20)  # an older step: the next save goes on in a new line
        with pytest.warns(UserWarning, match=r"saves now go to a new line, branch-2 "):
            ckpt.save(state_of(21), step=21).wait()
        assert ckpt.steps() == [10, 20, 21]
    with pytest.raises(ConfigError, match="the run has no line 'branch-1'"):
        Checkpointer(run, line="branch-1", read_only=True)
    assert snapshot(elsewhere) == before  # nothing read, written or deleted there
    assert (run / "branch-2" / "step-000021" / "manifest.json").is_file()


def test_item19_leftovers_in_a_branch_are_cleaned_up_with_a_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        for step in (10, 20):
            ckpt.save(state_of(step), step=step).wait()
        assert_holds(ckpt, 10)
        with pytest.warns(UserWarning, match="branch-1"):
            ckpt.save(state_of(15), step=15).wait()
    branch = run / "branch-1"
    leftovers = [".tmp-step-000016-0abc", ".trash-step-000012-0abc"]
    for name in leftovers:
        (branch / name).mkdir()
    said = f"cleaned up 2 leftover(s) of interrupted saves in {branch}: {', '.join(leftovers)}"
    with pytest.warns(UserWarning, match=re.escape(said)):
        ckpt = Checkpointer(run)
    with ckpt:
        assert ckpt.line_name == "branch-1"
        assert_holds(ckpt, 15)
    assert sorted(os.listdir(branch)) == ["branch.json", "step-000015"]
