"""Preemption: a real SIGTERM to a training process that called ``save_on_signal``."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import preempted_child

from nbckpt import Checkpointer


def run_until_preempted(directory: Path, *extra: str) -> tuple[int, int, str]:
    """Start the child, SIGTERM it after step 12; return (exit code, last step it printed, stderr)."""
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
        if last == 12:
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


def test_sigterm_commits_a_final_save_of_the_current_step(tmp_path: Path) -> None:
    code, last, err = run_until_preempted(tmp_path / "run")
    assert code == -signal.SIGTERM, err  # the signal still ends the process, as it would have
    with Checkpointer(tmp_path / "run") as ckpt:
        final = ckpt.latest_step()
        assert final is not None and final >= last >= 12
        assert held_step(ckpt, final) == final  # exactly the state at the signal
        ckpt.verify(final)
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
            "nothing new to save; the saves in flight committed")
        assert caplog.messages[-1].startswith("nbckpt: kernel exit: nothing new to save")
        line = ckpt.final_save(lambda: 1 / 0)  # type: ignore[arg-type, return-value]
        assert line == "no final save, the snapshot failed: division by zero"
        assert ckpt.steps() == [3]


def test_a_final_save_that_cannot_start_in_time_is_left_behind_at_exit(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run")
    release = threading.Event()
    held = threading.Event()

    def busy() -> None:  # another thread inside a Checkpointer call, for longer than the bound
        with ckpt._operation():
            held.set()
            release.wait(60)

    other = threading.Thread(target=busy)
    other.start()
    assert held.wait(60)
    try:
        line = ckpt.final_save(lambda: ({"step": 1}, 1), timeout_s=0.2)
        assert line == "final save of step 1 did not commit within 0.2 s; the previous checkpoint stays"
        ckpt._at_exit()  # does not wait for the save left behind
        assert not ckpt._closed
    finally:
        release.set()
        other.join()
    ckpt.close()  # the save left behind went on once the lock was free: it counts only if it commits
    assert ckpt.steps() in ([], [1])


def test_save_on_signal_gives_back_the_previous_handlers(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGUSR1)
    with Checkpointer(tmp_path / "run") as ckpt:
        uninstall = ckpt.save_on_signal(lambda: None, signals=(signal.SIGUSR1,))
        assert signal.getsignal(signal.SIGUSR1) is not previous
        uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
