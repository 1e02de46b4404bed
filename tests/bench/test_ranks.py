"""``nbckpt bench`` on many ranks: real torchrun, gloo, tiny sizes (``nbckpt.bench._ranks``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nbckpt.bench import Comparison

HELPER = Path(__file__).parents[1] / "helpers" / "bench_rank_worker.py"
WRITERS = ["torch-save", "dcp-sync", "nbckpt-async"]
SLOW_RANK, SLOW_S = 1, 0.4


def _data_bytes(folder: Path) -> int:
    """The checkpoints' data files under ``folder``: DCP's and nbckpt's shards, torch.save's files."""
    return sum(path.stat().st_size for path in folder.rglob("*")
               if path.is_file() and path.suffix in (".distcp", ".pt"))


@pytest.mark.timeout(240)
def test_two_ranks_report_every_rank_the_job_and_the_slowed_rank_as_straggler(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(HELPER), str(SLOW_RANK), str(SLOW_S),
               "bench", "--dir", str(tmp_path / "ckpt"), "--size-mb", "1", "--compute-ms", "1",
               "--strategies", ",".join(WRITERS), "--steps", "4", "--every", "2", "--repeats", "1",
               "--no-warmup", "--keep", "--quiet", "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    # Rank 0 alone prints and writes results: one table, one file.
    assert done.stdout.count("results written to") == 1, done.stdout
    assert done.stdout.count("on 2 ranks, 1 host(s)") == 1
    document = json.loads(out.read_text())
    again = Comparison.from_json(out)  # the job's figures read back, and shown under the table
    assert again.job == document["job"] and again.ranks == document["ranks"]
    assert "straggler rank 1" in again.table()
    rows = {(row["rank"], row["strategy"]): row for row in document["ranks"]}
    assert set(rows) == {(rank, name) for rank in (0, 1) for name in ["none", *WRITERS]}
    host = socket.gethostname()
    for name in WRITERS:
        for rank in (0, 1):
            row = rows[rank, name]
            assert row["host"] == host and row["checkpoints"] == 2 and row["stall_s"] > 0
            assert row["bytes"] > 2 * 1024 * 1024  # its own MiB in each of two checkpoints
        # Every byte each rank says it wrote is on disk, and nothing else is.
        written = sum(rows[rank, name]["bytes"] for rank in (0, 1))
        assert written == _data_bytes(tmp_path / "ckpt" / name), name
    job = document["job"]
    assert job["world_size"] == 2 and job["hosts"] == {host: [0, 1]}
    assert job["floors"]["concurrent_write_gbs"] > 0 and job["floors"]["bytes"] == 2 * 1024 * 1024
    for summary in job["strategies"]:
        if summary["strategy"] == "none":
            assert summary["straggler"] is None and summary["checkpoints"] == []
            continue
        late = summary["straggler"]
        assert (late["rank"], late["host"]) == (SLOW_RANK, host), summary
        assert late["over_median_s"] > SLOW_S / 2 - 0.05  # the median of two is their middle
        assert summary["stall_s"]["max"] >= SLOW_S
        steps = [(row["step"], row["ranks_writing"]) for row in summary["checkpoints"]]
        assert steps == [(2, 2), (4, 2)]
        assert all(row["time_to_durable_s"] > 0 and row["aggregate_write_gbs"] > 0
                   for row in summary["checkpoints"])
