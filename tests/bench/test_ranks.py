"""``nbckpt bench`` on many ranks: real torchrun, gloo, tiny sizes (``nbckpt.bench._ranks``)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nbckpt import cli
from nbckpt._util import GB
from nbckpt.analysis import swimlanes
from nbckpt.analysis._internal import rate_over_time
from nbckpt.bench import Comparison
from nbckpt.bench._ranks import RankStrategy
from nbckpt.bench._strategies import NbckptIncremental

HELPER = Path(__file__).parents[1] / "helpers" / "bench_rank_worker.py"
WRITERS = ["torch-save", "dcp-sync", "nbckpt-async"]
#: Every strategy in its many-rank form but DCP's and nbckpt's best (the 4-rank test runs those).
#: The synthetic state changes every tensor between saves: the incremental one shares nothing in
#: these launches (a shared file's count: the test of one below).
EVERY_FORM = [*WRITERS, "dcp-async", "nbckpt-sync", "nbckpt-incremental"]
SLOW_RANK, SLOW_S = 1, 0.4


def _data_bytes(folder: Path) -> int:
    """The checkpoints' data files under ``folder``: DCP's and nbckpt's shards, torch.save's
    files; each inode once (an incremental save's file shared by hard link with an earlier step)."""
    inodes = {
        (info.st_dev, info.st_ino): info.st_size
        for info in (path.stat() for path in folder.rglob("*") if path.suffix in (".distcp", ".pt"))
        if stat.S_ISREG(info.st_mode)
    }
    return sum(inodes.values())


def _run_bench(tmp_path: Path, ranks: int, slow_s: float, *bench: str) -> tuple[str, dict[str, Any]]:
    """``nbckpt bench`` with the options ``bench`` under torchrun on ``ranks`` gloo ranks, rank
    ``SLOW_RANK``'s saves ``slow_s`` late, checkpoints kept; its stdout and JSON."""
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(HELPER),
        str(SLOW_RANK),
        str(slow_s),
        "bench",
        "--dir",
        str(tmp_path / "ckpt"),
        "--repeats",
        "1",
        "--keep",
        "--quiet",
        "--json",
        str(out),
        *bench,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, json.loads(out.read_text())


def _bench_on_two_ranks(
    tmp_path: Path, *options: str, slow_s: float = 0.0, writers: list[str] = WRITERS
) -> tuple[str, dict[str, Any]]:
    """``nbckpt bench`` under torchrun on 2 gloo ranks, checkpoints kept; its stdout and JSON."""
    schedule = ["--steps", "4", "--every", "2", "--no-warmup"]
    return _run_bench(tmp_path, 2, slow_s, "--strategies", ",".join(writers), *schedule, *options)


def _check_bytes_on_disk(
    tmp_path: Path, rows: dict[tuple[int, str], dict[str, Any]], writers: list[str] = WRITERS
) -> None:
    """Every byte each rank says it wrote is on disk, and nothing else is."""
    for name in writers:
        written = sum(rows[rank, name]["bytes"] for rank in (0, 1))
        assert written == _data_bytes(tmp_path / "ckpt" / name), name


def _check_rate_over_time(
    document: dict[str, Any], rows: dict[tuple[int, str], dict[str, Any]], writers: list[str] = WRITERS
) -> None:
    """Each rank's persists (``rank_timeline``) carry the bytes it wrote, not the state's: the
    report's rate over time, drawn from them, adds up to the bytes on disk (one repeat)."""
    persists = [row for row in document["rank_timeline"] if row["kind"] == "persist"]
    for name in writers:
        for rank in (0, 1):
            wrote = sum(row["bytes"] for row in persists if (row["rank"], row["strategy"]) == (rank, name))
            assert wrote == rows[rank, name]["bytes"], (rank, name)
        rates = rate_over_time(swimlanes(Comparison.from_dict(document), name))
        width = float(rates["start_s"].iloc[1] - rates["start_s"].iloc[0])
        area = float(rates["write_gbs"].sum()) * width * GB
        assert area == pytest.approx(rows[0, name]["bytes"] + rows[1, name]["bytes"], rel=1e-6), name


@pytest.mark.timeout(240)
def test_two_ranks_report_every_rank_the_job_and_the_slowed_rank_as_straggler(tmp_path: Path) -> None:
    options = ["--size-mb", "1", "--compute-ms", "1"]
    stdout, document = _bench_on_two_ranks(tmp_path, *options, slow_s=SLOW_S, writers=EVERY_FORM)
    # Rank 0 alone prints and writes results: one table, one file.
    assert stdout.count("results written to") == 1, stdout
    assert stdout.count("on 2 ranks, 1 host(s)") == 1
    # The job's figures read back, and shown under the table.
    again = Comparison.from_json(tmp_path / "bench.json")
    assert again.job == document["job"] and again.ranks == document["ranks"]
    assert "straggler rank 1" in again.table()
    rows = {(row["rank"], row["strategy"]): row for row in document["ranks"]}
    assert set(rows) == {(rank, name) for rank in (0, 1) for name in ["none", *EVERY_FORM]}
    host = socket.gethostname()
    for name in EVERY_FORM:
        for rank in (0, 1):
            row = rows[rank, name]
            assert row["host"] == host and row["checkpoints"] == 2 and row["stall_s"] > 0
            assert row["bytes"] > 2 * 1024 * 1024  # its own MiB in each of two checkpoints
    _check_bytes_on_disk(tmp_path, rows, EVERY_FORM)
    _check_rate_over_time(document, rows, EVERY_FORM)
    job = document["job"]
    assert job["world_size"] == 2 and job["hosts"] == {host: [0, 1]}
    assert job["floors"]["concurrent_write_gbs"] > 0 and job["floors"]["bytes"] == 2 * 1024 * 1024
    # Host compute: the floor beside training too, a lane taking its turns with the strategies'
    # (none of theirs: no row, nothing kept): every rank's 1 MiB by nbckpt's writer threads at
    # their nice, while that rank trained (the write beside training's steps 3-4 overlap it).
    beside = job["floors"]["beside_training"]
    assert (beside["writer_threads"], beside["writer_nice"]) == (2, 10) and beside["write_gbs"] > 0
    assert [(row["step"], row["ranks_writing"], row["bytes"]) for row in beside["checkpoints"]] == [
        (2, 2, 2 * 1024 * 1024),
        (4, 2, 2 * 1024 * 1024),
    ]
    assert beside["checkpoints"][0]["steps_beside"] >= 1, beside
    assert not (tmp_path / "ckpt" / "raw-write-beside-training").exists()
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
        for row in summary["checkpoints"]:
            assert row["time_to_durable_s"] > 0 and row["aggregate_write_gbs"] > 0
            # The writes alone, the copies left out: the same bytes over no longer a time.
            assert row["aggregate_persist_gbs"] >= row["aggregate_write_gbs"], row
            # In lockstep the slowed rank starts each save with the other, not a turn behind.
            assert row["start_spread_s"] < SLOW_S / 2, summary
    # The bench's own coordination counts each collective's cost once (what the last rank to
    # arrive spent in it): no more than any rank's own time in them. The slowed rank's peer
    # waited for it at the turns' ends, a slowed save's worth and more, which is no cost of the
    # bench's: it is its turn wait.
    coordination, waits = job["coordination"], {row["rank"]: row for row in job["turn_wait"]}
    # Two around the floor write, one before the first turn, one closing each of the lanes' (the
    # baseline's, every strategy's and the floor beside training's) 3 turns (steps 1-2, 3-4, the
    # final checkpoint: a turn starts from the last one's barrier), and the events' gather.
    assert (
        coordination["collectives"] == 2 + 1 + (1 + len(EVERY_FORM) + 1) * 3 + 1
        and coordination["per_step_s"] > 0
    )
    barriers_s = coordination["seconds"] - coordination["gather_s"]
    assert all(barriers_s <= row["collectives_s"] for row in waits.values()), job
    peer = 1 - SLOW_RANK
    assert waits[peer]["seconds"] >= SLOW_S and waits[peer]["seconds"] > waits[SLOW_RANK]["seconds"], job


@pytest.mark.timeout(240)
def test_four_ranks_at_their_best_bytes_on_disk_the_straggler_every_ranks_floors_and_hosts_load(
    tmp_path: Path,
) -> None:
    """4 ranks, DCP at its best (process executor) and nbckpt's overlap: never run under torchrun
    elsewhere in the suite. One checkpoint each, after a warm-up save (DCP spawns its checkpoint
    process there, seconds that differ between ranks more than the slowed rank's delay)."""
    best = ["dcp-async-stager", "nbckpt-async-overlap"]
    options = ["--size-mb", "2", "--compute-ms", "1", "--strategies", ",".join(best), "--steps", "2"]
    _, document = _run_bench(tmp_path, 4, SLOW_S, *options, "--every", "2")
    host, job = socket.gethostname(), document["job"]
    rows = {(row["rank"], row["strategy"]): row for row in document["ranks"]}
    for summary in job["strategies"]:
        if summary["strategy"] not in best:
            continue
        name = summary["strategy"]
        (checkpoint,) = summary["checkpoints"]  # the warm-up save is not recorded
        assert checkpoint["step"] == 2 and checkpoint["ranks_writing"] == 4
        on_disk = sum(
            path.stat().st_size for path in (tmp_path / "ckpt" / name / "step-000002").glob("*.distcp")
        )
        assert sum(rows[rank, name]["bytes"] for rank in range(4)) == checkpoint["bytes"] == on_disk, name
        assert all(rows[rank, name]["bytes"] > 2 * 1024 * 1024 for rank in range(4))  # its own 2 MiB
        late = summary["straggler"]
        assert (late["rank"], late["host"]) == (SLOW_RANK, host), summary
        assert late["over_median_s"] > SLOW_S / 2, summary
    assert {summary["strategy"] for summary in job["strategies"]} >= set(best)
    # Every rank's floors measured in the same run, and its host's load.
    floors = job["floors"]["by_rank"]
    assert [row["rank"] for row in floors] == [0, 1, 2, 3] and all(row["host"] == host for row in floors)
    assert all(row["copy_gbs"] > 0 and row["concurrent_write_gbs"] > 0 for row in floors)
    assert all(row["bytes"] == document["bytes"] for row in floors)
    (load,) = job["load_by_host"].values()
    assert load["ranks"] == [0, 1, 2, 3] and load["cpus"] >= 1 and load["loadavg_1m"] >= 0
    assert load["own_cpu_s"] > 0 and load["other_cpu_cores"] >= 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["replicated", "fsdp"])
def test_a_gpt_replicated_or_sharded_is_written_once_over_the_ranks(tmp_path: Path, form: str) -> None:
    options = ["--preset", "tiny", *(["--fsdp"] if form == "fsdp" else [])]
    _, document = _bench_on_two_ranks(tmp_path, *options)
    rows = {(row["rank"], row["strategy"]): row for row in document["ranks"]}
    _check_bytes_on_disk(tmp_path, rows)
    state = document["bytes"]  # one checkpoint of the whole model and optimizer
    if form == "replicated":  # torch.save of the replicated state on rank 0 alone
        assert rows[1, "torch-save"]["bytes"] == 0 < rows[0, "torch-save"]["bytes"]
    else:  # under FSDP each rank torch.saves its shard
        assert all(0.4 * state < rows[rank, "torch-save"]["bytes"] / 2 < 0.6 * state for rank in (0, 1))
    for name in ("dcp-sync", "nbckpt-async"):  # each rank writes a part, the parts add up to one state
        assert all(0 < rows[rank, name]["bytes"] < 2 * state for rank in (0, 1))
        (summary,) = [row for row in document["job"]["strategies"] if row["strategy"] == name]
        assert all(state <= row["bytes"] < 1.05 * state for row in summary["checkpoints"])
    _check_rate_over_time(document, rows)  # replicated: about twice the bytes before


def test_a_file_shared_by_hard_link_counts_once_at_the_step_that_wrote_it(tmp_path: Path) -> None:
    """What a rank "wrote" of an incremental save: its new files only. The 2-rank launch's
    synthetic state changes every tensor at every step (nothing shared there), so the files of
    a rank's two steps are made here as the engine shares them: one file hard-linked."""
    job = SimpleNamespace(rank=1, replicated=True, dcp_group=None)
    strategy = RankStrategy(NbckptIncremental(), job)  # type: ignore[arg-type]
    strategy.path = str(tmp_path)
    for step in ("step-000002", "step-000004"):
        (tmp_path / step).mkdir()
    (tmp_path / "step-000002" / "__1_0.distcp").write_bytes(b"f" * 1000)  # frozen: shared later
    (tmp_path / "step-000002" / "__1_1.distcp").write_bytes(b"t" * 10)
    (tmp_path / "step-000002" / "__0_0.distcp").write_bytes(b"o" * 7)  # another rank's
    os.link(tmp_path / "step-000002" / "__1_0.distcp", tmp_path / "step-000004" / "__1_0.distcp")
    (tmp_path / "step-000004" / "__1_1.distcp").write_bytes(b"T" * 10)
    assert [strategy.written(2), strategy.written(4)] == [1010, 10]
    assert strategy.written(2) == 0  # measured once: counted already
    assert _data_bytes(tmp_path) == 1010 + 10 + 7  # what is on disk, each inode once
    assert strategy.written(6) is None  # no such checkpoint


def test_fsdp_outside_torchrun_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "--fsdp", "--dir", str(tmp_path)]) == 2
    assert "--fsdp shards the model over the ranks of torchrun" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
