"""The save-schedule benchmark's short mode (issue 33): real SIGKILLs, restarts, resumes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kill_goodput.py"


def test_the_kill_benchmark_runs_in_its_short_mode(tmp_path: Path) -> None:
    """One configuration (async at the advised interval), failures every few seconds: the child
    is killed and restarted, resumes from its checkpoints, the baseline runs on each side, and
    the JSON holds the measured goodput beside the model's; what it measures here is noise,
    only that it runs is checked."""
    out = tmp_path / "kill.json"
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--modes",
            "async",
            "--factors",
            "1",
            "--dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert run["kills"] >= 2, run  # the seeded lifetimes: several within the 10 s chunk
    assert any(restored for _, _, restored in run["lives"]), run["lives"]  # resumed a checkpoint
    assert run["goodput"] > 0 and 0 <= run["predicted"] <= 1 and run["costs"]["saves"] > 0
    assert len(result["baseline_steps_per_s"]) == 2  # the no-failure windows on each side
    assert result["plans"]["async"]["reason"].startswith("save every ")
    assert "async" in done.stdout and "goodput" in done.stdout
