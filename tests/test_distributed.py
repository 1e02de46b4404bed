"""torchrun with 2 ranks on CPU (gloo): async saves, commit after every rank, restore, compare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")


@pytest.mark.timeout(300)
def test_torchrun_two_ranks_async_save_and_restore(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(WORKER), str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["ok"], result
        assert result["steps"] == [2, 3]
        assert result["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(result["files"])
        assert {"stage", "persist", "commit", "restore"} <= set(result["kinds"])
        assert result["ranks_in_timeline"] == [result["rank"]]
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == [".nbckpt.lock", "step-000002", "step-000003"]
