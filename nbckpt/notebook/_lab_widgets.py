"""The lab's parts: the strategy checkboxes, and the HTML of its messages, results and log."""

from __future__ import annotations

import html
from collections.abc import Iterator, Sequence

import ipywidgets as widgets
import pandas as pd

from .._errors import CheckpointError, ConfigError

__all__ = ["StrategyChoice", "error_line", "log_html", "notice", "results_table", "widgets_of"]

#: Columns of :func:`nbckpt.bench.format_results` the lab's table shows (keys of
#: :data:`nbckpt.bench.SHOWN_COLUMNS`: the same headers as every other nbckpt table).
LAB_COLUMNS = (
    "strategy", "repeats", "checkpoints", "overhead", "overhead_95ci", "per_repeat", "rests_on",
    "mean_step_s", "stall_mean_s", "save_stall_s", "wait_s", "stall_p95_s", "drag", "persist_s",
    "write_gbs", "reduction_vs_torch_save", "floor_check",
)
# Columns of text, aligned left; the others hold numbers and align right.
_TEXT_COLUMNS = ("strategy", "rests_on", "floor_check")


def notice(kind: str, text: str, *, pre: bool = False) -> str:
    """A coloured line of HTML: ``error``, ``ok`` or ``info`` (its class is ``nbckpt-<kind>``)."""
    colours = {"error": ("#cf222e", "#ffebe9"), "ok": ("#1a7f37", "#dafbe1"),
               "info": ("#0969da", "#ddf4ff")}
    fg, bg = colours[kind]
    body = f"<pre style='margin:0'>{html.escape(text)}</pre>" if pre else html.escape(text)
    return (
        f'<div class="nbckpt-{kind}" style="color:{fg};background:{bg};border:1px solid {fg};'
        f'border-radius:4px;padding:4px 8px;margin:2px 0">{body}</div>'
    )


def error_line(exc: BaseException) -> str:
    """One line for an error that ended a run."""
    if isinstance(exc, ConfigError):
        text = f"Cannot run: {exc}"
    elif isinstance(exc, CheckpointError):
        text = f"Checkpoint failed: {exc}"
    elif isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        text = f"Storage error: {exc.strerror or exc}{where}"
    else:
        text = f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"
    return " ".join(text.split())


def results_table(results: pd.DataFrame, device: str, notes: Sequence[str], *,
                  method: bool = False) -> str:
    """The results as an HTML table: numbers right-aligned in tabular figures, notes under it and,
    with ``method``, the method of the overhead and its interval in full (folded)."""
    from ..bench import OVERHEAD_METHOD, SHOWN_COLUMNS, format_results

    shown = format_results(results, device)
    columns = [SHOWN_COLUMNS[key] for key in LAB_COLUMNS if SHOWN_COLUMNS[key] in shown.columns]
    text = {SHOWN_COLUMNS[key] for key in _TEXT_COLUMNS}
    cell = "padding:2px 8px;white-space:nowrap;text-align:{}"
    align = {c: "left" if c in text else "right" for c in columns}
    head = "".join(f'<th style="{cell.format(align[c])}">{html.escape(c)}</th>' for c in columns)
    rows = "".join(
        "<tr>" + "".join(f'<td style="{cell.format(align[c])}">{html.escape(str(row[c]))}</td>'
                         for c in columns) + "</tr>"
        for row in shown.to_dict(orient="records")
    )
    note_style = "font-size:11px;line-height:1.4;margin-top:4px;color:#57606a;max-width:1000px"
    notes_html = "".join(f'<div style="{note_style}">{html.escape(note)}</div>' for note in notes)
    if method:
        notes_html += (f'<details class="nbckpt-method" style="{note_style}"><summary>How overhead '
                       f'and its interval are computed</summary><pre style="white-space:pre-wrap">'
                       f"{html.escape(OVERHEAD_METHOD.strip())}</pre></details>")
    return (
        '<table class="nbckpt-results" style="border-collapse:collapse;'
        f'font-variant-numeric:tabular-nums"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table>{notes_html}"
    )


def log_html(lines: Sequence[str]) -> str:
    """The log box, newest line last."""
    # column-reverse keeps the box scrolled to its end: the newest line stays in view.
    return (
        '<div class="nbckpt-log" style="display:flex;flex-direction:column-reverse;'
        'max-height:160px;overflow:auto;border:1px solid #ddd;padding:2px 6px">'
        # flex:none: a <pre> that may shrink would scroll itself, from its top
        f'<pre style="margin:0;font-size:12px;flex:none">{html.escape("".join(lines))}</pre></div>'
    )


def widgets_of(root: widgets.Widget) -> Iterator[widgets.Widget]:
    """``root``, its children and their layouts and styles (each one a comm of its own)."""
    yield root
    for name in ("layout", "style"):
        part = getattr(root, name, None)
        if isinstance(part, widgets.Widget):
            yield part
    for child in getattr(root, "children", ()):
        if isinstance(child, widgets.Widget):
            yield from widgets_of(child)


class StrategyChoice:
    """A checkbox per strategy; ``value`` is the tuple of ticked ones, in the offered order."""

    def __init__(self, options: Sequence[str], value: Sequence[str]) -> None:
        self.options = tuple(options)
        self.boxes = {
            name: widgets.Checkbox(value=name in value, description=name, indent=False,
                                   layout=widgets.Layout(width="190px"))
            for name in self.options
        }
        self.widget = widgets.VBox([
            widgets.HTML("<b>strategies</b> <span style='color:#57606a'>(none, the baseline, "
                         "always runs)</span>"),
            widgets.GridBox(list(self.boxes.values()),
                            layout=widgets.Layout(grid_template_columns="repeat(2, 190px)")),
        ])

    @property
    def value(self) -> tuple[str, ...]:
        return tuple(name for name, box in self.boxes.items() if box.value)

    @value.setter
    def value(self, names: Sequence[str]) -> None:
        unknown = [name for name in names if name not in self.boxes]
        if unknown:
            raise ConfigError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(self.options)}")
        for name, box in self.boxes.items():
            box.value = name in names

    @property
    def disabled(self) -> bool:
        return all(box.disabled for box in self.boxes.values())

    @disabled.setter
    def disabled(self, disabled: bool) -> None:
        for box in self.boxes.values():
            box.disabled = disabled

