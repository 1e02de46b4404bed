"""``nbckpt report --from``: the offline HTML report of benches measured elsewhere, measuring nothing."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import ROOT

from nbckpt import cli
from nbckpt.notebook._report import EXTERNAL_LOAD

DATA = ROOT / "tests" / "data"
ONE, TWO = DATA / "bench_job_1rank.json", DATA / "bench_job_2ranks.json"
WORKER = ROOT / "tests" / "helpers" / "bench_rank_worker.py"
PLOTLY_JS = "plotly.js v"  # the bundle's licence header: plotly.js is in the page itself


def _report(capsys: pytest.CaptureFixture[str], out: Path, *sources: Path) -> str:
    code = cli.main(["report", "--from", *map(str, sources), "--output-dir", str(out), "--name", "job"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    page = out / "job.html"
    assert captured.out.strip() == f"wrote {page}"
    return page.read_text()


@pytest.mark.timeout(240)
def test_compare_under_torchrun_runs_in_lockstep_and_its_json_renders_every_rank_and_the_straggler(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``nbckpt.bench.compare()`` called on every rank of a torchrun (a user's script), rank 1's
    saves made 0.3 s late: the bench on many ranks, as ``nbckpt bench`` there."""
    result = tmp_path / "bench.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += [str(WORKER), "1", "0.3", "compare", str(tmp_path / "ckpt"), str(result)]
    done = subprocess.run(
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # Rank 0's comparison carries every rank's figures and the job's; rank 1's is its own.
    lines = sorted(
        (json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"rank"')), key=str
    )
    assert lines == [{"rank": 0, "job": True, "ranks": 4}, {"rank": 1, "job": False, "ranks": 0}], done.stdout
    (summary,) = [
        row for row in json.loads(result.read_text())["job"]["strategies"] if row["strategy"] != "none"
    ]
    assert [row["ranks_writing"] for row in summary["checkpoints"]] == [2, 2]  # every rank wrote each
    events = json.loads(result.read_text())["rank_timeline"]  # rank 0 gathered every rank's events
    assert {(row["rank"], row["kind"]) for row in events} >= {
        (rank, kind) for rank in (0, 1) for kind in ("step", "stall", "stage", "persist", "commit")
    }
    page = _report(capsys, tmp_path / "out", result)
    assert PLOTLY_JS in page and not EXTERNAL_LOAD.search(page)
    host = socket.gethostname()
    for rank in (0, 1):
        assert json.dumps(f"{host} · rank {rank}") in page  # its swimlane (in the figure's JSON)
    assert f"straggler rank 1 on {host}" in page
    # The stall distribution over ranks: a point per rank, the slowed rank 1 starred.
    (stalls,) = [data for data, layout in _figures(page) if _title(layout).startswith("Stall per checkpoint")]
    (points,) = [trace for trace in stalls if trace["type"] == "scatter" and trace["name"] == "nbckpt-async"]
    assert points["hovertext"] == [f"rank 0 on {host}", f"rank 1 on {host} (straggler)"]
    assert points["marker"]["symbol"] == ["circle", "star"]
    assert "Measured scaling" not in page  # one rank count: no curve
    # The aggregate write rate over time, drawn from every rank's persists: there, with data.
    (rates,) = [
        data for data, layout in _figures(page) if _title(layout).startswith("Aggregate write rate over")
    ]
    (trace,) = [trace for trace in rates if trace["name"] == "nbckpt-async"]
    assert len(_values(trace["x"])) > 1 and max(_values(trace["y"])) > 0
    # Every rank's floors and its host's load, measured in the same run.
    assert "Floors every rank measured at once, and the load of every host" in page
    assert page.count("copy floor GB/s") == 1 and "1-minute load average" in page


def _figures(page: str) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """Every plotly figure of the page: its traces and its layout (the JSON of each newPlot)."""
    decoder, figures, call = json.JSONDecoder(), [], "Plotly.newPlot("
    at = page.find(call)
    while at >= 0:
        start = page.index("[", at)
        data, end = decoder.raw_decode(page, start)
        layout, _ = decoder.raw_decode(page, page.index("{", end))
        figures.append((data, layout))
        at = page.find(call, end)
    return figures


def _title(layout: dict[str, Any]) -> str:
    title = layout.get("title") or {}
    return str(title.get("text", "") if isinstance(title, dict) else title)


def _values(array: Any) -> list[float]:
    """A trace's numbers: a list, or plotly's typed array (``{"dtype", "bdata"}``, base64)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return [float(value) for value in array]


def test_runs_of_one_and_two_ranks_give_the_measured_scaling_curve(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = _report(capsys, tmp_path, TWO, ONE)
    assert "Measured scaling" in page and "Measured on 1, 2 ranks (no projection beyond)" in page
    assert "measured on 1 to 2 ranks: aggregate write" in page
    assert page.count(PLOTLY_JS) == 1  # inlined once, for every figure
    assert "1 ranks on 1 host(s)" in page and "2 ranks on 1 host(s)" in page


def test_the_jobs_table_shows_its_intervals_over_repeats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run of several repeats carries a 95 % interval of its time to durable and aggregate
    rate: the report's job table and its sentences show them; one repeat's show the median alone."""
    document = json.loads(TWO.read_text())
    (summary, *_) = [row for row in document["job"]["strategies"] if row["checkpoints"]]
    summary["time_to_durable_ci_s"], summary["aggregate_write_ci_gbs"] = [0.0123, 0.0456], [0.111, 0.999]
    repeated = tmp_path / "repeated.json"
    repeated.write_text(json.dumps(document))
    page = _report(capsys, tmp_path / "out", repeated)
    assert "time to durable s [95 % over repeats]" in page
    assert f"{summary['time_to_durable_s']:.3f} [0.012, 0.046]" in page
    assert f"{summary['aggregate_write_gbs']:.2f} [0.11, 1.00]" in page
    assert "95 % over repeats 0.11-1.00 GB/s" in page
    assert "over repeats 0." not in _report(capsys, tmp_path / "one", TWO)


def test_a_sweeps_file_renders_as_its_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``nbckpt bench --ranks 1,2`` writes one file of both sizes: it gives the same curve."""
    runs = [
        {"ranks": size, "json": "", "document": json.loads(path.read_text())}
        for size, path in ((1, ONE), (2, TWO))
    ]
    sweep = tmp_path / "scaling.json"
    sweep.write_text(json.dumps({"schema": "nbckpt.bench.scaling/1", "sizes": [1, 2], "runs": runs}))
    page = _report(capsys, tmp_path / "out", sweep)
    assert "Measured on 1, 2 ranks (no projection beyond)" in page
    assert f"{sweep} (1 ranks)" in page and f"{sweep} (2 ranks)" in page  # each size's section names it


def test_runs_that_are_not_one_curve_are_one_line_exit_2_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``--ranks 1,2`` sweep beside a 2-rank run of another workload, or of the same one: the
    curve would mix them, or drop one of the 2-rank points; refused naming both."""
    runs = [
        {"ranks": size, "json": "", "document": json.loads(path.read_text())}
        for size, path in ((1, ONE), (2, TWO))
    ]
    sweep = tmp_path / "scaling.json"
    sweep.write_text(json.dumps({"schema": "nbckpt.bench.scaling/1", "sizes": [1, 2], "runs": runs}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(TWO.read_text()), "workload": "synthetic-4MiB: 4.2 MB"}))
    out = tmp_path / "out"
    for second, message in (
        (other, f"{sweep} (1 ranks) and {other} are not one scaling curve: workload "),
        (TWO, f"{sweep} (2 ranks) and {TWO} both ran on 2 ranks"),
    ):
        code = cli.main(["report", "--from", str(sweep), str(second), "--output-dir", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, err
    assert not out.exists()


def _not_a_bench(folder: Path) -> Path:
    path = folder / "other.json"
    path.write_text(json.dumps({"schema": "something/1"}))
    return path


def _one_process(folder: Path) -> Path:
    document = json.loads(TWO.read_text())
    for key in ("ranks", "job", "rank_timeline"):
        del document[key]
    path = folder / "one_process.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda folder: folder / "missing.json", "missing.json: no such file"),
        (_not_a_bench, "other.json: not a bench result (schema 'something/1', not nbckpt.bench/3)"),
        (_one_process, "one_process.json: a one-process bench result"),
    ],
    ids=["missing", "not-a-bench", "one-process"],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], Path], message: str
) -> None:
    bad = make(tmp_path)
    out = tmp_path / "out"
    code = cli.main(["report", "--from", str(TWO), str(bad), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("nbckpt report: error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_from_takes_no_notebook_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = ["--output-dir", str(tmp_path / "o")]
    code = cli.main(["report", "--from", str(TWO), "-p", "preset", "tiny", *out])
    assert code == 2 and "takes no -p or --notebook" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
