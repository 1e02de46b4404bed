"""Reliability v3, the mirror: never shared with the run or another run (item 9), the run's lines
kept on it (item 10), a bounded backlog that resumes after a crash (item 11). Each test failed
before the fix."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.states import assert_holds, state_of

from nbckpt import Checkpointer, ConfigError
from nbckpt.engine._faults import armed


def committed(directory: Path) -> list[int]:
    """The committed steps in one directory of a run (one line)."""
    return sorted(
        int(name.split("-")[1])
        for name in os.listdir(directory)
        if name.startswith("step-") and (directory / name / "manifest.json").is_file()
    )


class Gate:
    """Uploads to the mirror wait until ``release`` is set (a mirror slower than the saves);
    ``entered`` tells that one has started."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()


@pytest.fixture
def held_uploads() -> Iterator[Gate]:
    gate = Gate()

    def slow(location: str, name: str) -> None:
        gate.entered.set()
        assert gate.release.wait(60), "the test never released the uploads"

    with armed("mirror.upload", slow):
        yield gate
        gate.release.set()  # never leave the mirror's thread stuck


# -- item 9 ---------------------------------------------------------------------------------------


def test_item09_a_mirror_inside_the_run_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (tmp_path / "link").symlink_to(run, target_is_directory=True)
    for mirror in (run, run / "mirror", tmp_path, tmp_path / "link", f"file://{run}", f"{run}/"):
        with pytest.raises(ConfigError, match="a mirror needs a place of its own") as raised:
            Checkpointer(run, mirror=str(mirror))
        assert "\n" not in str(raised.value)
    assert sorted(os.listdir(tmp_path)) == ["link"]  # nothing created
    with pytest.raises(ConfigError, match="a mirror needs a place of its own"):
        Checkpointer("s3://bucket/run", mirror="s3://bucket/run/copy")


def test_item09_two_runs_never_share_a_mirror(tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    with Checkpointer(tmp_path / "a", mirror=str(mirror), keep=2) as a:
        for step in (1, 2, 3):
            a.save(state_of(step), step=step).wait()
        a.wait()
    for options in ({}, {"read_only": True}):
        with pytest.raises(ConfigError, match=f"the mirror {mirror} belongs to the run {tmp_path / 'a'}"):
            Checkpointer(tmp_path / "b", mirror=str(mirror), **options)
    assert not (tmp_path / "b").exists() or committed(tmp_path / "b") == []
    with pytest.raises(ConfigError, match="is the mirror of the run"):
        Checkpointer(mirror)  # a writer there would clean up and delete the mirror's steps
    with pytest.raises(ConfigError, match="is a run's directory"):
        Checkpointer(tmp_path / "c", mirror=str(tmp_path / "a"))  # a run is not a mirror either
    assert committed(mirror) == [2, 3]
    with Checkpointer(mirror, read_only=True) as reader:  # reading a mirror is fine
        assert_holds(reader, 3)
    with Checkpointer(tmp_path / "a", mirror=str(mirror), keep=2) as a:  # its own run, reopened
        a.save(state_of(4), step=4).wait()
        a.wait()
    assert committed(mirror) == [3, 4]


# -- item 10 --------------------------------------------------------------------------------------


def test_item10_the_mirror_sets_steps_aside_as_the_run_does_so_a_restore_from_it_resumes_right(
    tmp_path: Path, held_uploads: Gate
) -> None:
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    with Checkpointer(run, mirror=str(mirror)) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(state_of(step), step=step).wait()
        assert_holds(ckpt, 20)  # while the uploads of steps 10-30 are still queued
        with pytest.warns(UserWarning, match="set aside, still restorable, in .*set-aside-1"):
            ckpt.save(state_of(25), step=25).wait()  # never waits for the held uploads
        assert ckpt.restore(state_of(0)) == 25
        held_uploads.release.set()
        ckpt.wait()  # every upload went where it belongs: no failure is warned of
    assert committed(mirror) == [10, 20, 25]
    assert committed(mirror / "set-aside-1") == [30]  # uploaded from where the run set it aside
    record = json.loads((mirror / "set-aside-1" / "set-aside.json").read_text())
    assert record["after_step"] == 20

    shutil.rmtree(run)  # the machine's disk is gone: only the mirror is left
    with Checkpointer(run, mirror=str(mirror)) as ckpt:
        assert ckpt.restore(state_of(0)) == 25  # never the step set aside
        assert_holds(ckpt, 20)
        ckpt.restore(state_of(0))
        ckpt.save(state_of(26), step=26).wait()
        ckpt.wait()
    assert committed(run) == [26] and committed(mirror) == [10, 20, 25, 26]
    with Checkpointer(run, mirror=str(mirror), read_only=True) as reader:
        assert reader.restore(state_of(0)) == 26


# -- item 11 --------------------------------------------------------------------------------------


def test_item11_a_slow_mirror_keeps_the_backlog_and_the_directory_bounded(
    tmp_path: Path, held_uploads: Gate, caplog: pytest.LogCaptureFixture
) -> None:
    run, mirror, keep = tmp_path / "run", tmp_path / "mirror", 2
    logged = caplog.at_level(logging.INFO, logger="nbckpt")
    with logged, Checkpointer(run, mirror=str(mirror), keep=keep) as ckpt:
        for step in range(1, 21):
            ckpt.save(state_of(step), step=step).wait()
            assert held_uploads.entered.wait(30)  # step 1's upload is under way (and stuck)
            ckpt._saver.wait()  # retention has run (the mirror is not waited for)
            assert len(committed(run)) <= keep + 1, committed(run)  # the one uploading, and keep
        assert committed(run) == [1, 19, 20]
        held_uploads.release.set()
        ckpt.wait()
    skipped = [r.getMessage() for r in caplog.records if "is slower than the saves" in r.getMessage()]
    assert skipped and "step 2 is not uploaded" in skipped[0], skipped
    assert sum(r.levelno == logging.WARNING for r in caplog.records if r.getMessage() in skipped) == 1
    assert committed(mirror) == [19, 20]
    with Checkpointer(mirror, read_only=True) as reader:
        for step in (19, 20):
            reader.verify(step)
            assert_holds(reader, step)


KILLED_WHILE_UPLOADING = """
import sys, threading
from helpers.states import state_of
from nbckpt import Checkpointer
from nbckpt.engine._faults import armed
entered = threading.Event()
def stuck(location, name):  # a mirror that stopped answering
    entered.set()
    threading.Event().wait()
with armed("mirror.upload", stuck):
    ckpt = Checkpointer(sys.argv[1], mirror=sys.argv[2], keep=3)
    for step in range(1, 7):
        ckpt.save(state_of(step), step=step).wait()
        entered.wait()
    ckpt._saver.wait()
    print("saved", flush=True)
    threading.Event().wait()
"""


def test_item11_uploads_resume_when_the_run_is_reopened_after_a_kill(tmp_path: Path) -> None:
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_WHILE_UPLOADING, str(run), str(mirror)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "saved\n", child.communicate(timeout=60)[1]
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    assert committed(mirror) == [] and committed(run) == [1, 4, 5, 6]
    with Checkpointer(run, mirror=str(mirror), keep=3) as ckpt:
        ckpt.wait()  # the backlog the kill cut short goes up now
    assert committed(mirror) == [4, 5, 6]
    assert [n for n in os.listdir(mirror) if n.startswith(".tmp-")] == []  # the cut upload's remains
    with Checkpointer(mirror, read_only=True) as reader:
        for step in (4, 5, 6):
            reader.verify(step)
            assert_holds(reader, step)
