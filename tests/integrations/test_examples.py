"""The examples run as their docstrings say; the nanoGPT loop resumes exactly after SIGKILL."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
_LOSS = re.compile(r"^(?:rank (\d+) )?iter (\d+) loss (\S+)$", re.MULTILINE)
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(script: str, *args: str, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = TORCHRUN if ranks > 1 else []
    return subprocess.run(
        [sys.executable, *launcher, str(EXAMPLES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _losses(out: str) -> dict[tuple[int, int], str]:
    """(rank, iteration) -> the loss printed, as text (repr: bit for bit)."""
    return {(int(m.group(1) or 0), int(m.group(2))): m.group(3) for m in _LOSS.finditer(out)}


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-process", "torchrun-2"])
def test_nanogpt_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path, ranks: int) -> None:
    every = [(rank, i) for rank in range(ranks) for i in range(30)]
    straight = _run("nanogpt_resume.py", "--out_dir", str(tmp_path / "a"), "--max_iters", "30", ranks=ranks)
    assert straight.returncode == 0, straight.stderr[-2000:]
    expected = _losses(straight.stdout)
    assert sorted(expected) == every
    if ranks > 1:  # each rank its own stream and batches
        assert [expected[(0, i)] for i in range(30)] != [expected[(1, i)] for i in range(30)]

    args = ["--out_dir", str(tmp_path / "b"), "--max_iters", "30"]
    killed = _run("nanogpt_resume.py", *args, "--kill_at", "15", ranks=ranks)
    assert killed.returncode == (-signal.SIGKILL if ranks == 1 else 1), killed.stderr[-2000:]
    before = _losses(killed.stdout)
    assert max(i for _, i in before) == 14 and all(before[k] == expected[k] for k in before)

    resumed = _run("nanogpt_resume.py", *args, "--init_from", "resume", ranks=ranks)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    starts = {int(n) for n in re.findall(r"resumed from iter (\d+)", resumed.stdout)}
    assert len(starts) == 1 and starts <= {10, 15}  # the save at 15 was in flight when the kill came
    start = starts.pop()
    after = _losses(resumed.stdout)
    assert sorted(after) == [(rank, i) for rank, i in every if i >= start]
    # every loss after the resume, on every rank, bit for bit (repr of the float), as uninterrupted
    assert after == {k: expected[k] for k in after}


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


def _accelerate_example(*args: str, ranks: int) -> str:
    """Run examples/accelerate_example.py: in this process for one rank (it is quick there),
    under torchrun for more; its stdout."""
    if ranks > 1:
        done = _run("accelerate_example.py", *args, ranks=ranks)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout
    spec = importlib.util.spec_from_file_location("accelerate_example", EXAMPLES / "accelerate_example.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        example.main(list(args))
    return out.getvalue()


@pytest.mark.parametrize(
    "ranks", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["one-process", "torchrun-2"]
)
def test_accelerate_example_resumes_exactly(tmp_path: Path, ranks: int) -> None:
    pytest.importorskip("accelerate")
    step = re.compile(r"^rank (\d+) step (\d+) loss (\S+)$", re.MULTILINE)

    def losses(out: str) -> dict[tuple[int, int], str]:
        return {(int(m.group(1)), int(m.group(2))): m.group(3) for m in step.finditer(out)}

    expected = losses(_accelerate_example("--dir", str(tmp_path / "a"), ranks=ranks))
    assert sorted(expected) == [(rank, i) for rank in range(ranks) for i in range(1, 25)]
    _accelerate_example("--dir", str(tmp_path / "b"), "--stop_at", "15", ranks=ranks)
    resumed = _accelerate_example("--dir", str(tmp_path / "b"), ranks=ranks)
    assert "starting at step 12" in resumed  # the save at 12, mid-epoch: batches skipped
    after = losses(resumed)
    assert sorted(after) == [(rank, i) for rank in range(ranks) for i in range(13, 25)]
    assert after == {k: expected[k] for k in after}  # every rank, bit for bit
