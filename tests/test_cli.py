"""The ``nbckpt`` command line, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from nbckpt import __main__ as cli
from nbckpt import experiment as ex

SMALL_RUN = ["--size-mb", "2", "--compute-ms", "1", "--steps", "4", "--every", "2"]


def test_bench_prints_a_table_and_writes_json(tmp_path: Any) -> None:
    out = tmp_path / "bench.json"
    directory = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-m", "nbckpt", "bench", "--dir", str(directory), *SMALL_RUN,
         "--strategies", "none,torch-save,nbckpt-async", "--threads", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    for expected in ("strategy", "none", "torch-save", "nbckpt-async", "floors for 2.1 MB",
                     "stall_mean_s", f"results written to {out}"):
        assert expected in table
    assert "[torch-save] step 2/4: checkpoint stalled" in proc.stderr  # progress lines
    document = json.loads(out.read_text())
    assert document["schema"] == "nbckpt.bench/1"
    assert document["bytes"] == 2 << 20
    assert (document["steps"], document["every"], document["repeats"]) == (4, 2, 1)
    assert set(document["floors"]) >= {"bytes", "copy_s", "copy_gbs", "write_gbs"}
    assert [r["strategy"] for r in document["results"]] == ["none", "torch-save", "nbckpt-async"]
    for row in document["results"]:
        assert list(row) == ex.RESULT_COLUMNS
    assert {e["kind"] for e in document["timeline"]} >= {"step", "stall", "persist", "commit"}
    assert set(document["environment"]) >= {"python", "torch", "nbckpt", "cpus", "time_utc"}
    assert document["environment"]["torch_threads"] == 1
    assert os.listdir(directory) == []  # checkpoints of the runs are cleaned up


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


def test_unwritable_directory_is_refused(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = cli.main(["bench", "--dir", str(blocker / "ckpt"), *SMALL_RUN])
    assert code == 2
    err = capsys.readouterr().err
    assert f"--dir {blocker / 'ckpt'} is not writable" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_json_into_a_missing_directory_is_refused(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["bench", "--dir", str(tmp_path / "ckpt"), *SMALL_RUN,
                     "--json", str(tmp_path / "missing" / "out.json")])
    assert code == 2
    assert "does not exist or is not writable" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
