"""The scale-parts benchmark's short mode (issue 28): every part timed on 2 real torchrun ranks."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "scale_parts.py"


def test_the_parts_benchmark_runs_in_its_short_mode_and_leaves_its_target_empty(tmp_path: Path) -> None:
    """Each part's aggregate rate and CPU, nbckpt's read from its own events, and the paired
    ratios; what it measures at 4 MiB is noise, only that it runs and cleans up is checked."""
    target, out = tmp_path / "target", tmp_path / "parts.json"
    target.mkdir()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--ranks", "2", "--target", str(target), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["gbs"]) == {"raw-1", "raw-2", "hashed-2", "nbckpt"}
    assert all(row["n"] == 4 and row["median"] > 0 for row in result["gbs"].values())
    assert all(row["median"] > 0 for row in result["cpu_s_per_gb"].values())
    assert all(math.isfinite(ratio["median"]) for ratio in result["ratios"].values())
    assert "nbckpt / raw-1" in done.stdout
    assert list(target.iterdir()) == []
