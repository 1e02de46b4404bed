"""nbckpt.report: the report notebook runs under papermill and renders to offline HTML."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from nbckpt import ConfigError, NbckptError
from nbckpt.report import EXTERNAL_LOAD, conclusions, export_html, parse_value, run_report

# The smallest run that still has every section: a baseline, a sync and an async strategy.
SMALL = {
    "preset": "tiny",
    "strategies": "none,torch-save,nbckpt-async",
    "steps": 4,
    "every": 2,
    "probe_mb": 4,
    "probe_streams": "1,2",
    "title": "test report",
    "torch_threads": 1,
}


def _results(stall: float = 0.01, torch_stall: float = 0.5) -> pd.DataFrame:
    nan = math.nan
    rows = [
        {"strategy": "none", "stall_mean_s": 0.0, "stall_p95_s": 0.0, "overhead_pct": 0.0,
         "persist_s": nan, "write_gbs": nan},
        {"strategy": "torch-save", "stall_mean_s": torch_stall, "stall_p95_s": torch_stall,
         "overhead_pct": 40.0, "persist_s": torch_stall, "write_gbs": 0.2},
        {"strategy": "nbckpt-async", "stall_mean_s": stall, "stall_p95_s": 2 * stall,
         "overhead_pct": 2.0, "persist_s": 0.4, "write_gbs": 0.25, "checkpoints": 2},
    ]
    return pd.DataFrame(rows)


FLOORS = {"bytes": 100e6, "copy_s": 0.005, "write_gbs": 0.5}


def test_report_renders_offline_html_and_results(tmp_path: Path) -> None:
    """One run of the report (the slow part), checked three ways."""
    report = run_report("small", tmp_path / "out", {**SMALL, "target": str(tmp_path / "ckpt")})
    _check_html_content(report)
    _check_offline(report)
    _check_results_json(report)


def _check_html_content(report: Path) -> None:
    html = report.read_text()
    assert report.name == "small.html"
    assert html.count('class="plotly-graph-div"') >= 5  # probe, timeline, throughput, stall, advice
    assert "window.Plotly = Plotly" in html  # plotly.js itself is inline
    assert re.search(r'<table[^>]*class="[^"]*nbckpt-results', html)
    for strategy in ("torch-save", "nbckpt-async"):
        assert f"<td>{strategy}</td>" in html
    assert "stalled the training loop" in html
    assert "<title>test report</title>" in html
    assert "def as_list" not in html  # code is left out


def _check_offline(report: Path) -> None:
    html = report.read_text()
    assert not EXTERNAL_LOAD.search(html), EXTERNAL_LOAD.search(html)
    assert not re.search(r'src="https?://', html)
    # plotly.js mentions cdn.plot.ly inside its own source (a map-data default), never as a load
    assert not re.search(r'<script[^>]+cdn\.plot\.ly', html)
    assert "mathjax" not in " ".join(re.findall(r"<script[^>]*>", html)).lower()


def _check_results_json(report: Path) -> None:
    results = json.loads((report.parent / "results.json").read_text())
    assert results["schema"] == "nbckpt.report/1"
    measured = {row["strategy"]: row for row in results["comparison"]["results"]}
    assert set(measured) == {"none", "torch-save", "nbckpt-async"}
    assert measured["nbckpt-async"]["checkpoints"] == 2
    assert results["comparison"]["floors"]["copy_s"] > 0
    assert results["storage"]["runs"] and results["advice"]
    assert results["conclusions"][0].startswith("nbckpt-async stalled the training loop")
    # the conclusions quote the measured stall
    stall_ms = measured["nbckpt-async"]["stall_mean_s"] * 1e3
    assert f"{stall_ms:.1f} ms" in results["conclusions"][0]
    assert results["parameters"]["steps"] == 4
    assert not (report.parent / "results.json.partial").exists()


def test_conclusions_follow_the_numbers() -> None:
    lines = conclusions(_results(stall=0.01, torch_stall=0.5), FLOORS)
    assert lines[0] == (
        "nbckpt-async stalled the training loop 10.0 ms per checkpoint of 100.0 MB (p95 20.0 ms), "
        "50.0x less than torch-save (500.0 ms)."
    )
    assert lines[1].startswith("That stall is 2.0x the copy floor (5.0 ms")
    assert "50% of the raw fsync'd write bandwidth of the target (0.50 GB/s)" in lines[2]
    assert any("reaches the published '10x or more'" in line for line in lines)

    timeline = pd.DataFrame([
        {"strategy": "nbckpt-async", "repeat": 0, "kind": kind, "duration_s": duration}
        for kind, duration in (("stage", 0.004), ("stage", 0.002), ("wait", 0.003), ("step", 1.0))
    ])
    split = conclusions(_results(stall=0.01), {**FLOORS, "copy_s": 0.001}, timeline=timeline)
    assert "the copy into the staging buffers took 3.0 ms and waiting for the previous save " \
        "1.5 ms; the other 5.5 ms" in split[1]

    slower = conclusions(_results(stall=1.0, torch_stall=0.5), FLOORS)
    assert "2.0x more than torch-save" in slower[0]
    assert any("falls short of the published" in line for line in slower)


def test_conclusions_leave_out_what_was_not_measured() -> None:
    only_async = _results()[lambda df: df["strategy"] == "nbckpt-async"]
    lines = conclusions(only_async, {"bytes": 1e6, "copy_s": math.nan, "write_gbs": None})
    assert len(lines) == 1 and "torch-save" not in lines[0]
    none = conclusions(_results()[lambda df: df["strategy"] != "nbckpt-async"], FLOORS)
    assert none[0].startswith("No asynchronous nbckpt strategy was measured")


def test_conclusions_state_the_advisor_numbers() -> None:
    from nbckpt import advisor

    results = _results()
    advice = advisor.advise(results, mtbf_hours=1000.0, gpus=64)
    lines = conclusions(results, FLOORS, advice=advice)
    row = advice.set_index("strategy").loc["nbckpt-async"]
    assert f"every {row['interval_s']:.0f} s" in lines[-1]
    assert f"{row['waste_pct']:.2f}% of the time" in lines[-1]


def test_parse_value() -> None:
    assert parse_value("12") == 12
    assert parse_value("0.5") == 0.5
    assert parse_value("true") is True
    assert parse_value("null") is None
    assert parse_value("none,nbckpt-async") == "none,nbckpt-async"
    assert parse_value("/mnt/fb") == "/mnt/fb"


def test_unknown_parameter_is_refused_before_running(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown report parameter.*stepz"):
        run_report("x", tmp_path, {"stepz": 3})
    assert not list(tmp_path.iterdir())


def test_bad_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plain file name"):
        run_report("../x", tmp_path)


def test_export_refuses_html_that_would_load_from_a_cdn(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [nbformat.v4.new_output(
        "display_data", data={"text/html": '<script src="https://cdn.example.com/x.js"></script>'}
    )]
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    with pytest.raises(NbckptError, match="would load from the network"):
        export_html(path)


def test_cli_failing_notebook_gives_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = subprocess.run(
        [sys.executable, "-m", "nbckpt", "report", "--name", "bad", "--output-dir",
         str(tmp_path / "out"), "-p", "target", str(blocker / "ckpt"), "-p", "steps", "2"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nbckpt report: error: report.ipynb failed in cell")
    assert str(blocker / "ckpt") in last
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "bad.html").exists()
