"""Crashes: SIGKILL at random moments of async saves, and at the engine's exact fault points.

After every kill a new Checkpointer must clean up the leftovers (and say so), and restore
must return the newest checkpoint that had committed before the kill, bit for bit.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import crash_child

from nbckpt import Checkpointer

STALE = re.compile(r"^\.(tmp|trash|old)-step-")
SEED = 7
KEEP = 3
LANES = 2  # children killed concurrently, each in its own directory; odd lanes save with overlap
MAX_KILL_DELAY_S = 0.3
CHILD = Path(crash_child.__file__)


def leftovers(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if STALE.match(n)) if directory.exists() else []


def reopen(directory: Path, mirror: Path | None = None) -> Checkpointer:
    """A new Checkpointer on a crashed run: it must remove the leftovers and warn, naming them."""
    before = {directory: leftovers(directory)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = Checkpointer(directory, mode="sync", mirror=None if mirror is None else str(mirror))
    messages = [str(w.message) for w in caught if "leftover(s) of interrupted saves" in str(w.message)]
    cleaned = {directory}
    for path in cleaned:
        said = [m for m in messages if f" in {path}: " in m]
        assert len(said) == bool(before.get(path)), (path, before, messages)
        assert all(name in said[0] for name in before.get(path, [])), (before, messages)
        assert leftovers(path) == []
    assert len(messages) == sum(bool(before.get(path)) for path in cleaned), messages
    return ckpt


def assert_state_is(state: dict[str, Any], seed: int, step: int, ring: int | None) -> int:
    """The restored state is exactly one generation's, saved as ``step``; return the generation."""
    generation = int(state["meta"]["generation"])
    assert (generation % ring if ring else generation) == step, (step, generation)
    expected = crash_child.expected_state(seed, generation)
    got_params = state["model"].state_dict()
    for name, tensor in expected["model"].state_dict().items():
        assert torch.equal(got_params[name], tensor), f"step {step}: {name} differs"
    assert state["step"] == generation
    assert state["meta"] == expected["meta"]
    return generation


def check_directory(
    directory: Path, seed: int, ring: int | None = None, mirror: Path | None = None
) -> dict[int, int]:
    """Every committed checkpoint verifies and holds exactly one generation: step -> generation
    (a step set aside after a rewind as ``-step - 1``: it is there, but not the run's).
    With a mirror: once the reopened run has uploaded what the kill cut short, the mirror holds
    the newest step too, and every step on it verifies and holds exactly one generation."""
    ckpt = reopen(directory, mirror)
    try:
        held = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ckpt.steps():
                state = crash_child.make_state(crash_child.build_model(), seed, 0)
                newest = ckpt.restore(state)
                assert newest == max(ckpt.steps())
                assert_state_is(state, seed, newest, ring)
            for step in ckpt.steps():
                ckpt.verify(step)
                other = crash_child.make_state(crash_child.build_model(), seed, 0)
                assert ckpt.restore(other, step=step) == step
                held[step] = assert_state_is(other, seed, step, ring)
            ckpt.wait()  # with a mirror: the uploads resumed at open (a failed one is a warning)
        skipped = [str(w.message) for w in caught if "nbckpt" in str(w.message)]
        assert skipped == [], skipped
    finally:
        ckpt.close()
    with Checkpointer(directory, read_only=True) as reader:
        runs = reader.set_aside_runs()
    for entry in runs:  # after a rewind
        with Checkpointer(entry["path"], read_only=True) as aside:
            for step in aside.steps():
                aside.verify(step)
                other = crash_child.make_state(crash_child.build_model(), seed, 0)
                assert aside.restore(other, step=step) == step
                held[-step - 1] = assert_state_is(other, seed, step, ring)  # never the run's
    if mirror is not None:
        with Checkpointer(mirror, read_only=True) as copy:
            assert max(copy.steps(), default=-1) == max((s for s in held if s >= 0), default=-1)
            for step in copy.steps():
                copy.verify(step)
                other = crash_child.make_state(crash_child.build_model(), seed, 0)
                assert copy.restore(other, step=step) == step
                assert_state_is(other, seed, step, ring)
    return held


def read_log(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_for_log(log: Path, process: Any, done: Any, what: str, deadline_s: float = 60.0) -> list[str]:
    """Poll the child's log until ``done(lines)``; fail if the child dies first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        lines = read_log(log)
        if done(lines):
            return lines
        if not process.is_alive():
            pytest.fail(f"child died before {what} (exit code {process.exitcode})")
        time.sleep(0.005)
    pytest.fail(f"child did not get to {what} within {deadline_s} s")


def commits(lines: list[str]) -> list[tuple[int, int]]:
    """(step, generation) of every save the child saw commit."""
    return [(int(line.split()[1]), int(line.split()[2])) for line in lines if line.startswith("committed ")]


def run_kill_trials(
    base: Path,
    trials: int,
    seed: int,
    *,
    keep: int | None = KEEP,
    ring: int | None = None,
    mirror: bool = False,
    rewind: bool = False,
    min_commits: int = 0,
) -> Counter[str]:
    """Kill ``trials`` children (LANES at a time) at random moments; check each directory after.

    Nothing is lost when every step the child saw commit is still there (unless retention
    deleted it) holding that generation or a newer one, and the newest generation survives.
    """
    context = multiprocessing.get_context("forkserver")
    # fork a warm interpreter, not a cold one (3.11's forkserver ignores sys.path: no tests/ here)
    context.set_forkserver_preload(["torch", "nbckpt"])
    rng = random.Random(seed)
    lanes = [base / f"run{i}" for i in range(LANES)]
    mirrors = [base / f"mirror{i}" if mirror else None for i in range(LANES)]
    newest = dict.fromkeys(range(LANES), -1)
    held: dict[int, dict[int, int]] = {lane: {} for lane in range(LANES)}
    stats: Counter[str] = Counter()
    for trial in range(0, trials, LANES):
        children = []
        for lane, directory in enumerate(lanes):
            log = base / f"log-{lane}-{trial}.txt"
            process = context.Process(
                target=crash_child.train_logged,
                # odd lanes: overlap
                args=(
                    str(directory),
                    SEED,
                    100_000,
                    keep,
                    str(log),
                    lane % 2 == 1,
                    ring,
                    None if mirrors[lane] is None else str(mirrors[lane]),
                    rewind,
                ),
                daemon=True,
            )
            process.start()
            children.append((lane, process, log))
        # Kill each child at a random moment: one in five while it starts up (cleaning up,
        # restoring), the others after a random number (0 to 2) of its commits plus a random
        # delay, so that the kills spread over the saves however loaded the machine is.
        for lane, process, log in children:
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0, 0.05))  # the fault's timing, not synchronisation
                process.kill()
                stats["kills during start-up"] += not read_log(log)
                continue
            lines = wait_for_log(log, process, lambda lines: lines, "ready")
            assert lines[0] == f"ready {newest[lane] + 1}"
            wanted = rng.randint(min_commits, 2)
            wait_for_log(log, process, lambda lines, n=wanted: len(commits(lines)) >= n, "commits")
            time.sleep(rng.uniform(0, MAX_KILL_DELAY_S))  # the fault's timing, not synchronisation
            process.kill()
        for lane, process, log in children:
            process.join(30)
            assert process.exitcode == -signal.SIGKILL
            reported = commits(read_log(log))
            before = dict(held[lane])
            for step, generation in reported:
                before[step] = max(before.get(step, -1), generation)
            stats["trials"] += 1
            stats["commits reported"] += len(reported)
            stats["kills with leftovers"] += bool(leftovers(lanes[lane]))
            stats["set aside"] = sum(len(list(lane.glob("set-aside-*"))) for lane in lanes)
            held[lane] = check_directory(lanes[lane], SEED, ring, mirrors[lane])
            newest_before = max(before.values(), default=-1)
            newest[lane] = max((g for s, g in held[lane].items() if s >= 0), default=-1)
            stats["lost"] += max(held[lane].values(), default=-1) < newest_before  # set aside: kept
            if ring:  # no retention: every step seen must be there, never older than seen
                stats["lost"] += sum(held[lane].get(s, -1) < g for s, g in before.items())
    return stats


def report(stats: Counter[str]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in sorted(stats.items()))


def test_random_kills_lose_nothing(tmp_path: Path) -> None:
    stats = run_kill_trials(tmp_path, trials=20, seed=20261129)
    print(f"\nrandom SIGKILL trials: {report(stats)}")
    assert stats["trials"] == 20
    assert stats["commits reported"] > 0
    assert stats["lost"] == 0, report(stats)


@pytest.mark.parametrize(("what", "keep", "ring"), [("re-saves", None, 3), ("retention deletes", 1, None)])
def test_random_kills_during(tmp_path: Path, what: str, keep: int | None, ring: int | None) -> None:
    """Kills while the same steps are saved again (ring of 3) or while every commit deletes one."""
    stats = run_kill_trials(tmp_path, trials=10, seed=20261130, keep=keep, ring=ring)
    print(f"\nrandom SIGKILL trials during {what}: {report(stats)}")
    assert stats["commits reported"] > 0
    assert stats["lost"] == 0, report(stats)


@pytest.mark.parametrize(("what", "options"), [("a mirror", {"mirror": True}), ("rewinds", {"rewind": True})])
def test_random_kills_with(tmp_path: Path, what: str, options: dict[str, bool]) -> None:
    """Kills of a run that uploads every commit to a mirror, and of one that goes back a step
    each time it restarts (so that its first save sets the newest step aside)."""
    # with rewinds: a commit after the set-aside before most kills, so that set-aside runs pile up
    stats = run_kill_trials(
        tmp_path, trials=8, seed=20261201, min_commits=int(options.get("rewind", 0)), **options
    )
    print(f"\nrandom SIGKILL trials with {what}: {report(stats)}")
    assert stats["commits reported"] > 0
    assert stats["lost"] == 0, report(stats)
    if options.get("rewind"):
        assert stats["set aside"] >= 2, report(stats)


@pytest.mark.slow
def test_random_kills_soak(tmp_path: Path) -> None:
    stats = run_kill_trials(tmp_path, trials=200, seed=int(time.time()))
    print(f"\nrandom SIGKILL soak: {report(stats)}")
    assert stats["lost"] == 0, report(stats)


def save_step0(directory: Path) -> None:
    with Checkpointer(directory, mode="sync") as ckpt:
        state = crash_child.expected_state(SEED, 0)
        ckpt.save(state, step=0)


@pytest.mark.parametrize(
    ("point", "extra", "held", "leftover"),
    [
        ("after_data", [], {0: 0}, ".tmp-step-000001-"),
        ("before_rename", [], {0: 0}, ".tmp-step-000001-"),
        ("during_delete", ["--keep", "1"], {1: 1}, ".trash-step-000000-"),
        # a re-save of step 0 (generation 1 with a ring of 1): the old copy or the new, never none
        ("after_swap", ["--ring", "1"], {0: 1}, ".old-step-000000-"),
        ("between_renames", ["--ring", "1", "--no-exchange"], {0: 0}, ".old-step-000000-"),
    ],
)
def test_crash_at_fault_point(
    tmp_path: Path, point: str, extra: list[str], held: dict[int, int], leftover: str
) -> None:
    crash_at(tmp_path / "run", point, extra, held, leftover)


def crash_at(directory: Path, point: str, extra: list[str], held: dict[int, int], leftover: str) -> None:
    """Kill a run at ``point``; the next open puts back or removes ``leftover``, and ``held`` stays."""
    save_step0(directory)
    args = [
        sys.executable,
        str(CHILD),
        str(directory),
        "--seed",
        str(SEED),
        "--steps",
        "3",
        "--crash-at",
        point,
        *extra,
    ]
    child = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "finished" not in child.stdout
    names = leftovers(directory)
    # Retention runs in the background, so the next save may be under way when a delete dies.
    assert [n for n in names if n.startswith(leftover)] and all(
        n.startswith((leftover, ".tmp-")) for n in names
    ), names
    assert check_directory(directory, SEED, ring=1 if "--ring" in extra else None) == held


# -- on a network file system (item 21 of "Reliability v3"): a SeaweedFS FUSE mount, where
# renameat2(RENAME_EXCHANGE) is unsupported, so that a re-save takes the two renames.


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
def test_random_kills_on_a_network_mount(on_mount: Path) -> None:
    """Kills while the same steps are saved again (ring of 3): the mount's re-saves are two renames."""
    stats = run_kill_trials(on_mount, trials=8, seed=20261202, keep=None, ring=3)
    print(f"\nrandom SIGKILL trials on a network mount: {report(stats)}")
    assert stats["commits reported"] > 0
    assert stats["lost"] == 0, report(stats)


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
@pytest.mark.parametrize(
    ("point", "extra", "held", "leftover"),
    # no --no-exchange: the mount itself has no exchange, so a re-save goes between renames
    [("between_renames", ["--ring", "1"], {0: 0}, ".old-step-000000-")],
)
def test_crash_at_fault_point_on_a_network_mount(
    on_mount: Path, point: str, extra: list[str], held: dict[int, int], leftover: str
) -> None:
    crash_at(on_mount / "run", point, extra, held, leftover)
