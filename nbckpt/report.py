"""``nbckpt report``: run the report notebook with papermill and render it as offline HTML.

    nbckpt report --name report                       # reports/report.html + reports/results.json
    nbckpt report -p target /mnt/flashblade/ckpt -p preset small -p steps 40

The notebook (``notebooks/report.ipynb``) measures and writes ``results.json`` into
``output_dir``; this module executes it, turns a failing cell into a one-line error
and exports the outputs (no code) to a single HTML file that works without a network:
plotly.js is inlined once and nothing is loaded from a CDN.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError, NbckptError

if TYPE_CHECKING:
    import pandas as pd

REPORT_NOTEBOOK = "report.ipynb"
RESULTS_FILE = "results.json"
#: Parameters that name local paths: relative values are taken from the caller's directory,
#: not from the notebook's (papermill runs the kernel in the notebook's folder).
PATH_PARAMETERS = ("target", "output_dir")

# The lab template without the scripts it would fetch from CDNs (require.js, MathJax,
# mermaid, the widget manager): the report uses none of them.
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
# plotly's notebook renderer adds a MathJax <script src=CDN> to every figure; the figures
# use no LaTeX, so the tag is dropped rather than fetched.
_MATHJAX_TAG = re.compile(r'<script src="https?://[^"]*mathjax[^"]*"></script>', re.IGNORECASE)
#: Anything the HTML would load from the network (what the offline check looks for).
EXTERNAL_LOAD = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""",
                           re.IGNORECASE)


def notebooks_dir() -> Path:
    """The checkout's ``notebooks/`` folder (the report ships with the source tree)."""
    return Path(__file__).resolve().parent.parent / "notebooks"


def parse_value(text: str) -> Any:
    """A ``-p KEY VALUE`` value: JSON where it parses (numbers, true/false, null, lists), else text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def run_report(
    name: str = "report",
    output_dir: str | os.PathLike[str] = "reports",
    parameters: Mapping[str, Any] | None = None,
    *,
    notebook: str | os.PathLike[str] | None = None,
    kernel_name: str = "python3",
    progress: bool = False,
) -> Path:
    """Execute the report notebook and write ``<output_dir>/<name>.html``; return its path.

    The executed notebook is kept as ``<name>.ipynb`` and the notebook writes
    ``results.json`` beside the HTML. A failing cell raises :class:`NbckptError`
    naming the error; no HTML is written then.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    if not name or Path(name).name != name or name.startswith("."):
        raise ConfigError(f"report name must be a plain file name, not {name!r}")
    source = Path(notebook) if notebook is not None else notebooks_dir() / REPORT_NOTEBOOK
    if not source.is_file():
        raise ConfigError(f"report notebook {source} not found (run from a source checkout)")
    out = Path(output_dir).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output directory {out} cannot be created ({exc.strerror})") from exc
    if not os.access(out, os.W_OK):
        raise ConfigError(f"output directory {out} is not writable")

    params = _check_parameters(source, dict(parameters or {}))
    params["output_dir"] = str(out)
    html_path = out / f"{name}.html"
    executed = out / f"{name}.ipynb"
    for stale in (html_path, out / RESULTS_FILE):
        stale.unlink(missing_ok=True)  # a failed run must not leave an older report looking new

    started = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(source),
            str(executed),
            parameters=params,
            kernel_name=kernel_name,
            cwd=str(source.parent),
            progress_bar=progress,
            store_widget_state=False,
        )
    except PapermillExecutionError as exc:
        evalue = (exc.evalue or "").strip().splitlines()
        detail = evalue[0] if evalue else "(no message)"
        raise NbckptError(
            f"{source.name} failed in cell {exc.exec_count}: {exc.ename}: {detail} "
            f"(executed notebook: {executed})"
        ) from None
    html_path.write_text(export_html(executed), encoding="utf-8")
    if progress:
        print(f"wrote {html_path} in {time.perf_counter() - started:.1f} s")
    return html_path


def _check_parameters(source: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Refuse names the notebook does not declare; resolve relative local paths against cwd."""
    import papermill

    known = papermill.inspect_notebook(str(source))
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown report parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    for key in PATH_PARAMETERS:
        value = params.get(key)
        if isinstance(value, str) and value and "://" not in value:
            params[key] = str(Path(value).expanduser().resolve())
    return params


def export_html(executed: str | os.PathLike[str]) -> str:
    """Outputs only (no code), plotly.js inline, no CDN scripts: one self-contained HTML page."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    nb = nbformat.read(os.fspath(executed), as_version=4)  # type: ignore[no-untyped-call]
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            html = output.get("data", {}).get("text/html")
            if isinstance(html, str):
                output["data"]["text/html"] = _MATHJAX_TAG.sub("", html)
    exporter = HTMLExporter(  # type: ignore[no-untyped-call]
        template_name="lab",
        extra_loaders=[DictLoader({"nbckpt_offline.html.j2": _OFFLINE_TEMPLATE})],
        template_file="nbckpt_offline.html.j2",
        exclude_input=True,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    title = nb.metadata.get("papermill", {}).get("parameters", {}).get("title") or "nbckpt report"
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": str(title)}})
    external = EXTERNAL_LOAD.search(body)
    if external:
        raise NbckptError(f"report HTML would load from the network: {external.group(0)[:80]}")
    return str(body)


def _num(value: Any) -> float:
    """A measured number as float; NaN where it was not measured (None, NaN, text)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def _finite(value: Any) -> bool:
    return not math.isnan(_num(value))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _times(factor: float) -> str:
    return f"{factor:.1f}x" if factor < 100 else f"{factor:.0f}x"


def conclusions(
    results: pd.DataFrame,
    floors: Mapping[str, Any],
    *,
    advice: pd.DataFrame | None = None,
    timeline: pd.DataFrame | None = None,
    published: Mapping[str, Any] | None = None,
) -> list[str]:
    """Sentences stating what the measurements show, each computed from the numbers given.

    ``results`` has ``Comparison.results``' columns, ``floors`` the keys of ``Floors.to_dict()``
    (``bytes``, ``copy_s``, ``write_gbs``), ``advice`` those of :func:`nbckpt.advisor.advise`,
    ``timeline`` those of ``Comparison.timeline`` (to split the stall into copy and wait).
    A sentence whose inputs were not measured is left out.
    """
    from .reference import published_value

    rows = {str(row["strategy"]): row for row in results.to_dict(orient="records")}
    focus = next((name for name in ("nbckpt-async", "nbckpt-async-overlap") if name in rows), None)
    if focus is None:
        return ["No asynchronous nbckpt strategy was measured, so there is nothing to conclude "
                "about asynchronous checkpointing; add nbckpt-async to the strategies."]
    row = rows[focus]
    stall = float(row["stall_mean_s"])
    torch_save = rows.get("torch-save")
    size_mb = _num(floors.get("bytes")) / 1e6
    lines = []

    text = (f"{focus} stalled the training loop {_ms(stall)} per checkpoint of {size_mb:.1f} MB "
            f"(p95 {_ms(float(row['stall_p95_s']))})")
    reduction = math.nan
    if torch_save is not None and _finite(torch_save["stall_mean_s"]) and stall > 0:
        reduction = float(torch_save["stall_mean_s"]) / stall
        if reduction >= 1:
            text += f", {_times(reduction)} less than torch-save ({_ms(torch_save['stall_mean_s'])})"
        else:
            text += (f", {_times(1 / reduction)} more than torch-save "
                     f"({_ms(torch_save['stall_mean_s'])}): here the synchronous write was "
                     f"cheaper than the asynchronous stall")
    lines.append(text + ".")

    copy_s = _num(floors.get("copy_s"))
    if copy_s > 0 and stall > 0:
        ratio = stall / copy_s
        text = (f"That stall is {_times(ratio)} the copy floor ({_ms(copy_s)} to copy the "
                f"same bytes into preallocated memory)")
        if ratio <= 1.5:
            text += ": the loop waits for little more than the copy itself."
        else:
            text += "."
            parts = _stall_parts(timeline, focus, _num(row.get("checkpoints")))
            if parts is not None:
                stage, wait = parts
                text += (f" Per checkpoint the copy into the staging buffers took {_ms(stage)} "
                         f"and waiting for the previous save {_ms(wait)}; the other "
                         f"{_ms(max(stall - stage - wait, 0.0))} was spent elsewhere in save().")
        lines.append(text)

    write_floor = _num(floors.get("write_gbs"))
    if _finite(row["write_gbs"]) and write_floor > 0:
        lines.append(
            f"Its background writes ran at {float(row['write_gbs']):.2f} GB/s, "
            f"{100 * float(row['write_gbs']) / write_floor:.0f}% of the raw fsync'd write "
            f"bandwidth of the target ({write_floor:.2f} GB/s), taking "
            f"{_ms(float(row['persist_s']))} per checkpoint while training went on."
        )

    if torch_save is not None and _finite(row["overhead_pct"]) and _finite(torch_save["overhead_pct"]):
        mine, theirs = _num(row["overhead_pct"]), _num(torch_save["overhead_pct"])
        text = (f"Against training without checkpoints, the mean step changed by {mine:+.1f}% "
                f"with {focus} and {theirs:+.1f}% with torch-save")
        if min(mine, theirs) < 0:
            text += (": a negative overhead means that run was faster than the baseline, so the "
                     "run-to-run noise on this machine was larger than the checkpoint cost; "
                     "use more steps or repeats")
        lines.append(text + ".")

    dcp_async = rows.get("dcp-async")
    if dcp_async is not None and _num(dcp_async["stall_mean_s"]) > 0:
        share = stall / float(dcp_async["stall_mean_s"])
        lines.append(
            f"PyTorch's own dcp.async_save (default settings) stalled "
            f"{_ms(float(dcp_async['stall_mean_s']))} per checkpoint; {focus} stalled "
            f"{share:.2f}x of that."
        )

    overlap = rows.get("nbckpt-async-overlap")
    if focus == "nbckpt-async" and overlap is not None and _finite(overlap["stall_mean_s"]):
        lines.append(
            f"With overlap=True the save returns before the copy and the loop waits only "
            f"before its next optimizer update: {_ms(float(overlap['stall_mean_s']))} per "
            f"checkpoint."
        )

    if _finite(reduction):
        reference = dict(published) if published is not None else None
        pure = float(published_value("pure_storage_flashblade", "reduction_factor", reference))
        ibm = float(published_value("pytorch_ibm_7b", "reduction_factor", reference))
        verdict = "reaches" if reduction >= pure else "falls short of"
        lines.append(
            f"The measured reduction against torch-save, {_times(reduction)}, {verdict} the "
            f"published '{pure:g}x or more' (Pure Storage) and is "
            f"{'above' if reduction >= ibm else 'below'} PyTorch/IBM's {ibm:g}x for a 7B model; "
            f"published figures come from GPUs and multi-GB checkpoints, where the synchronous "
            f"write dominates more than it does for {size_mb:.1f} MB here."
        )

    if advice is not None and not advice.empty:
        by_name = {str(r["strategy"]): r for r in advice.to_dict(orient="records")}
        best = by_name.get(focus)
        if best is not None:
            text = (
                f"With a job MTBF of {float(best['cluster_mtbf_h']):.1f} h the advisor puts a "
                f"{focus} checkpoint every {float(best['interval_s']):.0f} s, losing "
                f"{float(best['waste_pct']):.2f}% of the time "
                f"({float(best['gpu_hours_lost_per_day']):.1f} GPU-hours a day)"
            )
            slow = by_name.get("torch-save")
            if slow is not None:
                saved = float(slow["gpu_hours_lost_per_day"]) - float(best["gpu_hours_lost_per_day"])
                text += (
                    f"; torch-save every {float(slow['interval_s']):.0f} s loses "
                    f"{float(slow['waste_pct']):.2f}%, {abs(saved):.1f} GPU-hours a day "
                    f"{'more' if saved >= 0 else 'less'}"
                )
            lines.append(text + ".")
    return lines


def _stall_parts(
    timeline: pd.DataFrame | None, strategy: str, checkpoints: float
) -> tuple[float, float] | None:
    """Mean staging and backpressure-wait seconds per checkpoint of ``strategy`` (None: unknown)."""
    if timeline is None or timeline.empty or not checkpoints > 0:
        return None
    events = timeline[timeline["strategy"] == strategy] if "strategy" in timeline else timeline
    stage = events.loc[events["kind"] == "stage", "duration_s"]
    if stage.empty:
        return None
    wait = events.loc[events["kind"] == "wait", "duration_s"]
    return float(stage.sum()) / checkpoints, float(wait.sum()) / checkpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", default="report", help="file name of the report (default: report)")
    parser.add_argument(
        "--output-dir", default="reports", help="folder for NAME.html and results.json"
    )
    parser.add_argument(
        "-p",
        "--parameter",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="set a parameter of the report notebook (repeatable), e.g. -p target /mnt/fb "
        "-p preset small -p steps 40; the names and defaults are the first cell of "
        "notebooks/report.ipynb",
    )
    parser.add_argument("--notebook", default=None, help="another report notebook to run")


def main(args: argparse.Namespace) -> int:
    parameters = {key: parse_value(value) for key, value in args.parameter}
    html = run_report(
        args.name, args.output_dir, parameters, notebook=args.notebook, progress=True
    )
    print(f"results: {html.parent / RESULTS_FILE}")
    return 0
