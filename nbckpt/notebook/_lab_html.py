"""The Lab's HTML parts: the results table with its notes, the job's figures after a run on
many ranks, and the log box."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

from ._widget_parts import html_table

if TYPE_CHECKING:
    from ..bench import Comparison

__all__ = ["NOTE", "job_html", "log_html", "results_html"]

#: Columns of ``format_results`` (keys of ``SHOWN_COLUMNS``) the results table leaves out, and
#: those of text, aligned left (numbers align right).
_HIDDEN = ("peak_host_mb", "peak_device_mb", "reduction_vs_dcp_sync", "write_vs_floor_pct")
_TEXT_COLUMNS = ("strategy", "rests_on", "floor_check")
#: The style of a note under a table.
NOTE = "font-size:11px;line-height:1.4;margin-top:4px;color:#57606a;max-width:1000px"


def results_html(comparison: Comparison) -> str:
    """The results table, the definitions and notes under it, and the method (folded)."""
    from ..bench import OVERHEAD_DEFINITION, OVERHEAD_METHOD, SHOWN_COLUMNS, STALL_DEFINITION, format_results

    shown = format_results(comparison.results, comparison.device)
    columns = [c for c in shown.columns if c not in {SHOWN_COLUMNS[key] for key in _HIDDEN}]
    text = {SHOWN_COLUMNS[key] for key in _TEXT_COLUMNS}
    rows = [("", [html.escape(str(row[c])) for c in columns]) for row in shown.to_dict("records")]
    notes = [OVERHEAD_DEFINITION, STALL_DEFINITION, comparison.floors.describe(), *comparison.warnings]
    table = html_table("nbckpt-results", columns, rows, left={i for i, c in enumerate(columns) if c in text})
    return (
        f'<b>Results</b><div style="overflow-x:auto">{table}</div>'  # wider than the lab: it scrolls
        + "".join(f'<div style="{NOTE}">{html.escape(note)}</div>' for note in notes)
        + f'<details class="nbckpt-method" style="{NOTE}"><summary>How overhead and its interval'
        f' are computed</summary><pre style="white-space:pre-wrap">'
        f"{html.escape(OVERHEAD_METHOD.strip())}</pre></details>"
    )


def job_html(comparison: Comparison) -> str:
    """The job's figures of a run on many ranks: per strategy the aggregate write rate against
    the concurrent raw-write floor, the stall over ranks and the straggler, then in sentences."""
    from ..analysis import job_conclusions, job_table
    from ..analysis._internal import job_table_shown

    table = job_table(comparison)
    columns = [
        ("strategy", "strategy", "{}"),
        ("time_to_durable_s", "time to durable s [95 % over repeats]", "{}"),
        ("aggregate_write_gbs", "aggregate write GB/s [95 % over repeats]", "{}"),
        ("concurrent_floor_gbs", "all ranks raw GB/s, between turns", "{:.2f}"),
        ("floor_beside_training_gbs", "all ranks raw GB/s, beside training", "{:.2f}"),
        ("stall_median_s", "stall median s", "{:.4f}"),
        ("stall_p99_s", "stall p99 s", "{:.4f}"),
        ("stall_max_s", "stall max s", "{:.4f}"),
        ("overhead_pct", "overhead % (slowest rank)", "{:+.1f}"),
        ("straggler_rank", "straggler rank", "{}"),
        ("straggler_over_median_s", "straggler over median s", "{:+.4f}"),
    ]
    rows = [
        ("", [html.escape("-" if pd.isna(row[key]) else form.format(row[key])) for key, _, form in columns])
        for row in job_table_shown(table).to_dict("records")
    ]
    job = comparison.job
    head = f"Job: {job.get('world_size')} ranks on {len(job.get('hosts', {}))} host(s)"
    return (
        f'<b>{html.escape(head)}</b><div style="overflow-x:auto">'
        + html_table("nbckpt-job", [label for _, label, _ in columns], rows, left={0})
        + "</div>"
        + "".join(f'<div style="{NOTE}">{html.escape(line)}</div>' for line in job_conclusions(table))
    )


def log_html(lines: Sequence[str]) -> str:
    # column-reverse keeps the box scrolled to its end, the newest line in view; flex:none: a
    # <pre> that may shrink would scroll itself, from its top
    return (
        '<div class="nbckpt-log" style="display:flex;flex-direction:column-reverse;'
        'max-height:160px;overflow:auto;border:1px solid #ddd;padding:2px 6px"><pre style="'
        f'margin:0;font-size:12px;flex:none">{html.escape("".join(lines))}</pre></div>'
    )
