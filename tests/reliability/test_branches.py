"""Reliability v3, the runs set aside inside a run (an earlier release's ``branch-N`` folders
too): one that is a symlink is never followed out of the run (item 4), and leftovers inside one
are cleaned up with the warning any run gets when it is opened (item 19). Each test failed before
the fix."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.states import assert_holds, state_of

from nbckpt import Checkpointer


def snapshot(directory: Path) -> dict[str, list[str]]:
    """Every entry under ``directory``, folder by folder (to prove nothing there changed)."""
    return {
        str(Path(root).relative_to(directory)): sorted(dirs + files)
        for root, dirs, files in os.walk(directory)
    }


def test_item04_a_set_aside_run_that_is_a_symlink_is_never_followed_out_of_the_run(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    with Checkpointer(run) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(state_of(step), step=step).wait()
    # Outside the run: what looks like runs set aside in it (this release's and an earlier one's).
    with Checkpointer(elsewhere) as other:
        other.save(state_of(25), step=25).wait()
    (elsewhere / "branch.json").write_text(json.dumps({"parent": "main", "from_step": 20, "created": 0}))
    (elsewhere / "set-aside.json").write_text(json.dumps({"after_step": 20, "steps": [], "created": 0}))
    (elsewhere / ".tmp-step-000026-0abc").mkdir()
    for name in ("branch-1", "set-aside-1"):
        (run / name).symlink_to(elsewhere, target_is_directory=True)
    before = snapshot(elsewhere)

    with Checkpointer(run) as ckpt:
        assert ckpt.set_aside_runs() == []
        assert ckpt.restore(state_of(0)) == 30  # not the newer step behind the link
        assert_holds(ckpt, 20)  # an older step: the next save sets 30 aside, past the links
        with pytest.warns(UserWarning, match=r"set aside, still restorable, in .*set-aside-2"):
            ckpt.save(state_of(21), step=21).wait()
        assert ckpt.steps() == [10, 20, 21]
    assert snapshot(elsewhere) == before  # nothing read, written or deleted there
    assert (run / "set-aside-2" / "step-000030" / "manifest.json").is_file()


def test_item19_leftovers_in_a_set_aside_run_are_cleaned_up_with_a_warning(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run) as ckpt:
        for step in (10, 20):
            ckpt.save(state_of(step), step=step).wait()
        assert_holds(ckpt, 10)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state_of(15), step=15).wait()
    aside = run / "set-aside-1"
    leftovers = [".tmp-step-000021-0abc", ".trash-step-000012-0abc"]
    for name in leftovers:
        (aside / name).mkdir()
    said = f"cleaned up 2 leftover(s) of interrupted saves in {aside}: {', '.join(leftovers)}"
    with pytest.warns(UserWarning, match=re.escape(said)):
        ckpt = Checkpointer(aside)  # a set-aside run opens as any run
    with ckpt:
        assert_holds(ckpt, 20)
    assert sorted(os.listdir(aside)) == [".nbckpt.lock", "set-aside.json", "step-000020"]
