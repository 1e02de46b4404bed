"""``nbckpt report --from run1.json run2.json ...``: the offline HTML report of benches measured
elsewhere (a cluster: ``srun torchrun ... -m nbckpt bench --json``), measuring nothing.

Every file is read and checked first (:func:`nbckpt.analysis.read_runs`; a ``--ranks`` sweep
gives each of its sizes): a bad one is one line and nothing is written. Per run: the job's table
and its conclusions, a swimlane per rank grouped by host for each strategy that wrote, the stall
over ranks with the straggler, the aggregate write rate per checkpoint and over time; with runs of
several rank counts, the measured scaling curve (runs that are not one curve, of another workload,
device or storage or two of one rank count, are refused before anything is written). plotly.js
is inlined once, so the page works offline, as ``nbckpt report``'s does.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from .._errors import ConfigError, NbckptError
from .._util import writable_directory
from ..analysis import (
    job_conclusions,
    job_table,
    rank_rows,
    read_runs,
    scaling_conclusions,
    scaling_table,
    swimlanes,
)
from ..analysis._internal import checkpoint_rates, host_loads, job_table_shown, rank_floors, rate_over_time
from ..bench import Comparison
from ..engine._internal import write_atomic
from ._rank_figures import (
    checkpoint_rate_figure,
    rank_stall_figure,
    rate_over_time_figure,
    scaling_figure,
    swimlane_figure,
)
from ._report import EXTERNAL_LOAD

__all__ = ["report_from"]

_STYLE = """body { font-family: sans-serif; margin: 1.5em auto; max-width: 1280px; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 3px 6px; text-align: right; }
th { background: #f3f3f3; }"""


#: Headers of the report's tables (the analysis tables' columns, as a reader names them).
LABELS = {
    "strategy": "strategy",
    "checkpoints": "checkpoints",
    "time_to_durable_s": "time to durable s [95 % over repeats]",
    "aggregate_write_gbs": "aggregate write GB/s [95 % over repeats]",
    "concurrent_floor_gbs": "raw-write floor between turns GB/s",
    "vs_floor": "write vs floor between turns",
    "floor_beside_training_gbs": "raw-write floor beside training GB/s",
    "vs_floor_beside_training": "write vs floor beside training",
    "stall_median_s": "stall median s",
    "stall_p99_s": "stall p99 s",
    "stall_max_s": "stall max s",
    "overhead_pct": "overhead %",
    "slowest_rank": "slowest rank",
    "straggler_rank": "straggler rank",
    "straggler_host": "straggler host",
    "straggler_over_median_s": "straggler over median s",
    "rank": "rank",
    "host": "host",
    "stall_s": "stall s",
    "persist_s": "persist s",
    "bytes": "bytes",
    "write_gbs": "write GB/s",
    "mean_step_s": "mean step s",
    "ranks": "ranks",
    "hosts": "hosts",
    "source": "file",
    "concurrent_write_gbs": "raw write, every rank at once GB/s",
    "copy_gbs": "copy floor GB/s",
    "cpus": "cores",
    "loadavg_1m": "1-minute load average",
    "other_cpu_cores": "cores other processes kept busy",
    "high": "busy enough to widen intervals",
}


class _Page:
    """The report's HTML as it is built: plotly.js goes in with the first figure only."""

    def __init__(self, title: str) -> None:
        self.parts = [f"<h1>{html.escape(title)}</h1>"]
        self.plotly_in = False

    def text(self, tag: str, content: str) -> None:
        self.parts.append(f"<{tag}>{html.escape(content)}</{tag}>")

    def items(self, lines: Sequence[str]) -> None:
        self.parts.append("<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>")

    def table(self, frame: pd.DataFrame) -> None:
        shown = frame.rename(columns=LABELS)
        self.parts.append(shown.to_html(index=False, na_rep="-", float_format=lambda v: f"{v:.4g}"))

    def figure(self, fig: go.Figure) -> None:
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=not self.plotly_in))
        self.plotly_in = True

    def document(self, title: str) -> str:
        return (
            f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}'
            f"</title><style>{_STYLE}</style></head><body>\n" + "\n".join(self.parts) + "\n</body></html>\n"
        )


def _run_section(page: _Page, comparison: Comparison, source: str) -> None:
    job = comparison.job
    hosts = job.get("hosts", {})
    page.text("h2", f"{job.get('world_size')} ranks on {len(hosts)} host(s): {source}")
    page.text(
        "p",
        f"{comparison.workload}; {comparison.steps} steps, a checkpoint every "
        f"{comparison.every}, {comparison.repeats} repeat(s); device {comparison.device}; "
        f"directory {comparison.directory}; hosts: "
        + "; ".join(f"{host} (ranks {', '.join(map(str, ranks))})" for host, ranks in hosts.items()),
    )
    table = job_table(comparison)
    page.text("h3", "The job")
    page.table(job_table_shown(table))
    page.items(job_conclusions(table))
    for warning in comparison.warnings:
        page.text("p", f"warning: {warning}")
    ranks = rank_rows(comparison)
    page.text("h3", "Every rank")
    page.table(ranks)
    page.figure(rank_stall_figure(ranks, table))
    floors, loads = rank_floors(comparison), host_loads(comparison)
    if not (floors.empty and loads.empty):  # files from before nbckpt recorded them have neither
        page.text("h3", "Floors every rank measured at once, and the load of every host")
        page.table(floors)
        page.table(loads)
    floor = float(comparison.job.get("floors", {}).get("concurrent_write_gbs") or "nan")
    page.figure(checkpoint_rate_figure(checkpoint_rates(comparison), floor))
    rates = {}
    for strategy in table["strategy"]:
        lanes = swimlanes(comparison, str(strategy))
        if lanes.empty:
            continue
        page.figure(swimlane_figure(lanes, str(strategy)))
        rates[str(strategy)] = rate_over_time(lanes)
    if rates:
        page.figure(rate_over_time_figure(rates))
    else:
        page.text(
            "p",
            "This file carries no per-rank events (rank_timeline): no swimlanes, no rate "
            "over time; measure with this version of nbckpt to have them.",
        )


def report_from(
    sources: Sequence[str | os.PathLike[str]],
    name: str = "report",
    output_dir: str | os.PathLike[str] = "reports",
) -> Path:
    """Write ``<output_dir>/<name>.html`` from the bench results ``sources`` (JSON that ``nbckpt
    bench`` wrote under torchrun) and return its path; a bad source raises :class:`ConfigError`
    naming it, before anything is written."""
    if not name or Path(name).name != name or name.startswith("."):
        raise ConfigError(f"report name must be a plain file name, not {name!r}")
    runs = read_runs(sources)
    names, jobs = [source for source, _ in runs], [comparison for _, comparison in runs]
    title = "nbckpt report: checkpointing on " + ", ".join(
        f"{job.job.get('world_size')} ranks" for job in jobs
    )
    page = _Page(title)
    scaling = scaling_table(jobs, names)
    if scaling["ranks"].nunique() > 1:
        page.text("h2", "Measured scaling")
        page.figure(scaling_figure(scaling))
        page.table(scaling)
        page.items(scaling_conclusions(scaling))
    for comparison, source in zip(jobs, names, strict=True):
        _run_section(page, comparison, source)
    body = page.document(title)
    external = EXTERNAL_LOAD.search(body)
    if external:
        raise NbckptError(f"report HTML would load from the network: {external.group(0)[:80]}")
    out = writable_directory(output_dir, "output directory")
    path = Path(out) / f"{name}.html"
    write_atomic(path, body.encode("utf-8"))
    return path
