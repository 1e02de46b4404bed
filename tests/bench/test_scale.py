"""``nbckpt bench --ranks 1,2``: the sweep that launches torchrun per size (``nbckpt.bench._sweep``).

Real torchrun, gloo, a 1 MiB state per rank, one strategy: each test earns its time. The sweep's
end is reached at a defined point through its seam (a stderr line of the ranks), never a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.s3server import KEY, SECRET, SeaweedS3
from helpers.sync import ctrl_c_raises

from nbckpt import bench, cli
from nbckpt._errors import ConfigError
from nbckpt.bench._internal import ComparisonInterrupted
from nbckpt.bench._launch import RankLaunch, arm_launch_seam, run_local_ranks
from nbckpt.bench._ranks import HOST_VARIABLE
from nbckpt.bench._sweep import arm_sweep_seam, parse_ranks, passthrough
from tests.helpers.ranks import RankProcess, finish_all, free_port, torchrun_two

# A checkpoint of the first run that saves: every rank is inside the bench's turns.
IN_A_TURN = "[nbckpt-async] repeat 1/1, step 1/"


def _bench(tmp_path: Path) -> list[str]:
    """A small bench: 1 MiB per rank, one strategy, two checkpoints, one repeat."""
    return [
        "bench",
        "--dir",
        str(tmp_path / "ckpt"),
        "--size-mb",
        "1",
        "--compute-ms",
        "1",
        "--strategies",
        "nbckpt-async",
        "--steps",
        "2",
        "--every",
        "1",
        "--repeats",
        "1",
        "--no-warmup",
    ]


def _options(tmp_path: Path, ranks: str) -> list[str]:
    return [*_bench(tmp_path), "--ranks", ranks, "--json", str(tmp_path / "scaling.json")]


@pytest.fixture
def seam() -> Iterator[None]:
    yield
    arm_sweep_seam(None)
    arm_launch_seam(None)


def _running(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.mark.timeout(240)
def test_a_sweep_over_1_and_2_ranks_writes_one_table_and_one_json_of_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(_options(tmp_path, "1,2")) == 0
    out = capsys.readouterr().out
    assert out.count("results written to") == 1 and "x floor" in out
    document = json.loads((tmp_path / "scaling.json").read_text())
    assert document["schema"] == "nbckpt.bench.scaling/1" and document["sizes"] == [1, 2]
    assert "--ranks" not in document["options"] and "--size-mb" in document["options"]
    for run, size in zip(document["runs"], (1, 2), strict=True):
        # Each size's own JSON kept beside the sweep's, and held in it.
        assert run["json"] == str(tmp_path / f"scaling.ranks-{size}.json")
        assert json.loads(Path(run["json"]).read_text()) == run["document"]
        job = run["document"]["job"]
        assert job["world_size"] == size and sum(len(ranks) for ranks in job["hosts"].values()) == size
        # The bench's own barriers and gather, timed outside the lanes: there, and per step trained.
        assert job["coordination"]["seconds"] > 0 and job["coordination"]["per_step_s"] > 0
    rows = {(row["ranks"], row["strategy"]): row for row in document["scaling"]}
    assert set(rows) == {(1, "nbckpt-async"), (2, "nbckpt-async")}
    for row in rows.values():
        assert row["aggregate_write_gbs"] > 0 and row["concurrent_floor_gbs"] > 0
        assert row["stall_median_s"] > 0 and row["stall_p99_s"] >= row["stall_median_s"]
        assert row["vs_floor"] == pytest.approx(row["aggregate_write_gbs"] / row["concurrent_floor_gbs"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("end", ["interrupt", "terminate", "rank-dies"])
def test_ctrl_c_sigterm_or_a_dying_rank_ends_every_process_and_a_dead_rank_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seam: None, end: str
) -> None:
    noted: list[psutil.Process] = []

    def at_a_turn(line: str, torchrun: subprocess.Popen[str]) -> None:
        if IN_A_TURN not in line or noted:
            return
        noted.extend(psutil.Process(torchrun.pid).children(recursive=True))
        noted.append(psutil.Process(torchrun.pid))
        if end == "interrupt":
            raise KeyboardInterrupt  # as Ctrl-C in the sweep's terminal
        if end == "terminate":  # as a scheduler's SIGTERM to the sweep (torchrun has a session of its own)
            assert signal.getsignal(signal.SIGTERM) is not before, "SIGTERM would end the sweep alone"
            os.kill(os.getpid(), signal.SIGTERM)
            return
        (rank1,) = [
            worker
            for worker in psutil.Process(torchrun.pid).children()
            if worker.environ().get("RANK") == "1"
        ]
        rank1.send_signal(signal.SIGKILL)

    def pressed_again(point: str, launch: RankLaunch) -> None:
        if point == "ending":  # Ctrl-C again while torchrun ends its ranks: it kills them at once
            raise KeyboardInterrupt

    arm_sweep_seam(at_a_turn)
    arm_launch_seam(pressed_again)
    before = signal.getsignal(signal.SIGTERM)
    code = cli.main(_options(tmp_path, "2"))
    err = capsys.readouterr().err
    assert len(noted) >= 3, err[-2000:]  # torchrun and its 2 ranks at least
    assert _running(noted) == []
    if end == "interrupt":
        assert code == 130 and "nbckpt bench: interrupted" in err
    elif end == "terminate":
        assert code == 128 + signal.SIGTERM and "nbckpt bench: interrupted by SIGTERM" in err
        assert signal.getsignal(signal.SIGTERM) is before  # the handler before restored
    else:
        assert code == 2
        # The sweep's own line ends its stderr (rank 0 may have printed its own error before).
        line = err.rstrip().splitlines()[-1]
        assert line.startswith("nbckpt bench: error: rank 1 of 2 died (exit code -9: SIGKILL)"), err[-3000:]
    assert not (tmp_path / "scaling.json").exists()
    assert not (tmp_path / "ckpt").exists()  # the sweep made it: removed as it was ended


@pytest.mark.timeout(120)
def test_a_ctrl_c_as_torchrun_starts_ends_it_before_any_rank_runs(tmp_path: Path, seam: None) -> None:
    """A Ctrl-C between torchrun's start and the moment its launch is held (%ckpt_bench --ranks 2
    at once interrupted) is raised once the launch can be ended: torchrun ends, nothing is left."""
    started: list[psutil.Process] = []

    def press(point: str, launch: RankLaunch) -> None:
        if point == "started":
            started.append(psutil.Process(launch.proc.pid))
            signal.raise_signal(signal.SIGINT)  # a real SIGINT, handled where Python chooses

    arm_launch_seam(press)
    with ctrl_c_raises(), pytest.raises(ComparisonInterrupted) as raised:
        run_local_ranks(2, _bench(tmp_path)[1:], str(tmp_path / "ckpt"), on_event=print, on_line=print)
    assert str(raised.value) == "the run on 2 ranks was interrupted; every rank has ended"
    assert len(started) == 1 and _running(started) == [] and not (tmp_path / "ckpt").exists()


def test_rank_counts_and_the_options_passed_through() -> None:
    assert parse_ranks("1,2,4") == [1, 2, 4]
    for bad in ("", "0,1", "1,1", "two"):
        with pytest.raises(ValueError, match="--ranks wants distinct rank counts"):
            parse_ranks(bad)
    args = cli.build_parser().parse_args(
        ["bench", "--ranks", "1,2", "--size-mb", "2", "--no-warmup", "--json", "x.json", "--fsdp"]
    )
    argv = passthrough(args)
    assert "--ranks" not in argv and "--json" not in argv
    assert argv[argv.index("--size-mb") + 1] == "2.0" and "--no-warmup" in argv and "--fsdp" in argv
    # What is passed parses back to the same options.
    again = cli.build_parser().parse_args(["bench", *argv])
    assert {**vars(again), "ranks": "1,2", "json": "x.json"} == vars(args)


def test_sweep_from_python_refuses_an_option_the_bench_has_not_and_a_json_going_nowhere(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError, match="sweep\\(\\) takes no option dir, json, size_gb"):
        bench.sweep([1, 2], str(tmp_path), size_gb=1, json="x.json", dir="y")
    with pytest.raises(ConfigError, match="give a file name in an existing directory"):
        bench.sweep([1, 2], str(tmp_path), json_path=str(tmp_path / "nowhere" / "x.json"), size_mb=1)
    assert list(tmp_path.iterdir()) == []  # refused before any rank started


def test_the_sweep_refuses_a_bad_bench_option_or_rank_count_in_one_line_before_torchrun_starts(
    tmp_path: Path, seam: None, capfd: pytest.CaptureFixture[str]
) -> None:
    """A review: ``sweep([1], d, size_mb=-1)`` started torchrun, printed its ChildFailedError and
    raised "rank 0 of 1 died ... size_mb must be a positive number" (``strategies="nope"`` the
    same), and ``sweep(2, d)`` raised "TypeError: 'int' object is not iterable". The bench's own
    checks now run before any launch, in one line; rank counts from Python are named ``ranks``."""
    launched: list[str] = []
    arm_launch_seam(lambda point, launch: launched.append(point))
    refused = [
        ([1], {"size_mb": -1}, r"size_mb must be a positive number, not -1"),
        ([1], {"strategies": "nope"}, r"unknown strategy 'nope'; choose from none, "),
        ([1], {"repeats": 0}, r"--repeats must be a positive integer, not 0"),
        (2, {}, r"ranks wants distinct rank counts >= 1 in a list \(\[1, 2, 4\]\), not 2"),
        ([0, 1], {}, r"ranks wants distinct rank counts >= 1 in a list \(\[1, 2, 4\]\), not \[0, 1\]"),
    ]
    for ranks, options, message in refused:
        with pytest.raises(ConfigError, match=f"^{message}") as raised:
            bench.sweep(ranks, str(tmp_path / "ckpt"), **options)
        assert "\n" not in str(raised.value)
    # nbckpt bench --ranks goes through the same checks
    assert cli.main([*_options(tmp_path, "1"), "--size-mb", "-1"]) == 2
    err = capfd.readouterr().err
    assert err == "nbckpt bench: error: size_mb must be a positive number, not -1.0\n", err
    assert launched == [] and list(tmp_path.iterdir()) == []  # no torchrun, no directory made


@pytest.mark.timeout(240)
def test_two_agents_as_two_hosts_name_both_and_group_the_ranks_by_host(tmp_path: Path) -> None:
    """Two torchrun agents (--nnodes 2, one rank each) told apart by NBCKPT_BENCH_HOST."""
    out = tmp_path / "job.json"
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        RankProcess.start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                endpoint,
                "--rdzv-id",
                "two-hosts",
                "--nproc-per-node",
                "1",
                "-m",
                "nbckpt",
                *_bench(tmp_path),
                "--quiet",
                "--json",
                str(out),
            ],
            {**os.environ, "OMP_NUM_THREADS": "1", HOST_VARIABLE: f"host-{node}"},
        )
        for node in (0, 1)
    ]
    try:
        for code, _, err in finish_all(agents, timeout=200):
            assert code == 0, err[-3000:]
    finally:
        for agent in agents:
            agent.kill()
    document = json.loads(out.read_text())
    job = document["job"]
    # Which agent's rank is 0 is the rendezvous' choice; each host holds one rank either way.
    assert set(job["hosts"]) == {"host-0", "host-1"} and job["world_size"] == 2
    assert sorted(rank for ranks in job["hosts"].values() for rank in ranks) == [0, 1]
    hosts = {rank: host for host, ranks in job["hosts"].items() for rank in ranks}
    assert {(row["rank"], row["host"]) for row in document["ranks"]} == set(hosts.items())
    (summary,) = [row for row in job["strategies"] if row["strategy"] == "nbckpt-async"]
    assert [row["ranks_writing"] for row in summary["checkpoints"]] == [2, 2]
    assert summary["straggler"]["host"] == hosts[summary["straggler"]["rank"]]
    # Each host's load, from its own rank; each rank's floors, under its host.
    assert {host: load["ranks"] for host, load in job["load_by_host"].items()} == job["hosts"]
    assert {(row["rank"], row["host"]) for row in job["floors"]["by_rank"]} == set(hosts.items())
    # The same file renders offline: a swimlane per rank named by its host, hosts in order.
    assert cli.main(["report", "--from", str(out), "--output-dir", str(tmp_path / "html")]) == 0
    page = (tmp_path / "html" / "report.html").read_text()
    lanes = [
        json.dumps(f"{host} · rank {rank}") for rank, host in sorted(hosts.items(), key=lambda item: item[1])
    ]
    assert "2 ranks on 2 host(s)" in page and 0 < page.index(lanes[0]) < page.index(lanes[1]), lanes


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
@pytest.mark.timeout(240)
def test_two_ranks_write_to_s3_and_their_bytes_add_up_to_the_objects(
    tmp_path: Path, s3_server: SeaweedS3
) -> None:
    bucket = f"nbckpt-{uuid.uuid4().hex[:10]}"
    s3_server.make_bucket(bucket)
    target = f"s3://{bucket}/bench"
    out = tmp_path / "job.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "AWS_ENDPOINT_URL": s3_server.endpoint_url,
        "AWS_ACCESS_KEY_ID": KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET,
    }
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "nbckpt",
        *_bench(tmp_path),
        "--dir",
        target,
        "--strategies",
        "torch-save,dcp-sync,nbckpt-sync,nbckpt-async",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    # Skipped with one line each, as in one process: they write local files only.
    for name in ("torch-save", "dcp-sync"):
        assert done.stderr.count(f"skipping {name}: it writes local files only") == 1, done.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = {(row["rank"], row["strategy"]): row for row in document["ranks"]}
    assert {name for _, name in rows} == {"none", "nbckpt-sync", "nbckpt-async"}
    files = s3_server.filesystem()
    for name in ("nbckpt-sync", "nbckpt-async"):
        objects = files.find(f"{bucket}/bench", detail=True)
        data = sum(
            info["size"] for path, info in objects.items() if f"/{name}/" in path and path.endswith(".distcp")
        )
        assert all(rows[rank, name]["bytes"] > 1024 * 1024 for rank in (0, 1))  # 2 x 1 MiB each
        assert rows[0, name]["bytes"] + rows[1, name]["bytes"] == data, name
        (summary,) = [row for row in document["job"]["strategies"] if row["strategy"] == name]
        assert [row["ranks_writing"] for row in summary["checkpoints"]] == [2, 2]
        assert summary["aggregate_write_gbs"] > 0
    assert document["job"]["floors"]["concurrent_write_gbs"] > 0


RESTORER = Path(__file__).parents[1] / "helpers" / "bench_restore_worker.py"
#: Each rank's shard in the form its users save it: torch.save a file per rank, DCP's and nbckpt's.
SHARDED_SAVES = ("torch-save", "dcp-sync", "nbckpt-async")


@pytest.mark.timeout(300)
def test_the_sharded_workloads_kept_checkpoints_restore_bit_exactly_on_the_same_ranks(tmp_path: Path) -> None:
    out, folder = tmp_path / "job.json", tmp_path / "ckpt"
    bench_then_restore = [str(RESTORER), str(out), str(folder), "bench", "--dir", str(folder)]
    bench_then_restore += ["--preset", "tiny", "--fsdp", "--keep", "--strategies", ",".join(SHARDED_SAVES)]
    bench_then_restore += ["--steps", "4", "--every", "2", "--repeats", "1", "--no-warmup", "--quiet"]
    printed = torchrun_two(*bench_then_restore, "--json", str(out))
    kept = json.loads(out.read_text())["job"]["kept"]
    # Each rank's last checkpoint of each strategy, every tensor it holds digested.
    assert sorted((row["rank"], row["strategy"], row["step"]) for row in kept) == [
        (rank, name, 4) for rank in (0, 1) for name in sorted(SHARDED_SAVES)
    ]
    shards = {row["rank"]: row["digests"] for row in kept if row["strategy"] == "nbckpt-async"}
    assert shards[0].keys() == shards[1].keys() and shards[0] != shards[1]  # each rank its own 1/2
    lines = [json.loads(line) for line in printed.splitlines() if line.startswith('{"rank"')]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        for name in SHARDED_SAVES:
            assert line["checked"][name] > 10 and line["differ"][name] == [], line
