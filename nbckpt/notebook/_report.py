"""``nbckpt report``: run ``notebooks/report.ipynb`` with papermill (it writes ``results.json``),
turn a failing cell into a one-line error and export the outputs, no code, to one HTML file that
works offline (plotly.js inline, nothing from a CDN). Progress lines the notebook appends to a
file (:func:`report_progress`) are printed as they come: papermill would show one cell for minutes.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from .._errors import ConfigError, NbckptError
from .._util import writable_directory
from ._plan import notebook_defaults

__all__ = ["EXTERNAL_LOAD", "NOTEBOOK_ONLY", "RESULTS_FILE", "export_html", "report_progress", "run_report"]

#: The report notebook, in the checkout's ``notebooks/`` folder (it ships with the source tree).
REPORT_NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "report.ipynb"
RESULTS_FILE = "results.json"
#: Parameters that name local paths: relative values are taken from the caller's directory,
#: not from the notebook's (papermill runs the kernel in the notebook's folder).
PATH_PARAMETERS = ("target", "output_dir")
#: The notebook parameter naming the file its progress lines go to.
PROGRESS_PARAMETER = "progress_path"
_TAIL_S = 0.2  # how often the progress file is read while the notebook runs

# The lab template without the scripts it would fetch from CDNs (require.js, MathJax,
# mermaid, the widget manager): the report uses none of them.
# Its tables are compact (the results have 18 or more columns: at JupyterLab's 13 px and
# padding they ran past the right edge of a page 1,280 px wide); tables of sentences
# (class nbckpt-text) align left and top. In html_head_css: after JupyterLab's own rules.
_OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_css -%}
<style>
.jp-OutputArea-output.jp-RenderedHTMLCommon table { font-size: 12px; }
.jp-OutputArea-output.jp-RenderedHTMLCommon th, .jp-OutputArea-output.jp-RenderedHTMLCommon td {
  padding: 3px 5px; }
.jp-OutputArea-output.jp-RenderedHTMLCommon table.nbckpt-text th,
.jp-OutputArea-output.jp-RenderedHTMLCommon table.nbckpt-text td {
  text-align: left; vertical-align: top; }
</style>
{%- endblock html_head_css -%}
"""
#: Cells with this tag are left out of the report: notes for whoever opens the notebook.
NOTEBOOK_ONLY = "notebook-only"
# plotly's notebook renderer adds a MathJax <script src=CDN> to every figure; the figures
# use no LaTeX, so the tag is dropped rather than fetched.
_MATHJAX_TAG = re.compile(r'<script src="https?://[^"]*mathjax[^"]*"></script>', re.IGNORECASE)
#: Anything the HTML would load from the network (what the offline check looks for).
EXTERNAL_LOAD = re.compile(
    r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.IGNORECASE
)


def run_report(
    name: str = "report",
    output_dir: str | os.PathLike[str] = "reports",
    parameters: Mapping[str, Any] | None = None,
    *,
    notebook: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> Path:
    """Execute the report notebook and write ``<output_dir>/<name>.html`` (the executed notebook
    beside it as ``<name>.ipynb``, and ``results.json``); return its path. A failing cell raises
    :class:`NbckptError`, and no HTML is written. ``progress`` prints the progress lines on stderr."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    if not name or Path(name).name != name or name.startswith("."):
        raise ConfigError(f"report name must be a plain file name, not {name!r}")
    source = Path(notebook) if notebook is not None else REPORT_NOTEBOOK
    if not source.is_file():
        raise ConfigError(f"report notebook {source} not found (run from a source checkout)")
    out = writable_directory(output_dir, "output directory").resolve()

    params = _check_parameters(source, dict(parameters or {}))
    params["output_dir"] = str(out)
    html_path = out / f"{name}.html"
    executed = out / f"{name}.ipynb"
    for stale in (html_path, out / RESULTS_FILE):
        stale.unlink(missing_ok=True)  # a failed run must not leave an older report looking new

    started = time.perf_counter()
    tail = progress and PROGRESS_PARAMETER in papermill.inspect_notebook(str(source))
    lines = out / f".{name}.progress"
    if tail:
        lines.write_text("")
        params[PROGRESS_PARAMETER] = str(lines)
        print(f"report: running {source.name} into {out} (progress as it goes)", file=sys.stderr, flush=True)
    try:
        with _printing(lines) if tail else nullcontext():
            papermill.execute_notebook(
                str(source),
                str(executed),
                parameters=params,
                kernel_name="python3",
                cwd=str(source.parent),
                progress_bar=progress and not tail,
                store_widget_state=False,
            )
    except PapermillExecutionError as exc:
        evalue = (exc.evalue or "").strip().splitlines()
        detail = evalue[0] if evalue else "(no message)"
        raise NbckptError(
            f"{source.name} failed in cell {exc.exec_count}: {exc.ename}: {detail} "
            f"(executed notebook: {executed})"
        ) from None
    finally:
        lines.unlink(missing_ok=True)
    html_path.write_text(export_html(executed), encoding="utf-8")
    if progress:
        print(f"wrote {html_path} in {time.perf_counter() - started:.1f} s")
    return html_path


def report_progress(path: str | os.PathLike[str] | None) -> Callable[[str], None] | None:
    """The report notebook's progress callback: each line appended to ``path``, which
    ``nbckpt report`` prints as it grows; None (no progress lines) when ``path`` is empty."""
    if not path:
        return None
    target = os.fspath(path)

    def say(line: str) -> None:
        with open(target, "a", encoding="utf-8") as stream:
            stream.write(line.rstrip("\n") + "\n")

    return say


@contextmanager
def _printing(path: Path) -> Iterator[None]:
    """While the block runs, print on stderr every line appended to ``path``."""
    done = threading.Event()

    def follow() -> None:
        pending = ""
        with open(path, encoding="utf-8", errors="replace") as stream:
            while True:
                finished = done.wait(_TAIL_S)
                *complete, pending = (pending + stream.read()).split("\n")  # a line being written waits
                for line in complete:
                    print(line, file=sys.stderr, flush=True)
                if finished:
                    return

    follower = threading.Thread(target=follow, name="nbckpt-report-progress", daemon=True)
    follower.start()
    try:
        yield
    finally:
        done.set()
        follower.join()


def _check_parameters(source: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Refuse names the notebook does not declare; give a number set for a text parameter as its
    text; resolve relative local paths against cwd."""
    known = notebook_defaults(source)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown report parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    for key, value in params.items():
        # -p probe_streams 1 arrives as the number 1 (parse_value), and the notebook splits its
        # text parameters (the strategies, stream and rank counts, files) at commas
        if isinstance(known[key], str) and isinstance(value, (int, float)):
            params[key] = str(value)
    for key in PATH_PARAMETERS:
        value = params.get(key)
        if isinstance(value, str) and value and "://" not in value:
            params[key] = str(Path(value).expanduser().resolve())
    return params


def export_html(executed: str | os.PathLike[str]) -> str:
    """Outputs only (no code, no ``notebook-only`` cells), plotly.js inline, no CDN scripts:
    one self-contained HTML page."""
    import nbformat
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    nb = nbformat.read(os.fspath(executed), as_version=4)  # type: ignore[no-untyped-call]
    nb.cells = [cell for cell in nb.cells if NOTEBOOK_ONLY not in cell.metadata.get("tags", ())]
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
