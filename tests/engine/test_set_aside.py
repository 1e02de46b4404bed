"""Steps set aside after a rewind: the first save after restoring an older step moves the newer
steps into a run of their own inside the run's directory, restorable from there bit for bit; the
step number is the only identifier a user needs, and "newest" never picks a step set aside, also
after a crash at any point of the move. Runs an earlier release left with ``branch-N`` folders
stay restorable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.finetune import setup, snapshot, tune

from nbckpt import Checkpointer, CheckpointError, ConfigError
from nbckpt.engine._faults import armed


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((8,), float(step)), "step": step}


def restored(ckpt: Checkpointer, step: int | None = None) -> int:
    state: dict[str, Any] = {"w": torch.zeros(8), "step": -1}
    got = ckpt.restore(state, step=step)
    assert state["step"] == got and torch.equal(state["w"], state_of(got)["w"])
    return got


def saved(directory: Path, steps: tuple[int, ...], **options: Any) -> Checkpointer:
    ckpt = Checkpointer(directory, mode="sync", **options)
    for step in steps:
        ckpt.save(state_of(step), step=step)
    return ckpt


def test_saving_after_a_rewind_sets_the_newer_steps_aside_where_they_restore(tmp_path: Path) -> None:
    with saved(tmp_path, (10, 20, 30, 100)) as ckpt:
        assert restored(ckpt, step=20) == 20
        with pytest.warns(UserWarning, match=r"newer steps exist; those are set aside, .*set-aside-1"):
            ckpt.save(state_of(25), step=25).wait()
        ckpt.save(state_of(30), step=30).wait()  # a step number set aside is free again
        assert ckpt.steps() == [10, 20, 25, 30] and ckpt.latest_step() == 30
        assert restored(ckpt) == 30 and ckpt.load()["w"][0] == 30.0
        aside = ckpt.set_aside_runs()
    assert aside == [
        {
            "name": "set-aside-1",
            "path": str(tmp_path / "set-aside-1"),
            "after": 20,
            "steps": [30, 100],
            "earlier_release": False,
        }
    ]
    names = sorted(os.listdir(tmp_path / "set-aside-1"))
    assert names == ["set-aside.json", "step-000030", "step-000100"]
    with Checkpointer(tmp_path / "set-aside-1", read_only=True) as reader:  # a run like any other
        assert reader.steps() == [30, 100] and restored(reader) == 100 and restored(reader, 30) == 30
        reader.verify(30)
    with Checkpointer(tmp_path) as ckpt:  # reopened: the run's newest, never one set aside
        assert restored(ckpt) == 30 and ckpt.steps() == [10, 20, 25, 30]


def test_a_second_rewind_sets_aside_again_and_restoring_the_newest_never_does(tmp_path: Path) -> None:
    with saved(tmp_path, (1, 2, 3)) as ckpt:
        restored(ckpt)  # the newest: nothing to set aside
        ckpt.save(state_of(4), step=4)
        restored(ckpt, step=2)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state_of(5), step=5)
        restored(ckpt, step=1)
        with pytest.warns(UserWarning, match="set-aside-2"):
            ckpt.save(state_of(6), step=6)
        assert ckpt.steps() == [1, 6]
        assert [(e["name"], e["after"], e["steps"]) for e in ckpt.set_aside_runs()] == [
            ("set-aside-1", 2, [3, 4]),
            ("set-aside-2", 1, [2, 5]),
        ]
    with Checkpointer(tmp_path, read_only=True) as reader:  # reading never moves anything
        restored(reader, step=1)
    assert sorted(os.listdir(tmp_path)) == [
        ".nbckpt.lock",
        "set-aside-1",
        "set-aside-2",
        "step-000001",
        "step-000006",
    ]


def test_retention_keeps_to_the_runs_own_steps_and_never_deletes_a_step_set_aside(tmp_path: Path) -> None:
    with saved(tmp_path, (1, 2, 3), keep=2) as ckpt:
        restored(ckpt, step=2)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state_of(10), step=10)
        for step in (11, 12):
            ckpt.save(state_of(step), step=step)
        ckpt.wait()
        assert ckpt.steps() == [11, 12] and ckpt.set_aside_runs()[0]["steps"] == [3]


def test_incremental_steps_set_aside_stay_whole(tmp_path: Path) -> None:
    """An incremental step shares files with the step before (hard links): set aside, each step
    still verifies every block and restores bit for bit, in the set-aside run and in the run."""
    model, optim, state = setup()
    expected = {}
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        for step in range(1, 5):
            tune(model, optim, step)
            state["step"] = step
            ckpt.save(state, step=step)
            expected[step] = snapshot(state)
        shared = [p for p in (tmp_path / "step-000004").iterdir() if p.stat().st_nlink > 1]
        assert shared  # the test means something: step 4 shares files with step 3
        ckpt.restore(state, step=2)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state, step=5)
        expected[5] = snapshot(state)
    for directory, steps in ((tmp_path, [1, 2, 5]), (tmp_path / "set-aside-1", [3, 4])):
        with Checkpointer(directory, read_only=True) as reader:
            assert reader.steps() == steps
            for step in steps:
                reader.verify(step)
                fresh_model, fresh_optim, fresh = setup(seed=9)
                tune(fresh_model, fresh_optim, 0)
                reader.restore(fresh, step=step)
                got = snapshot(fresh)
                assert got.keys() == expected[step].keys()
                assert all(torch.equal(got[k], expected[step][k]) for k in got), step


def test_the_line_option_is_gone_with_a_pointer_to_the_new_way(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"line= is gone: .*set aside as a run of their own"):
        Checkpointer(tmp_path, line="branch-1")


def test_a_run_an_earlier_release_branched_stays_restorable_step_by_step(tmp_path: Path) -> None:
    """The layout an earlier nbckpt wrote: steps 10, 20, 30 in the run, then (after restoring 20)
    ``branch-1/`` with ``branch.json`` and its steps 25, 26. Every step restores from where it is;
    the run warns that it went on in the branch, which is listed like a set-aside run."""
    saved(tmp_path, (10, 20, 30)).close()
    saved(tmp_path / "branch-1", (25, 26)).close()
    os.remove(tmp_path / "branch-1" / ".nbckpt.lock")
    record = {"parent": "main", "from_step": 20, "created": 0.0}
    (tmp_path / "branch-1" / "branch.json").write_text(json.dumps(record))
    with pytest.warns(UserWarning, match=r"went on in .*branch-1 \(a branch an earlier nbckpt started\)"):
        ckpt = Checkpointer(tmp_path)
    with ckpt:
        assert ckpt.steps() == [10, 20, 30] and restored(ckpt, step=20) == 20
        [entry] = ckpt.set_aside_runs()
        assert entry == {
            "name": "branch-1",
            "path": str(tmp_path / "branch-1"),
            "after": 20,
            "steps": [25, 26],
            "earlier_release": True,
        }
    with Checkpointer(entry["path"], read_only=True) as reader:
        assert [restored(reader, step) for step in (25, 26)] == [25, 26] and restored(reader) == 26


CHILD = """
import sys, torch
from nbckpt import Checkpointer
from nbckpt.engine._store import arm_crash
point, directory, mirror = sys.argv[1], sys.argv[2], (sys.argv[3:] or [None])[0]
ckpt = Checkpointer(directory, mode="sync", mirror=mirror)
for step in (10, 20, 30, 40):
    ckpt.save({"w": torch.full((8,), float(step)), "step": step}, step=step)
ckpt.wait()  # every step is on the mirror too
ckpt.restore({"w": torch.zeros(8), "step": 0}, step=20)
arm_crash(point)
ckpt.save({"w": torch.full((8,), 25.0), "step": 25}, step=25)
print("not killed")
"""


def killed_child(script: str, *args: str) -> None:
    """Run ``script`` in a process of its own, which a crash point armed there kills."""
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert child.returncode == -9, child.stderr


def killed_at(point: str, *directories: Path) -> None:
    """CHILD run on ``directories`` (the run, the mirror), killed at ``point``."""
    killed_child(CHILD, point, *map(str, directories))


def upload_holder() -> tuple[threading.Event, threading.Event, Callable[[str, str], None]]:
    """A ``mirror.upload`` seam action holding each upload until ``release`` is set; ``entered``
    is set once one is held."""
    entered, release = threading.Event(), threading.Event()

    def held(location: str, name: str) -> None:
        entered.set()
        assert release.wait(60), "the test never released the uploads"

    return entered, release, held


def rewind_behind_a_held_upload(ckpt: Checkpointer, entered: threading.Event, held: int, then: int) -> None:
    """Save ``held`` (its upload held), then ``then`` (its upload waits behind it), and restore 20."""
    ckpt.save(state_of(held), step=held)
    assert entered.wait(60)
    ckpt.save(state_of(then), step=then)
    restored(ckpt, 20)


@pytest.mark.parametrize("point", ["set_aside_intent", "set_aside_moving", "set_aside_moved"])
def test_a_kill_at_any_point_of_a_set_aside_leaves_every_step_restorable_exactly_once(
    tmp_path: Path, point: str
) -> None:
    """Killed with its intent written, after the first step moved, and with every step moved but
    the intent still there: a reader sees none of the steps being moved as the run's, the next
    writable open finishes the move, and each of 10, 20, 30, 40 restores from one place only."""
    run = tmp_path / "run"
    killed_at(point, run)
    assert (run / ".set-aside-intent.json").is_file()
    with Checkpointer(run, read_only=True) as reader:  # nothing finished it: its steps are hidden
        assert reader.steps() == [10, 20] and restored(reader) == 20
    with pytest.warns(UserWarning, match="finished setting steps aside into .*set-aside-1"):
        ckpt = Checkpointer(run)
    with ckpt:
        assert ckpt.steps() == [10, 20] and restored(ckpt) == 20
        assert [(e["name"], e["after"], e["steps"]) for e in ckpt.set_aside_runs()] == [
            ("set-aside-1", 20, [30, 40])
        ]
    assert not (run / ".set-aside-intent.json").exists()
    with Checkpointer(run / "set-aside-1", read_only=True) as reader:
        assert [restored(reader, step) for step in (30, 40)] == [30, 40]


def test_a_kill_as_a_small_file_is_replaced_leaves_nothing_once_the_run_is_opened_to_write(
    tmp_path: Path,
) -> None:
    """Killed as it wrote the set-aside intent (the file made, not yet renamed over its name):
    the next writable open removes what it left, saying so, as it does a save's (before: only
    ``.tmp-step-`` names went, and ``.tmp-.set-aside-intent.json-<hex>`` stayed for ever). A reader
    leaves it, and so does a second writer the lock refuses (it could be the writer's own, under
    way); the set-aside never began, so every step is where it was."""
    run = tmp_path / "run"
    killed_at("small_write", run)
    left = [name for name in os.listdir(run) if name.startswith(".tmp-")]
    assert len(left) == 1 and left[0].startswith(".tmp-.set-aside-intent.json-"), left
    with Checkpointer(run, read_only=True) as reader:
        assert reader.steps() == [10, 20, 30, 40]
    assert (run / left[0]).is_file()
    with pytest.warns(UserWarning, match=f"cleaned up 1 leftover.*: {left[0]}$"):
        ckpt = Checkpointer(run)
    with ckpt:
        assert ckpt.steps() == [10, 20, 30, 40] and restored(ckpt) == 40
        (run / left[0]).write_bytes(b"{")  # as this writer's own would be, half written
        with pytest.raises(CheckpointError, match="in use by another Checkpointer"):
            Checkpointer(run)
        assert (run / left[0]).is_file()
    assert sorted(os.listdir(run)) == [".nbckpt.lock", left[0], *(f"step-0000{s}" for s in (10, 20, 30, 40))]


def test_killed_while_the_run_sets_steps_aside_none_of_them_is_the_newest_on_the_mirror(
    tmp_path: Path,
) -> None:
    """Killed while the run's own steps move, its mirror holding copies of them: the mirror's
    intent was written only after the run's steps had moved, so the next open (and a reader)
    restored the mirror's copy of the set-aside step 40 as the newest instead of 20."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    killed_at("set_aside_moving", run, mirror)
    with Checkpointer(run, read_only=True, mirror=str(mirror)) as reader:
        assert restored(reader) == 20
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the finished set-aside is said in a warning
        ckpt = Checkpointer(run, mirror=str(mirror))
    with ckpt:
        assert restored(ckpt) == 20 and ckpt.steps() == [10, 20]
    assert sorted(p.name for p in mirror.glob("step-*")) == ["step-000010", "step-000020"]


def test_a_step_set_aside_and_saved_again_while_its_upload_waits_is_the_mirrors_newest(
    tmp_path: Path,
) -> None:
    """Step 30's upload still waits when 20 is restored and 30 saved again: the new 30 took the
    waiting upload's place in the mirror's queue, before the mirror's set-aside, which then moved
    it aside there as the old 30 (the mirror's root lost the run's newest step). Step 21, set
    aside as it went up, failed its upload and was missing from the mirror's set-aside run."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    entered, release, held = upload_holder()

    again = {"w": torch.full((8,), 300.0), "step": 30}
    with armed("mirror.upload", held), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the set-aside is said in a warning
        ckpt = Checkpointer(run, mode="sync", mirror=str(mirror))
        try:
            rewind_behind_a_held_upload(ckpt, entered, 21, 30)
            ckpt.save(again, step=30)  # 21 and the first 30 set aside; the new 30 goes up
        finally:
            release.set()
        ckpt.close()
    with Checkpointer(mirror, read_only=True) as reader:
        state: dict[str, Any] = {"w": torch.zeros(8), "step": -1}
        assert reader.restore(state) == 30 and torch.equal(state["w"], again["w"])
    with Checkpointer(mirror / "set-aside-1", read_only=True) as reader:
        assert reader.steps() == [21, 30] and restored(reader, 30) == 30  # the first 30


@pytest.mark.parametrize("refusals", [1, 2])
def test_a_set_aside_the_mirror_refused_is_done_before_the_next_upload(tmp_path: Path, refusals: int) -> None:
    """The mirror's set-aside failed once (an I/O error): the step saved again after the rewind
    went up under the name the mirror's intent still listed, so a reader hid it, and with the
    local disk lost the next open moved it aside there and restored 20, not the new 30. Refused
    again when tried before that upload, the upload waits for the run's next open."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20, 30), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    refused: list[str] = []

    def refuse(path: str) -> None:
        if Path(path) == mirror / "set-aside-1" and len(refused) < refusals:
            refused.append(path)
            raise OSError(5, "Input/output error", path)

    again = {"w": torch.full((8,), 300.0), "step": 30}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the set-aside and the mirror's failures are said in warnings
        with Checkpointer(run, mode="sync", mirror=str(mirror)) as ckpt, armed("dir.fsync", refuse):
            restored(ckpt, 20)
            ckpt.save(again, step=30)
            ckpt.wait()  # the mirror's thread too
        assert len(refused) == refusals
        with Checkpointer(mirror, read_only=True) as reader:
            assert reader.steps() == [10, 20, 30][: 4 - refusals]  # the new 30, or none yet
        Checkpointer(run, mirror=str(mirror)).close()  # a reopened run uploads what the mirror lacks
        with Checkpointer(mirror, read_only=True) as reader:
            assert reader.steps() == [10, 20, 30]
        shutil.rmtree(run)  # the local disk is lost
        with Checkpointer(run, mirror=str(mirror)) as ckpt:
            state: dict[str, Any] = {"w": torch.zeros(8), "step": -1}
            assert ckpt.restore(state) == 30 and torch.equal(state["w"], again["w"])
    with Checkpointer(mirror / "set-aside-1", read_only=True) as reader:
        assert restored(reader) == 30  # the first 30


def test_with_a_mirror_the_steps_are_set_aside_there_too_and_a_lost_disk_resumes_right(
    tmp_path: Path,
) -> None:
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20, 30), mirror=str(mirror)) as ckpt:
        ckpt.wait()
        restored(ckpt, step=20)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save(state_of(25), step=25)
        assert restored(ckpt) == 25  # the mirror's step 30 is not the newest, moved yet or not
        ckpt.wait()
    assert sorted(p.name for p in mirror.glob("step-*")) == ["step-000010", "step-000020", "step-000025"]
    assert json.loads((mirror / "set-aside-1" / "set-aside.json").read_text())["after_step"] == 20
    shutil.rmtree(run)  # the local disk is lost
    with Checkpointer(run, mirror=str(mirror)) as ckpt:
        assert restored(ckpt) == 25  # never the step set aside
    with Checkpointer(mirror / "set-aside-1", read_only=True) as reader:
        assert restored(reader) == 30


def test_killed_before_the_mirror_sets_steps_aside_none_of_them_is_the_newest_there(tmp_path: Path) -> None:
    """The mirror sets steps aside on its thread, after the uploads queued before; a process
    killed before that left the mirror's copy of a set-aside step, and the next open restored it
    as the newest (found by review). Now the mirror's intent is durable before the save goes on:
    the next writable open carries it out there."""
    run, mirror, killed = tmp_path / "run", tmp_path / "mirror", tmp_path / "killed"
    with saved(run, (10, 20, 30), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    entered, release, held = upload_holder()

    with armed("mirror.upload", held), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the set-aside is said in a warning
        ckpt = Checkpointer(run, mode="sync", mirror=str(mirror))
        try:
            ckpt.save(state_of(31), step=31)  # its upload held: the mirror's queue is not empty
            assert entered.wait(60)
            restored(ckpt, 20)
            ckpt.save(state_of(25), step=25)  # 30 and 31 set aside here; the mirror's job queued
            shutil.copytree(mirror, killed)  # the mirror as a kill now would leave it
        finally:
            release.set()
            ckpt.close()
    assert (killed / "step-000030").is_dir()  # the mirror's job had not run
    shutil.rmtree(mirror)
    shutil.copytree(killed, mirror)
    with Checkpointer(run, mode="sync", mirror=str(mirror)) as again:
        assert restored(again) == 25 and again.steps() == [10, 20, 25]
    assert not (mirror / "step-000030").exists()


def test_a_mirror_unreachable_as_steps_go_aside_still_hides_them_from_every_reader(tmp_path: Path) -> None:
    """The mirror could not be told that steps go aside (its listing failed as the save set them
    aside), and its thread had not set them aside yet: only the writer's memory hid the mirror's
    copy of step 30, so another rank (a reader here) restored it as the newest, and after a kill
    so did the next open. Now the run's directory notes what the mirror hides before anything
    moves: every reader hides it, and the next writable open sets it aside there."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20, 30), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    entered, release, held = upload_holder()

    def unreachable(url: str) -> None:
        if url == str(mirror):
            raise OSError(113, "No route to host", url)

    with armed("mirror.upload", held), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the set-aside and the mirror's failure are said in warnings
        ckpt = Checkpointer(run, mode="sync", mirror=str(mirror))
        try:
            ckpt.save(state_of(31), step=31)  # its upload held: the mirror's queue is not empty
            assert entered.wait(60)
            restored(ckpt, 20)
            with armed("store.names", unreachable):
                ckpt.save(state_of(25), step=25)  # 30 and 31 set aside here; the mirror not told
            assert not (mirror / ".set-aside-intent.json").exists()
            with Checkpointer(run, read_only=True, mirror=str(mirror)) as reader:
                assert restored(reader) == 25
                with pytest.raises(CheckpointError, match="no committed checkpoint for step 30"):
                    reader.load(30)
            for place in (run, mirror):  # each as a kill now would leave it
                shutil.copytree(place, tmp_path / f"killed-{place.name}")
        finally:
            release.set()
            ckpt.close()
    for place in (run, mirror):
        shutil.rmtree(place)
        shutil.copytree(tmp_path / f"killed-{place.name}", place)
    assert (mirror / "step-000030").is_dir()  # the mirror's job had not run
    with Checkpointer(run, mode="sync", mirror=str(mirror)) as again:
        assert restored(again) == 25 and again.steps() == [10, 20, 25]
    assert not (mirror / "step-000030").exists() and not (run / ".set-aside-tier.json").exists()
    with Checkpointer(mirror / "set-aside-1", read_only=True) as reader:
        assert restored(reader) == 30


def test_a_set_aside_tried_again_leaves_no_note_hiding_the_mirrors_newest(tmp_path: Path) -> None:
    """The run's set-aside failed half-way (a move's I/O error) after the run's note hid the
    mirror's copies; the next save finished it and the mirror's thread set its copies aside, but
    the first attempt's note stayed: the step saved again after the rewind went up to the mirror
    under a name it hid, so with the local copy lost a reader restored 25, not the new 30 (and
    the next writable open would have moved the mirror's new 30 aside)."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20, 30), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    failed: list[str] = []

    def fail_once(url: str, folder: str) -> None:
        if url == str(run) and not failed:
            failed.append(folder)
            raise OSError(5, "Input/output error", folder)

    again = {"w": torch.full((8,), 300.0), "step": 30}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the set-aside is said in a warning
        with Checkpointer(run, mode="sync", mirror=str(mirror)) as ckpt:
            restored(ckpt, 20)
            with armed("set_aside.moved", fail_once), pytest.raises(CheckpointError, match="aside"):
                ckpt.save(state_of(25), step=25)
            ckpt.save(state_of(25), step=25)  # the set-aside finished, then this save
            ckpt.save(again, step=30)
            ckpt.wait()  # the mirror's thread too
    assert failed
    shutil.rmtree(run / "step-000030")  # the local copy is lost
    with Checkpointer(run, read_only=True, mirror=str(mirror)) as reader:
        state: dict[str, Any] = {"w": torch.zeros(8), "step": -1}
        assert reader.restore(state) == 30 and torch.equal(state["w"], again["w"])
    assert not (run / ".set-aside-tier.json").exists()


REWINDER = """
import sys, torch
from nbckpt import Checkpointer
from nbckpt.engine._store import arm_crash
ckpt = Checkpointer(sys.argv[1], mode="sync")
ckpt.restore({"w": torch.zeros(8), "step": 0}, step=20)
arm_crash("set_aside_moving")
ckpt.save({"w": torch.full((8,), 25.0), "step": 25}, step=25)
"""


@pytest.mark.parametrize("step", [30, None])
def test_a_step_a_writer_sets_aside_as_a_reader_reads_it_is_not_taken_for_damage(
    tmp_path: Path, step: int | None
) -> None:
    """A reader's restore picked step 30 and, as it opened its files, a writer (another process,
    killed after the move) set 30 aside into set-aside-1. Asked for, the error says where it went;
    not asked for, the reader picks again from what is there, 20, with no word of damage (before:
    "step-000030/... is missing", and a fallback as if 30 were damaged; found by review)."""
    run = tmp_path / "run"
    saved(run, (10, 20, 30)).close()
    moved: list[str] = []
    once = threading.Lock()

    def a_writer_moves_it(path: str) -> None:
        with once:
            if "step-000030" in path and not moved:
                moved.append(path)
                killed_child(REWINDER, str(run))

    with (
        Checkpointer(run, read_only=True) as reader,
        armed("file.open", a_writer_moves_it),
        warnings.catch_warnings(record=True) as said,
    ):
        warnings.simplefilter("always")
        if step is None:
            assert restored(reader) == 20
        else:
            with pytest.raises(CheckpointError, match=r"step 30 was set aside .*set-aside-1"):
                restored(reader, step)
    assert moved and (run / "set-aside-1" / "step-000030").is_dir()
    assert not [str(w.message) for w in said if "nbckpt" in str(w.message)]


def test_a_reader_opened_before_a_writer_sets_steps_aside_never_picks_one_of_them(tmp_path: Path) -> None:
    """A reader open before a writer began to set 30 and 40 aside (killed with 30 moved, 40 not
    yet): the reader's next look sees the writer's intent, so neither is among its steps and
    restore() reads 20 (before: its view was taken as it opened, and it restored 40)."""
    run = tmp_path / "run"
    saved(run, (10, 20, 30, 40)).close()
    with Checkpointer(run, read_only=True) as reader:
        assert reader.steps() == [10, 20, 30, 40]
        killed_child(REWINDER, str(run))
        assert (run / ".set-aside-intent.json").is_file() and (run / "step-000040").is_dir()
        assert reader.steps() == [10, 20] and restored(reader) == 20


def test_a_set_aside_cut_short_by_ctrl_c_is_finished_said_and_told_to_the_mirror_at_the_next_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl-C while the run's steps move (30 moved, 40 not yet), their uploads held: the next
    save finishes the move, warns once where the steps went, and tells the mirror, whose waiting
    uploads read them there. Before, the retry found nothing left to move: no warning, the mirror
    never told, and the uploads of 30 and 40 failed ('committed locally but not on the mirror')."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with saved(run, (10, 20), mirror=str(mirror)) as ckpt:
        ckpt.wait()
    entered, release, held = upload_holder()

    def ctrl_c(url: str, folder: str) -> None:
        if folder == "step-000030":
            raise KeyboardInterrupt

    with armed("mirror.upload", held), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ckpt = Checkpointer(run, mode="sync", mirror=str(mirror))
        try:
            rewind_behind_a_held_upload(ckpt, entered, 30, 40)
            with armed("set_aside.moved", ctrl_c), pytest.raises(KeyboardInterrupt):
                ckpt.save(state_of(25), step=25)
            assert (run / "set-aside-1" / "step-000030").is_dir() and (run / "step-000040").is_dir()
            ckpt.save(state_of(25), step=25)
        finally:
            release.set()
        ckpt.close()
    lines = [str(w.message) for w in said if "set aside" in str(w.message)]
    assert len(lines) == 1 and lines[0].endswith(f"in {run / 'set-aside-1'}"), lines
    assert not [r.getMessage() for r in caplog.records if "mirror" in r.getMessage()]
    with Checkpointer(run, read_only=True) as reader:
        assert reader.steps() == [10, 20, 25]
    with Checkpointer(mirror, read_only=True) as reader:
        assert reader.steps() == [10, 20, 25]
    with Checkpointer(mirror / "set-aside-1", read_only=True) as reader:
        assert [restored(reader, step) for step in (30, 40)] == [30, 40]
