"""Preemption: a real SIGTERM to a training process that called ``save_on_signal``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import preempted_child
from helpers.ranks import RankProcess, free_port

from nbckpt import Checkpointer
from nbckpt.engine._faults import armed


def run_until_preempted(directory: Path, *extra: str) -> tuple[int, int, str]:
    """Start the child, SIGTERM it after step 12 (unless it signals itself: ``--signal-at``);
    return (exit code, last step it printed, stderr)."""
    child = subprocess.Popen(
        [sys.executable, preempted_child.__file__, str(directory), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    last = 0
    for line in child.stdout:
        last = int(line.split()[1])
        if last == 12 and "--signal-at" not in extra:
            child.send_signal(signal.SIGTERM)
            break
    rest, err = child.communicate(timeout=120)
    for line in rest.splitlines():
        last = int(line.split()[1])
    return child.returncode, last, err


def held_step(ckpt: Checkpointer, step: int) -> float:
    state = {"model": torch.nn.Linear(64, 64), "step": -1}
    assert ckpt.restore(state, step=step) == step and state["step"] == step
    return float(state["model"].weight.detach().mean())


# The final save's bound where a test needs it to commit: 2 s (the child's default) is the
# bound's own test; under load the save took up to 0.9 s (two busy loops on 2 cores), and one
# whose fsyncs queue behind other tests' writes can take longer.
COMMITS = ("--timeout", "30")


def test_sigterm_commits_a_final_save_of_the_current_step(tmp_path: Path) -> None:
    code, last, err = run_until_preempted(tmp_path / "run", *COMMITS)
    assert code == -signal.SIGTERM, err  # the signal still ends the process, as it would have
    with Checkpointer(tmp_path / "run") as ckpt:
        final = ckpt.latest_step()
        assert final is not None and final >= last >= 12
        assert held_step(ckpt, final) == final  # exactly the state at the signal
        ckpt.verify(final)
    assert f"SIGTERM: final save of step {final} committed" in err


@pytest.mark.parametrize("whole_step", [True, False], ids=["whole_step", "bare"])
def test_a_signal_in_the_middle_of_a_step_saves_a_whole_step(tmp_path: Path, whole_step: bool) -> None:
    """SIGTERM between a step's weight update and its counter: inside ``whole_step()`` the final
    save waits for the step's end; without it, it pairs step 12's count with step 13's weight."""
    bare = [] if whole_step else ["--bare"]
    code, last, err = run_until_preempted(tmp_path / "run", "--signal-at", "13", *bare, *COMMITS)
    assert code == -signal.SIGTERM, err
    with Checkpointer(tmp_path / "run") as ckpt:
        final = ckpt.latest_step()
        assert final == (13 if whole_step else 12) and last == 12
        assert held_step(ckpt, final) == 13.0
    assert f"SIGTERM: final save of step {final} committed" in err


def test_a_final_save_that_cannot_commit_in_time_leaves_the_previous_one(tmp_path: Path) -> None:
    code, last, err = run_until_preempted(tmp_path / "run", "--slow-final")
    assert code == -signal.SIGTERM, err
    assert "did not commit within 2 s; the previous checkpoint stays" in err
    with pytest.warns(UserWarning, match="cleaned up"), Checkpointer(tmp_path / "run") as ckpt:
        previous = ckpt.latest_step()
    with Checkpointer(tmp_path / "run") as ckpt:
        assert previous is not None and previous % 5 == 0 and previous <= last
        assert held_step(ckpt, previous) == previous
        ckpt.verify(previous)


def test_final_save_says_what_happened(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The final save of a kernel's exit (``final_save``): the same path as the signal's."""
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.final_save(lambda: ({"model": model, "step": 3}, 3)) == "final save of step 3 committed"
        assert ckpt.final_save(lambda: None, reason="kernel exit") == (
            "nothing new to save; the saves in flight committed"
        )
        assert caplog.messages[-1].startswith("nbckpt: kernel exit: nothing new to save")
        line = ckpt.final_save(lambda: 1 / 0)  # type: ignore[arg-type, return-value]
        assert line == "no final save, the snapshot failed: division by zero"
        assert ckpt.steps() == [3]


LEFT_AT_EXIT = """
import atexit, logging, os, signal, sys, threading, torch
from nbckpt import Checkpointer
from nbckpt.engine._faults import armed
logging.basicConfig()  # nbckpt's warnings to stderr
how = sys.argv[2]
BOUND = 0.5  # the final save's timeout_s
go, staged = threading.Event(), threading.Event()
def staging(*args):
    print("staging", flush=True)
    staged.set()
    go.wait()  # until the exit begins: then it copies the state as the interpreter ends
join = threading.Thread.join
def bounded(self, timeout=None):
    if timeout == BOUND:  # the final save's wait: its bound runs out with the save staging
        staged.wait()
    return join(self, timeout)
threading.Thread.join = bounded
ckpt = Checkpointer(sys.argv[1])
state = {"w": torch.arange(16 << 20, dtype=torch.float32), "step": 1}
if how == "kernel exit, a cell interrupted before":  # IPython keeps the cell's error in sys.last_value
    import contextlib, io
    from IPython.core.interactiveshell import InteractiveShell
    with contextlib.redirect_stdout(io.StringIO()):  # its traceback shown in the cell's output
        InteractiveShell.instance().run_cell("raise KeyboardInterrupt")  # the Stop button, earlier
    how = "kernel exit"
if how == "kernel exit":  # Autosave's way: a final save at exit
    atexit.register(go.set)  # runs once the final save was left
    atexit.register(lambda: ckpt.final_save(lambda: (state, 1), timeout_s=BOUND, reason=how))
else:
    if how == "handler":  # an earlier handler of the job's own ends it with its status
        signal.signal(signal.SIGTERM, lambda s, f: sys.exit(3))
    signum = signal.SIGINT if how == "SIGINT" else signal.SIGTERM
    ckpt.save_on_signal(lambda: (state, 1), signals=(signum,), timeout_s=BOUND)
    atexit.register(go.set)  # registered after nbckpt's: runs first, as the exit begins
held = [armed("staging.fit", staging), armed("store.sink", lambda *a: threading.Event().wait())]
for arming in held:  # the second: its storage hangs, so the save never ends
    arming.__enter__()
if how != "kernel exit":
    os.kill(os.getpid(), signum)
"""


@pytest.mark.parametrize(
    ("how", "status"),
    [
        ("SIGINT", -signal.SIGINT),
        ("handler", 3),
        ("kernel exit", 1),
        ("kernel exit, a cell interrupted before", 1),
    ],
    ids=["sigint", "handler-exit-3", "kernel-exit", "kernel-exit-after-an-interrupted-cell"],
)
def test_a_final_save_left_running_at_exit_ends_the_process_with_its_status_not_an_abort(
    tmp_path: Path, how: str, status: int
) -> None:
    """A final save that did not commit in time is left on its daemon thread; the process then
    ends as it was ending (a Ctrl-C's SIGINT, the status of an earlier handler's sys.exit, 1 for
    an exit whose final save failed) without the interpreter's teardown. Before, the teardown
    began under the thread copying the state, which aborted the process (SIGABRT and a core
    dump, ``terminate called without an active exception``: 6 runs of 6 of the handler and the
    exit case, 2 of 3 of the Ctrl-C), or exited 0 though its final save was lost."""
    done = subprocess.run(
        [sys.executable, "-c", LEFT_AT_EXIT, str(tmp_path / "run"), how],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # a core dump, if any, never lands in the worktree
    )
    assert done.stdout.startswith("staging")  # the exit came with the final save under way
    assert done.returncode == status, done.stderr[-3000:]
    assert "did not commit within 0.5 s" in done.stderr
    assert "still runs; the process ends now" in done.stderr


@contextmanager
def another_thread_inside(block: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """Another thread stays inside ``block()`` while the with-statement runs."""
    entered, release = threading.Event(), threading.Event()

    def inside() -> None:
        with block():
            entered.set()
            release.wait(60)

    other = threading.Thread(target=inside)
    other.start()
    assert entered.wait(60)
    try:
        yield
    finally:
        release.set()
        other.join()


def test_a_final_save_that_cannot_start_in_time_is_left_behind_at_exit(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run")
    # another thread inside a Checkpointer call, for longer than the bound
    with another_thread_inside(lambda: ckpt._operation("save")):
        line = ckpt.final_save(lambda: ({"step": 1}, 1), timeout_s=0.2)
        assert line == "final save of step 1 did not commit within 0.2 s; the previous checkpoint stays"
        ckpt._at_exit()  # does not wait for the save left behind
        assert not ckpt._closed
    ckpt.close()  # the save left behind went on once the lock was free: it counts only if it commits
    assert ckpt.steps() in ([], [1])


def test_save_on_signal_gives_back_the_previous_handlers(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    with Checkpointer(tmp_path / "run") as ckpt:
        uninstall = ckpt.save_on_signal(lambda: None, signals=(signal.SIGUSR1,))
        assert signal.getsignal(signal.SIGUSR1) is not previous
        uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous


def test_whole_step_defers_the_final_save_past_a_failing_step_and_past_saves_inside(tmp_path: Path) -> None:
    """A signal inside ``whole_step()`` saves when the outermost block ends, also one ended by an
    exception, with a save inside it; the signal then goes on to the handler before ours."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    weight = torch.zeros(4)
    try:
        with Checkpointer(tmp_path / "run") as ckpt:
            snapshot = lambda: ({"w": weight}, int(weight[0]))  # noqa: E731
            ckpt.save_on_signal(snapshot, signals=(signal.SIGUSR1,))  # the signal takes it off again
            with pytest.raises(RuntimeError, match="the step failed"), ckpt.whole_step():
                weight.fill_(1.0)
                signal.raise_signal(signal.SIGUSR1)  # its handler runs here, and defers
                with ckpt.whole_step():
                    ckpt.save({"w": weight}, step=1, mode="sync")
                assert ckpt.steps() == [1] and seen == []  # the inner ends: still deferred
                weight.fill_(2.0)
                raise RuntimeError("the step failed")
            assert ckpt.steps() == [1, 2] and seen == [signal.SIGUSR1]
            assert float(ckpt.load(2)["w"][0]) == 2.0
            # another thread's block defers nothing (signals reach the main thread only) and
            # does not hold the main thread's final save back
            with another_thread_inside(ckpt.whole_step):
                weight.fill_(3.0)
                ckpt.save_on_signal(snapshot, signals=(signal.SIGUSR1,))
                signal.raise_signal(signal.SIGUSR1)
            assert ckpt.steps() == [1, 2, 3] and seen == [signal.SIGUSR1] * 2
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sigterm_to_every_rank_commits_one_final_step_of_all_of_them(tmp_path: Path, world_size: int) -> None:
    """SIGTERM to every rank after step 12, as torchrun's agent forwards it: each rank's final
    save waits for the end of its step (their all-reduce keeps them in step), and the ranks
    commit one final step together, which plain ``dcp.load`` reads as nbckpt restores it. With 2
    ranks the signals come apart, in a fixed order: rank 0's in the middle of step 12, rank 1's
    while it makes the final save rank 0's asks of it (found by review: that signal ended rank 1
    in the middle of its save, and the final step never committed)."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, preempted_child.__file__, str(tmp_path / "run"), "--timeout", "30"]
    apart = world_size == 2
    others = [
        RankProcess.start(command + ["--signal-in-final"] * apart, {**env, "RANK": str(rank)})
        for rank in range(1, world_size)
    ]
    first = subprocess.Popen(
        command + ["--signal-at", "12"] * apart,
        env={**env, "RANK": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if int(line.split()[1]) == 12 and not apart:
                for proc in [first, *(other.proc for other in others)]:
                    proc.send_signal(signal.SIGTERM)
                break
        _, err = first.communicate(timeout=120)
        ended = [(first.returncode, err), *[other.finish(120)[::2] for other in others]]
    finally:
        first.kill()
        for other in others:
            other.kill()
    assert [code for code, _ in ended] == [-signal.SIGTERM] * world_size, ended
    # A rank whose own SIGTERM is handled after another rank's notice says it saved for that one.
    said = {
        re.search(r"(?:SIGTERM|a signal to another rank): final save of step (\d+) committed", err)
        for _, err in ended
    }
    steps = {int(match[1]) for match in said if match is not None}
    assert len(steps) == 1 and None not in said, ended  # every rank, the same step
    final = steps.pop()
    with Checkpointer(tmp_path / "run") as ckpt:
        assert ckpt.latest_step() == final >= 12
        assert held_step(ckpt, final) == final
        ckpt.verify(final)
    plain = {"model.weight": torch.zeros(64, 64)}
    dcp.load(plain, checkpoint_id=str(tmp_path / "run" / f"step-{final:06d}"))
    assert torch.equal(plain["model.weight"], torch.full((64, 64), float(final)))


def test_a_second_signal_during_the_final_save_is_held_and_saves_nothing_more(tmp_path: Path) -> None:
    """A signal that comes while the final save runs (a second SIGTERM, the scheduler's Ctrl-C)
    goes on once that save ends, saving nothing: handled at once, it began a second final save
    nested in the first, which waited for the first's lock and then saved the step again (found
    by review)."""
    seen: list[int] = []
    taken: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    main = threading.main_thread().ident or 0

    def snapshot() -> tuple[dict[str, Any], int]:
        taken.append(1)
        return {"w": torch.ones(4)}, 7

    def again() -> None:  # on the final save's thread, once: to the main thread, waiting for it
        if not signalled:
            signalled.append(True)
            signal.pthread_kill(main, signal.SIGUSR1)

    signalled: list[bool] = []
    try:
        with Checkpointer(tmp_path / "run") as ckpt, armed("staging.fit", again):
            ckpt.save_on_signal(snapshot, signals=(signal.SIGUSR1,))
            signal.raise_signal(signal.SIGUSR1)
            assert signalled and len(taken) == 1  # one final save
            assert seen == [signal.SIGUSR1] * 2  # both signals went on to the handler before
            assert ckpt.steps() == [7] and ckpt.records[-1].step == 7
            assert sum(record.step == 7 for record in ckpt.records) == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)
