"""What the checkpoint browser shows: the steps table, the action buttons, the message line and
the diff, and how a step, a verification and a diff become table rows."""

from __future__ import annotations

import html
import math
import os
import time
from typing import Any

import ipywidgets as widgets
import pandas as pd

from .._util import format_bytes
from ._browser_model import NOT_CHECKED, Check, StepRow
from ._table_widget import DataTable, column, table_row

__all__ = ["DIFF_ROWS", "BrowserView", "diff_rows", "diff_summary", "step_row"]

#: Tensors the diff table lists (most changed first); the whole frame is ``browser.diff_frame``.
DIFF_ROWS = 50

STEP_COLUMNS = [
    column("line"), column("step", numeric=True), column("size", numeric=True),
    column("written (UTC)"), column("stage s", numeric=True), column("write s", numeric=True),
    column("verification"), column("values"), column("provenance"),
]
DIFF_COLUMNS = [
    column("tensor"), column("status"), column("dtype"), column("shape"),
    column("elements", numeric=True), column("changed", numeric=True),
    column("|b - a|", numeric=True), column("max |b - a|", numeric=True),
    column("relative change", numeric=True, bar=True), column("cosine", numeric=True),
]


def _number(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return "∞" if value > 0 else "-∞"
    return f"{value:.{digits}g}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _value(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def provenance_text(origin: dict[str, Any]) -> str:
    """The provenance of a step on one line: versions, git commit, program, host."""
    parts = [f"{name} {origin[key]}" for name, key in
             (("nbckpt", "nbckpt"), ("torch", "torch"), ("Python", "python")) if origin.get(key)]
    git = origin.get("git")
    if isinstance(git, dict) and git.get("commit"):
        parts.append(f"git {str(git['commit'])[:10]}{' (dirty)' if git.get('dirty') else ''}")
    if origin.get("program"):
        parts.append(os.path.basename(str(origin["program"])) or str(origin["program"]))
    if origin.get("host"):
        parts.append(str(origin["host"]))
    return " · ".join(parts)


def verification_text(check: Check | None) -> str:
    if check is None:
        return NOT_CHECKED
    return check.state if not check.detail else f"{check.state}: {check.detail}"


def step_row(row: StepRow, check: Check | None, line: dict[str, Any]) -> dict[str, Any]:
    """A step as a row of the steps table."""
    label = row.line
    if line.get("parent") is not None:
        label = f"{row.line} (from {line['parent']} {line.get('from_step')})"
    written = "—" if row.unix_time is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.unix_time))
    values = ", ".join(f"{key}={_value(value)}" for key, value in row.values.items())
    if row.problem is not None:
        verification, tone = f"damaged: {row.problem}", "damaged"
    else:
        verification = verification_text(check)
        tone = "" if check is None else check.state
    cells = [
        label, str(row.step), "—" if row.nbytes is None else format_bytes(row.nbytes), written,
        _seconds(row.stage_s), _seconds(row.write_s), verification, values, provenance_text(row.provenance),
    ]
    keys: list[float | str | None] = [row.line, row.step, row.nbytes, row.unix_time, row.stage_s,
                                      row.write_s, verification, values, cells[-1]]
    return table_row(row.id, cells, keys, tone=tone)


def diff_rows(frame: pd.DataFrame, limit: int = DIFF_ROWS) -> list[dict[str, Any]]:
    """The first ``limit`` rows of a diff as table rows, a bar for each relative change."""
    shown = frame.head(limit)
    finite = shown["rel_change"][shown["rel_change"].map(lambda v: math.isfinite(v) and v > 0)]
    scale = float(finite.max()) if len(finite) else 1.0
    rows = []
    for record in shown.to_dict(orient="records"):
        relative = float(record["rel_change"])
        bar = None if math.isnan(relative) or relative == 0 else min(1.0, relative / scale)
        cells = [
            str(record["key"]), str(record["status"]), str(record["dtype"]), str(record["shape"]),
            str(record["numel"]), str(record["changed_elements"]), _number(record["diff_norm"]),
            _number(record["max_abs_diff"]), _number(relative), _number(record["cosine"], 6),
        ]
        keys = [record["key"], record["status"], record["dtype"], record["shape"], record["numel"],
                record["changed_elements"], record["diff_norm"], record["max_abs_diff"], relative,
                record["cosine"]]
        tone = "quiet" if record["status"] == "unchanged" else ""
        rows.append(table_row(str(record["key"]), cells, keys, tone=tone, bar=bar))
    return rows


def diff_summary(a: StepRow, b: StepRow, frame: pd.DataFrame, limit: int = DIFF_ROWS) -> str:
    """One line above the diff table: what was compared and what changed, as HTML."""
    counts = frame["status"].value_counts()
    parts = ", ".join(f"{int(n)} {status}" for status, n in counts.items())
    text = f"{a.name} → {b.name}: {len(frame)} tensors ({parts or 'none'})"
    moved = frame[frame["status"] == "changed"]
    if len(moved):
        top = moved.iloc[0]
        text += f"; the largest relative change is {top['key']} ({_number(float(top['rel_change']))})"
    if len(frame) > limit:
        text += f"; the table lists the {limit} that changed most"
    return f'<div class="nbckpt-diff-summary">{html.escape(text)}</div>'


class BrowserView:
    """The browser's widgets: ``table`` (the steps), ``refresh_button``, ``verify_button``,
    ``diff_button``, ``restore_button``, ``delete_button`` with ``confirm_button`` and
    ``cancel_button``, ``message``, ``diff_table``; ``widget`` is the whole browser."""

    def __init__(self) -> None:
        self.title = widgets.HTML()
        self.refresh_button = widgets.Button(description="Refresh", icon="refresh",
                                             tooltip="read the run's steps again")
        self.table = DataTable(columns=STEP_COLUMNS, selectable=2)
        self.table.add_class("nbckpt-steps")
        self.verify_button = widgets.Button(
            description="Verify", icon="check",
            tooltip="check every block of the selected steps (every step when none is selected)")
        self.diff_button = widgets.Button(description="Diff", icon="exchange",
                                          tooltip="compare the two selected steps tensor by tensor")
        self.restore_button = widgets.Button(description="Restore", icon="undo",
                                             tooltip="load the selected step into the live objects")
        self.delete_button = widgets.Button(description="Delete", icon="trash",
                                            tooltip="delete the selected step (asks first)")
        self.confirm_button = widgets.Button(description="Confirm delete", button_style="danger",
                                             layout=widgets.Layout(display="none"))
        self.cancel_button = widgets.Button(description="Cancel", layout=widgets.Layout(display="none"))
        self.message = widgets.HTML()
        self.diff_header = widgets.HTML()
        self.diff_table = DataTable(columns=DIFF_COLUMNS, selectable=0)
        self.diff_table.add_class("nbckpt-diff")
        self.widget = widgets.VBox([
            widgets.HBox([self.title, self.refresh_button]),
            self.table,
            widgets.HBox([self.verify_button, self.diff_button, self.restore_button, self.delete_button,
                          self.confirm_button, self.cancel_button]),
            self.message,
            self.diff_header,
            self.diff_table,
        ])
        self.widget.add_class("nbckpt-browser")

    def _show_buttons(self, *, selected: int, can_restore: bool, busy: bool) -> None:
        self.refresh_button.disabled = self.verify_button.disabled = busy
        self.diff_button.disabled = busy or selected != 2
        self.restore_button.disabled = busy or selected != 1 or not can_restore
        self.delete_button.disabled = busy or selected != 1
        self.confirm_button.disabled = self.cancel_button.disabled = busy

    def _ask_confirmation(self, question: str | None) -> None:
        """Show the confirm and cancel buttons with ``question``, or hide them (None)."""
        shown = "none" if question is None else ""
        self.confirm_button.layout.display = self.cancel_button.layout.display = shown
        if question is not None:
            self.confirm_button.tooltip = question
