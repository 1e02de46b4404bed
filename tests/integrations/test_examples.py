"""The examples run as their docstrings say; the nanoGPT loop resumes exactly after SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
_LOSS = re.compile(r"iter (\d+) loss (\S+)")


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True, text=True, timeout=600
    )


def _losses(out: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in _LOSS.finditer(out)}


def test_nanogpt_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    straight = _run("nanogpt_resume.py", "--out_dir", str(tmp_path / "a"), "--max_iters", "40")
    assert straight.returncode == 0, straight.stderr[-2000:]
    expected = _losses(straight.stdout)
    assert sorted(expected) == list(range(40))

    killed = _run(
        "nanogpt_resume.py", "--out_dir", str(tmp_path / "b"), "--max_iters", "40", "--kill_at", "25"
    )
    assert killed.returncode == -signal.SIGKILL
    before = _losses(killed.stdout)
    assert max(before) == 24 and all(before[i] == expected[i] for i in before)

    resumed = _run(
        "nanogpt_resume.py", "--out_dir", str(tmp_path / "b"), "--max_iters", "40", "--init_from", "resume"
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    start = int(re.search(r"resumed from iter (\d+)", resumed.stdout).group(1))  # type: ignore[union-attr]
    assert start in (20, 25)  # the save at 25 was in flight when the kill came: either may be newest
    after = _losses(resumed.stdout)
    assert sorted(after) == list(range(start, 40))
    # every loss after the resume, bit for bit (repr of the float), as the uninterrupted run's
    assert {i: after[i] for i in after} == {i: expected[i] for i in after}


def test_lightning_example_resumes_from_last(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    first = _run("lightning_example.py", "--dir", str(tmp_path), "--epochs", "2")
    assert first.returncode == 0, first.stderr[-2000:]
    second = _run("lightning_example.py", "--dir", str(tmp_path), "--epochs", "3")
    assert second.returncode == 0, second.stderr[-2000:]
    assert (
        f"Restored all states from the checkpoint at {tmp_path / 'last.ckpt'}"
        in second.stdout + second.stderr
    )
    assert "trained to epoch 3; best" in second.stdout


def test_hf_example_resumes_from_nbckpt(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    first = _run("hf_example.py", "--dir", str(tmp_path), "--max_steps", "20")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "starting fresh" in first.stdout
    second = _run("hf_example.py", "--dir", str(tmp_path), "--max_steps", "30")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "checkpoint-20" in second.stdout and "trained to step 30" in second.stdout
    assert not list(tmp_path.glob("checkpoint-*"))  # the Trainer wrote no folder of its own
