"""nbckpt.report: the report notebook runs under papermill and renders to offline HTML."""

from __future__ import annotations

import contextlib
import html
import io
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import ROOT
from helpers.jupyterlab import ARTIFACTS, CHROMIUM, chromium_page

from nbckpt import ConfigError, NbckptError
from nbckpt._util import parse_value
from nbckpt.notebook._report import (
    EXTERNAL_LOAD,
    REPORT_NOTEBOOK,
    _check_parameters,
    export_html,
    run_report,
)

#: Runs measured on 1 and 2 ranks under torchrun (tests/data/README.md): the report's scaling section.
RUNS = ",".join(
    str(ROOT / "tests" / "data" / name) for name in ("bench_job_1rank.json", "bench_job_2ranks.json")
)

# The smallest run that still has every section: a baseline, sync and async strategies (DCP's
# too: without a process group torch warns on each of their saves, a stderr box in the report).
SMALL = {
    "preset": "tiny",
    "strategies": "none,torch-save,dcp-sync,dcp-async,nbckpt-async",
    "steps": 4,
    "every": 2,
    "probe_mb": 4,
    "probe_streams": "1,2",
    "title": "test report",
    "torch_threads": 1,
    "repeats": 2,
    "scaling_from": RUNS,
}

STRATEGIES = SMALL["strategies"].split(",")
#: The report's run is the slow part: one per test worker, for the tests in its group.
REPORT_GROUP = pytest.mark.xdist_group("report")


@dataclass
class SmallReport:
    html: Path
    progress: str  # what nbckpt report printed on stderr as it went


@pytest.fixture(scope="module")
def small_report(tmp_path_factory: pytest.TempPathFactory) -> SmallReport:
    tmp_path = tmp_path_factory.mktemp("report")
    progress = io.StringIO()
    with contextlib.redirect_stderr(progress):
        report = run_report(
            "small", tmp_path / "out", {**SMALL, "target": str(tmp_path / "ckpt")}, progress=True
        )
    return SmallReport(report, progress.getvalue())


@REPORT_GROUP
def test_report_renders_offline_html_and_results(small_report: SmallReport, ip: Any) -> None:
    """One run of the report (the slow part), checked five ways."""
    report = small_report.html
    _check_progress(small_report.progress)
    assert not (report.parent / ".small.progress").exists()
    _check_html_content(report)
    _check_no_stderr(report.with_suffix(".ipynb"))
    _check_offline(report)
    _check_results_json(report)
    _check_same_figures(report, ip)


@REPORT_GROUP
@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium")
def test_report_fits_a_1280_px_page_in_chromium(small_report: SmallReport) -> None:
    """The report's HTML in Chromium, 1,280 px wide: no table runs past the page's right edge,
    no output is a stderr box, and the overhead chart's y-axis title is not cut off."""
    with chromium_page("report-1280-failed.png", width=1280, height=900) as page:
        page.goto(small_report.html.as_uri())
        page.locator(".js-plotly-plot .ytitle").first.wait_for(timeout=60_000)
        page_width = page.evaluate("document.documentElement.clientWidth")
        tables = page.evaluate(
            "() => [...document.querySelectorAll('table')].map(t => [t.className, "
            "Math.ceil(t.getBoundingClientRect().right)])"
        )
        assert tables and all(right <= page_width for _, right in tables), (page_width, tables)
        stderr = page.locator('[data-mime-type="application/vnd.jupyter.stderr"]')
        assert stderr.count() == 0, stderr.all_inner_texts()
        overhead = page.locator(".js-plotly-plot", has_text="Overhead against training")
        chart, title = (
            overhead.locator(selector).first.bounding_box() for selector in ("svg.main-svg", ".ytitle")
        )
        assert chart is not None and title is not None
        assert chart["x"] <= title["x"] and chart["y"] <= title["y"]
        assert title["y"] + title["height"] <= chart["y"] + chart["height"], (title, chart)
        page.screenshot(path=str(ARTIFACTS / "report-1280.png"), full_page=True)


def _check_progress(err: str) -> None:
    """What the report does, as it does it: not one papermill cell for minutes."""
    lines = err.splitlines()
    assert lines[0].startswith("report: running report.ipynb")
    assert any(line.startswith("report: probing ") for line in lines)
    checkpoint = [line for line in lines if line.startswith("[torch-save] repeat 2/2, step 2/4: stall ")]
    assert len(checkpoint) == 1, err
    assert "= save stall" in checkpoint[0] and "elapsed of about" in checkpoint[0]
    assert any(line.startswith("[nbckpt-async] repeat 1/2 done: mean step") for line in lines)
    assert lines.index(checkpoint[0]) < lines.index("report: writing results.json")


def _check_html_content(report: Path) -> None:
    html = report.read_text()
    assert report.name == "small.html"
    # probe, overhead, timeline, throughput, stall, interval advice, the measured scaling
    assert html.count('class="plotly-graph-div"') >= 7
    assert "Measured scaling</strong>, measured on 1 to 2 ranks" in html
    assert "The advice with the costs measured on 2 ranks on 1 host" in html
    assert "window.Plotly = Plotly" in html  # plotly.js itself is inline
    assert re.search(r'<table[^>]*class="[^"]*nbckpt-results', html)
    for strategy in ("torch-save", "nbckpt-async"):
        assert f"<td>{strategy}</td>" in html
    assert "95 % interval" in html and "paired per checkpoint cycle" in html
    assert "wait for the earlier save" in html and "How overhead and its interval are computed" in html
    assert "stall (the time the training loop was blocked)" in html
    assert "Assuming a job of 1,024 GPUs" in html  # the advisor's assumptions, named
    assert "10x or more" not in html and "cannot go faster" not in html
    assert "<title>test report</title>" in html
    assert "def as_list" not in html  # code is left out
    # the notebook's note to whoever opens it is not the report's first paragraph
    assert "Run it with" not in html and "Every number below is measured in this run" in html
    # the published figures: each source's description once, however many figures it gives
    from nbckpt.analysis import published_table

    published = published_table()
    for what in published["what"].unique():
        assert html.count(escape(what, quote=False)) == 1, what


def _check_no_stderr(executed: Path) -> None:
    """No cell wrote to stderr (torch's warnings, say): the report would show a pink box."""
    nb = nbformat.read(str(executed), as_version=4)
    written = [
        output.get("text", "")
        for cell in nb.cells
        for output in cell.get("outputs", [])
        if output.get("name") == "stderr"
    ]
    assert not written, written


def _check_offline(report: Path) -> None:
    html = report.read_text()
    assert not EXTERNAL_LOAD.search(html), EXTERNAL_LOAD.search(html)
    assert not re.search(r'src="https?://', html)
    # plotly.js mentions cdn.plot.ly inside its own source (a map-data default), never as a load
    assert not re.search(r"<script[^>]+cdn\.plot\.ly", html)
    assert "mathjax" not in " ".join(re.findall(r"<script[^>]*>", html)).lower()


def _check_results_json(report: Path) -> None:
    results = json.loads((report.parent / "results.json").read_text())
    assert results["schema"] == "nbckpt.report/3"
    measured = {row["strategy"]: row for row in results["comparison"]["results"]}
    assert set(measured) == set(STRATEGIES)
    assert measured["nbckpt-async"]["checkpoints"] == 2  # per run, in each of the repeats
    assert measured["nbckpt-async"]["repeats"] == results["parameters"]["repeats"] == 2
    assert len(measured["nbckpt-async"]["overhead_ci_pct"]) == 2
    assert results["comparison"]["schema"] == "nbckpt.bench/3" and "load" in results["comparison"]
    assert results["comparison"]["floors"]["copy_s"] > 0
    assert results["storage"]["runs"] and results["advice"]
    assert results["assumptions"]["gpus"] == 1024
    assert {row["ranks"] for row in results["scaling"]} == {1, 2} and results["scaling_advice"]
    assert any(line.startswith("nbckpt-async's stall (the time") for line in results["conclusions"])
    # the conclusions quote the measured stall
    stall_ms = measured["nbckpt-async"]["stall_mean_s"] * 1e3
    assert any(f"{stall_ms:.1f} ms" in line for line in results["conclusions"])
    assert results["parameters"]["steps"] == 4
    assert not (report.parent / "results.json.partial").exists()
    _check_decision(results, report.read_text())


def _check_decision(results: dict[str, Any], html_text: str) -> None:
    """Issue 29: the report ends in a decision, and each comparison it states is one the overhead
    intervals of its own table show (the advisor once said 'loses 45.3 GPU-hours a day more'
    against overlapping intervals)."""
    decision = results["decision"]
    rows = {row["strategy"]: row for row in results["comparison"]["results"]}
    assert decision["strategy"] in ("nbckpt-sync", "nbckpt-async", "nbckpt-async-overlap")
    low, high = rows[decision["strategy"]]["overhead_ci_pct"]
    assert set(decision["versus"]) == set(rows) - {"none", decision["strategy"]}
    for other, said in decision["versus"].items():
        other_low, other_high = rows[other]["overhead_ci_pct"]
        shown = (
            "measurably less"
            if high < other_low
            else "measurably more"
            if low > other_high
            else "no measurable difference"
        )
        assert said == shown, (other, said, shown)
    least = min((n for n in rows if n.startswith("nbckpt-")), key=lambda n: float(rows[n]["overhead_pct"]))
    if decision["strategy"] != least:  # kept only where the table cannot tell it from the least
        assert not low > rows[least]["overhead_ci_pct"][1]
    advised = {row["strategy"]: row for row in results["advice"]}[decision["strategy"]]
    assert decision["interval_s"] == advised["interval_s"]
    assert decision["every_steps"] >= decision["apart_steps"] >= 1
    assert decision["host_bytes"] == (results["comparison"]["bytes"] if decision["mode"] == "async" else 0)
    code = decision["code"]
    assert f'mode="{decision["mode"]}"' in code and "ckpt.due()" in code and "SaveSchedule(" in code
    shown = html.unescape(re.sub(r"<[^>]+>", "", html_text))  # the code is highlighted, span by span
    assert "Your decision" in shown and all(line in shown for line in code.splitlines())


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


def test_a_number_given_for_a_list_parameter_arrives_as_its_text() -> None:
    """A review: ``-p probe_streams 1`` failed in cell 3 with "TypeError: 'int' object is not
    iterable" (parse_value makes it the number 1, the notebook splits text at commas); the
    notebook's text parameters now get a number as its text, its number parameters stay numbers."""
    given = {key: parse_value(value) for key, value in (("probe_streams", "1"), ("steps", "2"))}
    params = _check_parameters(REPORT_NOTEBOOK, {**given, "scaling_ranks": 2, "strategies": ["none"]})
    assert params == {"probe_streams": "1", "steps": 2, "scaling_ranks": "2", "strategies": ["none"]}


def test_bad_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="plain file name"):
        run_report("../x", tmp_path)


def test_export_refuses_html_that_would_load_from_a_cdn(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output(
            "display_data", data={"text/html": '<script src="https://cdn.example.com/x.js"></script>'}
        )
    ]
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    with pytest.raises(NbckptError, match="would load from the network"):
        export_html(path)


def test_cli_failing_notebook_gives_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbckpt",
            "report",
            "--name",
            "bad",
            "--output-dir",
            str(tmp_path / "out"),
            "-p",
            "target",
            str(blocker / "ckpt"),
            "-p",
            "steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("nbckpt report: error: report.ipynb failed in cell")
    assert str(blocker / "ckpt") in last
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "bad.html").exists()


def _figures(row: dict[str, object]) -> list[str]:
    """The figures every face shows for a row, as the one formatter writes them."""
    from nbckpt.bench import _internal as bench

    return [
        bench.overhead_text(row),
        bench.interval_text(row["overhead_ci_pct"]),  # type: ignore[arg-type]
        bench.per_repeat_text(row),
        str(row["overhead_basis"]),
        *(f"{float(row[key]):.4f}" for key in ("stall_mean_s", "save_stall_s", "wait_s")),
    ]  # type: ignore[arg-type]


def _check_same_figures(report: Path, shell: Any) -> None:
    """The run the report measured, as each face shows it: the table ``nbckpt bench`` prints,
    the one ``%ckpt_bench`` displays for a Comparison, the Lab's and the report's have the same
    overhead, interval, per-repeat overheads, what it rests on, and the stall with its parts."""
    from nbckpt import bench
    from nbckpt.notebook import Lab

    document = json.loads((report.parent / "results.json").read_text())["comparison"]
    comparison = bench.Comparison.from_dict(document)
    rows = {r["strategy"]: r for r in comparison.results.to_dict(orient="records")}
    expected = {name: _figures(row) for name, row in rows.items() if name != "none"}
    # nbckpt bench prints the table of the comparison it measured (cli._bench; test_cli runs it)
    printed = comparison.table()
    magic = shell.display_formatter.format(comparison)[0]["text/plain"]
    lab = Lab(directory=str(report.parent / "lab"), preset="synthetic", size_mb=2.0)
    try:
        lab.show(comparison)
        lab_html = lab.results.value
    finally:
        lab.close()
    faces = {"nbckpt bench": printed, "%ckpt_bench": magic, "Lab": lab_html, "report": report.read_text()}
    for face, text in faces.items():
        for name, figures in expected.items():
            table_rows = text.split("</tr>") if "<tr" in text else text.splitlines()
            line = next(
                (row for row in table_rows if row.strip().startswith(f"{name} ") or f">{name}</td>" in row),
                "",
            )
            for figure in figures:
                assert html.escape(figure) in line or figure in line, (face, name, figure, line[:400])
    # one set of headers: every face names the columns as format_results does
    headers = list(bench.format_results(comparison.results).columns)
    for header in (
        "overhead",
        "95 % interval",
        "per repeat",
        "rests on",
        "stall s",
        "save stall s",
        "wait for the earlier save s",
    ):
        assert header in headers and all(header in text for text in faces.values()), header


@REPORT_GROUP
def test_the_report_notebook_run_with_its_defaults_writes_no_results_json(tmp_path: Path) -> None:
    """Issue 29 defect 4: opened in the Lab and run with its defaults, report.ipynb replaced
    ``reports/results.json`` under a report.html that still says its numbers are there. Run from a
    copy (so its default paths land in ``tmp_path``), it writes nothing outside its checkpoints."""
    import papermill

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    shutil.copy(REPORT_NOTEBOOK, notebooks / "report.ipynb")
    small = {**SMALL, "strategies": "none,nbckpt-async", "probe_streams": "1", "probe_mb": 1}
    papermill.execute_notebook(
        str(notebooks / "report.ipynb"),
        str(tmp_path / "executed.ipynb"),
        parameters=small,
        kernel_name="python3",
        cwd=str(notebooks),
        progress_bar=False,
        store_widget_state=False,
    )
    assert not (tmp_path / "reports").exists()
    assert sorted(p.name for p in notebooks.iterdir()) == ["report.ipynb"]
    shown = (tmp_path / "executed.ipynb").read_text()
    assert "no `results.json` written" in shown


def test_the_report_ends_in_its_decision() -> None:
    """Issue 29: the report's last section is "Your decision", and it computes it (a code cell)."""
    cells = nbformat.read(str(REPORT_NOTEBOOK), as_version=4).cells
    headings = [i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## ")]
    assert cells[headings[-1]].source.startswith("## Your decision")
    assert any("decide(" in c.source for c in cells[headings[-1] :] if c.cell_type == "code")
