"""The ``nbckpt`` command line, end to end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from nbckpt import bench as ex
from nbckpt import cli
from nbckpt.bench import _internal

SMALL_RUN = ["--size-mb", "2", "--compute-ms", "1", "--steps", "4", "--every", "2"]


def test_bench_prints_a_table_and_writes_json(tmp_path: Any) -> None:
    out = tmp_path / "bench.json"
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbckpt",
            "bench",
            "--dir",
            str(directory),
            *SMALL_RUN,
            "--strategies",
            "none,torch-save,nbckpt-async",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    for expected in (
        "strategy",
        "none",
        "torch-save",
        "nbckpt-async",
        "floors for 2.1 MB",
        "stall s",
        "save stall s",
        "wait for the earlier save s",
        "95 % interval",
        "per repeat",
        "rests on",
        ex.OVERHEAD_DEFINITION,
        ex.STALL_DEFINITION,
        "load during the runs",
        f"results written to {out}",
    ):
        assert expected in table
    # progress lines: strategy, repeat, step, the stall in its parts, elapsed and expected time
    progress = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("[torch-save] repeat 2/3, step 2/4: stall ")
    ]
    assert len(progress) == 1, proc.stderr
    assert "= save stall" in progress[0] and "+ wait for the earlier save" in progress[0]
    assert "elapsed of about" in progress[0]
    assert "repeat 2/3: torch-save, nbckpt-async, none" in proc.stderr  # interleaved, rotated
    document = json.loads(out.read_text())
    assert document["schema"] == "nbckpt.bench/3"
    assert document["bytes"] == 2 << 20
    assert (document["steps"], document["every"], document["repeats"]) == (4, 2, _internal.DEFAULT_REPEATS)
    assert set(document["floors"]) >= {"bytes", "copy_s", "copy_gbs", "write_gbs", "write_gbs_by_streams"}
    assert [r["strategy"] for r in document["results"]] == ["none", "torch-save", "nbckpt-async"]
    for row in document["results"]:
        assert list(row) == _internal.RESULT_COLUMNS
        lo, hi = row["overhead_ci_pct"]
        assert lo <= row["overhead_pct"] <= hi
    load = document["load"]
    assert load["cpus"] >= 1 and load["other_cpu_cores"] >= 0 and 0 <= load["steal_pct"] <= 100
    assert isinstance(load["high"], bool) and isinstance(document["warnings"], list)
    assert {e["kind"] for e in document["timeline"]} >= {"step", "stall", "persist", "commit"}
    assert set(document["environment"]) >= {"python", "torch", "nbckpt", "cpus", "time_utc"}
    assert document["environment"]["torch_threads"] == 1
    assert len(document["runs"]) == 3 * _internal.DEFAULT_REPEATS
    # The runs' checkpoints are removed, and the directory the bench made for them (also as root,
    # under / : a reviewer's --dir /nonexistent/deep/x was left behind, empty).
    assert not directory.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]


@pytest.mark.parametrize("started_as", ["nbckpt", "python -m nbckpt"])
def test_a_strategy_that_spawns_a_process_runs_from_the_command_line(tmp_path: Path, started_as: str) -> None:
    """dcp-async-stager's checkpoint process re-imports the main module: the command must not
    run again in it (it did, and the child's second bench found the directory locked)."""
    script = str(Path(sys.executable).with_name("nbckpt"))
    command = [script] if started_as == "nbckpt" else [sys.executable, "-m", "nbckpt"]
    proc = subprocess.run(
        [
            *command,
            "bench",
            "--dir",
            str(tmp_path / "ckpt"),
            *SMALL_RUN,
            "--strategies",
            "dcp-async-stager",
            "--repeats",
            "1",
            "--threads",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("repeat 1/1:") == 1, proc.stderr[-3000:]
    assert "dcp-async-stager" in proc.stdout


def test_version_and_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    from nbckpt import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"nbckpt {__version__}"
    for command in ("bench", "probe", "report"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert "``" not in text and ":func:" not in text, command  # no reST markup
        options = [line for line in text.splitlines() if line.lstrip().startswith("--")]
        assert options, command
    bench = cli.build_parser()._subparsers._group_actions[0].choices["bench"]  # type: ignore[union-attr]
    helps = {action.dest: action.help or "" for action in bench._actions if action.dest != "help"}
    undocumented = [dest for dest, text in helps.items() if "default" not in text]
    assert not undocumented, f"bench options without their default: {undocumented}"


def test_the_bench_runs_the_strategies_the_docs_call_default() -> None:
    from nbckpt.bench._internal import STRATEGIES

    args = cli.build_parser().parse_args(["bench"])
    assert args.strategies.split(",") == _internal.DEFAULT_STRATEGIES
    assert set(_internal.DEFAULT_STRATEGIES) == set(STRATEGIES)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "none,fast"], "unknown strategy 'fast'"),
        (["--steps", "-3"], "steps must be a positive integer, not -3"),
        (["--every", "0"], "every must be a positive integer"),
        (["--preset", "small", "--size-mb", "4"], "give --preset or --size-mb, not both"),
        (["--preset", "giant"], "unknown preset 'giant'"),
        (["--device", "tpu"], "device must be 'cpu' or 'cuda'"),
        (["--repeats", "0"], "--repeats must be a positive integer"),
        (["--threads", "0"], "--threads must be a positive integer"),
        (["--idle-compute"], "--idle-compute stands in for the synthetic state's compute"),
        (
            ["--idle-compute", "--size-mb", "2", "--compute-ms", "0"],
            "give --size-mb and --compute-ms above 0",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    directory = tmp_path / "ckpt"
    out = tmp_path / "out.json"
    code = cli.main(["bench", "--dir", str(directory), "--json", str(out), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nbckpt bench: error: ")
    assert message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ranks", [[], ["--ranks", "1,2"]], ids=["one-process", "sweep"])
def test_unwritable_directory_is_refused(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], ranks: list[str]
) -> None:
    """The sweep refuses it too before torchrun starts (one line, not a rank's death in its text)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = cli.main(["bench", "--dir", str(blocker / "ckpt"), *SMALL_RUN, *ranks])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--dir {blocker / 'ckpt'} is not writable" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_an_object_store_that_cannot_be_reached_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The floors' first write fails: the client's error in one line naming the target and the
    endpoint, not its 150-line traceback. What the client says varies (connection refused; in the
    whole suite, once "bucket 'nowhere' does not exist": a port held and never listened on can
    still be taken by a server that sets SO_REUSEADDR), so the cause is not read."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    endpoint = f"http://127.0.0.1:{held.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries, and s3fs's: 12 s to say the same
    monkeypatch.setattr(pytest.importorskip("s3fs").S3FileSystem, "retries", 1)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nbckpt")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nbckpt")
    with held:
        code = cli.main(["bench", "--dir", "s3://nowhere/run", *SMALL_RUN, "--strategies", "nbckpt-async"])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    said = f"nbckpt bench: error: writing to s3://nowhere/run (endpoint {endpoint}) failed: "
    assert err[-1].startswith(said) and len(err[-1]) > len(said), err[-3:]
    assert "Traceback" not in "\n".join(err)


def test_json_into_a_missing_directory_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(
        [
            "bench",
            "--dir",
            str(tmp_path / "ckpt"),
            *SMALL_RUN,
            "--json",
            str(tmp_path / "missing" / "out.json"),
        ]
    )
    assert code == 2
    assert "does not exist or is not writable" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_ls_lists_the_runs_set_aside_inside_a_run_and_reads_them_by_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from nbckpt import Checkpointer

    run = tmp_path / "run"
    with Checkpointer(run, mode="sync") as ckpt:
        for step in (10, 20, 30):
            ckpt.save({"w": torch.full((2,), float(step))}, step=step)
        ckpt.restore({"w": torch.zeros(2)}, step=10)
        with pytest.warns(UserWarning, match="set-aside-1"):
            ckpt.save({"w": torch.ones(2)}, step=11)
    assert cli.main(["ls", str(run)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing[1:3]] == ["10", "11"]
    assert listing[3:] == [f"set aside after step 10: steps 20, 30 in {run / 'set-aside-1'}"]
    assert cli.main(["ls", str(run / "set-aside-1")]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["20", "30"]


def test_ls_show_verify_and_export_read_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from nbckpt import Checkpointer

    model = torch.nn.Linear(4, 3)
    with Checkpointer(tmp_path / "run") as ckpt:  # still open: the readers take no lock
        for step in (10, 20):
            ckpt.save({"model": model, "args": {"lr": 0.1}, "step": step}, step=step).wait()
        assert cli.main(["ls", str(tmp_path / "run")]) == 0
        listing = capsys.readouterr().out.splitlines()
        assert [line.split()[0] for line in listing[1:]] == ["10", "20"]
        assert cli.main(["show", str(tmp_path / "run"), "20"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert shown["step"] == 20 and shown["state"]["args"] == {"lr": 0.1}
        assert shown["state"]["model"]["weight"] == "tensor float32 [3, 4]"
        assert shown["provenance"]["torch"] == torch.__version__
        assert cli.main(["verify", str(tmp_path / "run")]) == 0
        assert capsys.readouterr().out.splitlines() == ["step 10: ok", "step 20: ok"]
        out = tmp_path / "model.pt"
        assert cli.main(["export", str(tmp_path / "run" / "step-000020"), str(out)]) == 0
        plain = torch.load(out, weights_only=True)
        assert torch.equal(plain["model"]["weight"], model.weight) and plain["args"] == {"lr": 0.1}
    data = next((tmp_path / "run" / "step-000010").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-100] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert cli.main(["verify", str(tmp_path / "run")]) == 1
    assert "step 10: step-000010/__0_0.distcp is corrupt" in capsys.readouterr().out


def test_diff_lists_what_an_optimizer_step_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from nbckpt import Checkpointer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        ckpt.save({"model": model, "counter": torch.tensor([1, 2]), "step": 1}, step=1)
        before = {name: t.detach().double().clone() for name, t in model.state_dict().items()}
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        ckpt.save({"model": model, "counter": torch.tensor([1, 2]), "step": 2}, step=2)
    run = str(tmp_path / "run")
    assert cli.main(["diff", run, "1", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"step 1 -> step 2 of {tmp_path / 'run'}: 3 tensors (2 changed, 1 unchanged)"
    assert lines[1].split()[:3] == ["key", "status", "dtype"]
    assert [line.split()[1] for line in lines[2:]] == ["changed", "changed", "unchanged"]
    assert lines[-1].split()[0] == "counter"

    assert cli.main(["diff", run, "1", "2", "--top", "1", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert (document["a"], document["b"], document["tensors"]) == (1, 2, 3)
    assert document["counts"] == {"changed": 2, "unchanged": 1}
    moved = {name: float((t.double() - before[name]).norm()) for name, t in model.state_dict().items()}
    most = max(moved, key=lambda name: moved[name] / float(before[name].norm()))
    [row] = document["rows"]
    assert row["key"] == f"model.{most}" and row["status"] == "changed"
    assert row["diff_norm"] == pytest.approx(moved[most], rel=1e-9)
    assert row["rel_change"] == pytest.approx(moved[most] / float(before[most].norm()), rel=1e-9)
    assert cli.main(["diff", run, "1", "2", "--top", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[-1]["key"] == "counter" and rows[-1]["cosine"] is None  # integers: no cosine, null

    assert cli.main(["diff", run, "1", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbckpt diff: error: no committed checkpoint for step 7") and err.count("\n") == 1


def test_idle_compute_reaches_the_benchs_workload(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench.json"
    run = ["--size-mb", "1", "--compute-ms", "2", "--steps", "2", "--every", "1", "--repeats", "1"]
    options = ["--idle-compute", "--strategies", "none", "--quiet", "--json", str(out)]
    code = cli.main(["bench", "--dir", str(tmp_path / "ckpt"), *run, *options])
    assert code == 0, capsys.readouterr().err
    workload = json.loads(out.read_text())["workload"]
    assert "2 ms per step of device compute, the host idle through it" in workload
