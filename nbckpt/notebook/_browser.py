"""The checkpoint browser: every step of a run, what was saved with it, and what to do with it.

    >>> from nbckpt.notebook import Browser
    >>> browser = Browser("data/checkpoints/run1", target={"model": model, "optim": opt})
    >>> browser                   # in a notebook: the steps; pick two and Diff, one and Restore
    >>> browser.select(100, 200); browser.diff().head()    # the same from Python

A browser reads through read-only Checkpointers (no lock, nothing written) opened for each
action and closed after it, so it never holds the run's directory, never blocks the Checkpointer
training into it, and is never left holding one that ``nbckpt.close_all()`` closed. Only Delete
writes: through that Checkpointer when it is in this kernel (the magics', an autosave's), else
through one opened for the length of the delete. Every action's error is one line in the widget
(and in ``browser.error``), never a traceback. Creating another browser of the same run
(re-running the cell) closes the previous one.

One job, the widget (its controls, the sortable tables, the selection,
the five actions and one wrapper that turns each action's errors into a line). What it reads,
verifies, loads and deletes, and the rules of deleting (branches, the holder of the directory, a
save in flight, object stores), are :mod:`._browser_index`'s.
"""

from __future__ import annotations

import html
import logging
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import ipywidgets as widgets
import pandas as pd

from .._errors import ConfigError, NbckptError
from .._util import is_url
from ..analysis._internal import diff_states
from . import _browser_index as index
from ._browser_index import MAIN, RowKey, StepRow
from ._cell import one_line
from ._widget_parts import close_widgets, notice

__all__ = ["Browser", "StepRow"]

_log = logging.getLogger("nbckpt")
_T = TypeVar("_T")
_live_lock = threading.Lock()
_live: dict[str, Browser] = {}  # one browser per run: a re-run cell replaces its own
# (label, numeric) per column: numbers align right and sort largest first
_STEP_COLUMNS = [("line", False), ("step", True), ("size", True), ("written (UTC)", False),
                 ("stage s", True), ("write s", True), ("verification", False), ("values", False),
                 ("provenance", False)]
_DIFF_COLUMNS = [("tensor", False), ("status", False), ("dtype", False), ("shape", False),
                 ("elements", True), ("changed", True), ("|b - a|", True), ("max |b - a|", True),
                 ("relative change", True), ("cosine", True)]
_TONES = {"damaged": "color:#cf222e;", "verified": "color:#1a7f37;", "quiet": "color:#57606a;"}

class _Table:
    """Rows (dicts of ``id``, ``cells``, ``keys``: numbers by column, ``tone``, ``bar``) as an
    HTML table that its ``sort`` dropdown orders: numbers largest first, text from A, no value
    last. ipywidgets has no table a click comes back from: steps are picked in a list beside it."""

    def __init__(self, columns: list[tuple[str, bool]], name: str, bar: int = -1) -> None:
        self.columns, self.bar = columns, bar  # bar: the column drawn as a bar as well
        self.rows: list[dict[str, Any]] = []
        self.marked: Sequence[str] = ()  # the rows shown selected
        self.sort = widgets.Dropdown(options=[("as listed", -1)] + [
            (f"sort by {label}", i) for i, (label, _) in enumerate(columns)], layout={"width": "200px"})
        self.html = widgets.HTML()
        self.widget = widgets.VBox([self.sort, self.html])
        self.widget.add_class(name)
        self.sort.observe(lambda _: self.draw(), names="value")

    def show(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.draw()

    def draw(self) -> None:
        by, rows = self.sort.value, list(self.rows)
        if by >= 0:
            numeric = self.columns[by][1]

            def key(row: dict[str, Any]) -> Any:
                return row["keys"].get(by) if numeric else row["cells"][by]

            def known(row: dict[str, Any]) -> bool:
                return key(row) is not None and key(row) == key(row)  # not None, not NaN

            rows = (sorted(filter(known, rows), key=key, reverse=numeric)
                    + [row for row in rows if not known(row)])
        align = ["text-align:" + ("right" if numeric else "left") for _, numeric in self.columns]
        cell = "padding:2px 8px;white-space:nowrap;max-width:360px;overflow:hidden;text-overflow:ellipsis;"
        head = "".join(f'<th style="{cell}{a}">{html.escape(label)}</th>'
                       for (label, _), a in zip(self.columns, align, strict=True))
        self.html.value = ('<div style="max-height:420px;overflow:auto"><table class="nbckpt-table" '
                           'style="border-collapse:collapse;font-size:12px;font-variant-numeric:'
                           f'tabular-nums"><thead><tr>{head}</tr></thead><tbody>'
                           + "".join(self._tr(row, cell, align) for row in rows) + "</tbody></table></div>")

    def _tr(self, row: dict[str, Any], cell: str, align: list[str]) -> str:
        marked = row["id"] in self.marked
        classes = [f"nbckpt-row-{row['tone']}"] if row["tone"] else []
        classes += ["nbckpt-selected"] if marked else []
        tds = []
        for i, text in enumerate(row["cells"]):
            bar = "" if i != self.bar or row["bar"] is None else (
                f'<span class="nbckpt-bar" style="display:inline-block;height:9px;margin-right:6px;'
                f'background:#0969da;width:{max(1, round(80 * row["bar"]))}px"></span>')
            tds.append(f'<td title="{html.escape(text)}" style="{cell}{align[i]};'
                       f'{_TONES.get(row["tone"], "")}">{bar}{html.escape(text)}</td>')
        background = ' style="background:#ddf4ff"' if marked else ""
        return (f'<tr data-id="{html.escape(row["id"])}" class="{" ".join(classes)}"{background}>'
                + "".join(tds) + "</tr>")


class Browser:
    """A run's checkpoints in a table, to verify, compare, restore into ``target`` and delete.

    ``directory`` is local, NFS or an fsspec URL (``storage_options`` are fsspec's). ``target``
    is what Restore loads into, as ``Checkpointer.restore`` takes it (a dict of name to module,
    optimizer, tensor or value); without it Restore is off. The widgets: ``steps`` (the step
    picker), ``table``, ``refresh_button``, ``verify_button``, ``diff_button``,
    ``restore_button``, ``delete_button`` with ``confirm_button`` and ``cancel_button``,
    ``message``, ``diff_table``; ``widget`` is the whole browser.
    """

    def __init__(self, directory: str | os.PathLike[str], *, target: dict[str, Any] | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        if target is not None and not isinstance(target, dict):
            raise ConfigError(f"target must be a dict of name to module, optimizer or tensor, "
                              f"not {type(target).__name__}")
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise ConfigError(f"directory must be a non-empty path or URL, not {directory!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self.directory = os.fspath(directory)
        self.url = self.directory.rstrip("/") if is_url(self.directory) else os.path.abspath(
            os.path.expanduser(self.directory))
        self.storage_options, self.target = dict(storage_options or {}), target
        self.rows: list[StepRow] = []  # every step of every line, as the table shows them
        self.lines: dict[str, dict[str, Any]] = {}
        self.checks: dict[RowKey, tuple[str | None, str]] = {}  # (checksum verified, verdict)
        self.error: str | None = None
        self.diff_frame: pd.DataFrame | None = None
        self.closed = False
        self._restored: RowKey | None = None  # what the live objects were last restored from here
        self._values: dict[str, dict[str, Any]] = {}  # by manifest checksum: read once per save
        self._lock = threading.Lock()  # one action at a time, whichever thread asks
        self._pending: RowKey | None = None  # the step Delete asked to confirm
        self._relisting = False  # the picker's options are being replaced
        self.title = widgets.HTML()
        self.steps = widgets.SelectMultiple(description="steps", rows=6,
                                            layout={"width": "auto", "min_width": "320px"})
        self.steps.add_class("nbckpt-pick")
        self.table = _Table(_STEP_COLUMNS, "nbckpt-steps")
        self.diff_table = _Table(_DIFF_COLUMNS, "nbckpt-diff", bar=8)
        button = widgets.Button
        self.refresh_button = button(description="Refresh", icon="refresh",
                                     tooltip="read the run's steps again")
        self.verify_button = button(description="Verify", icon="check", tooltip="check every block of "
                                    "the selected steps (every step when none is selected)")
        self.diff_button = button(description="Diff", icon="exchange",
                                  tooltip="compare the two selected steps tensor by tensor")
        self.restore_button = button(description="Restore", icon="undo",
                                     tooltip="load the selected step into the live objects")
        self.delete_button = button(description="Delete", icon="trash",
                                    tooltip="delete the selected step (asks first)")
        self.confirm_button = button(description="Confirm delete", button_style="danger",
                                     layout={"display": "none"})
        self.cancel_button = button(description="Cancel", layout={"display": "none"})
        self.message, self.diff_header = widgets.HTML(), widgets.HTML()
        self.widget = widgets.VBox([
            widgets.HBox([self.title, self.refresh_button]), self.steps, self.table.widget,
            widgets.HBox([self.verify_button, self.diff_button, self.restore_button,
                          self.delete_button, self.confirm_button, self.cancel_button]),
            self.message, self.diff_header, self.diff_table.widget])
        self.widget.add_class("nbckpt-browser")
        for name in ("refresh", "verify", "diff", "restore", "delete", "confirm", "cancel"):
            action = getattr(self, {"confirm": "confirm_delete", "cancel": "cancel_delete"}.get(name, name))
            getattr(self, f"{name}_button").on_click(lambda _, action=action: action())
        self.steps.observe(self._on_select, names="value")
        with _live_lock:
            previous, _live[self.url] = _live.get(self.url), self
        if previous is not None:
            previous.close()
        self.refresh()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if self.closed:
            return {"text/plain": f"<closed nbckpt Browser of {self.url}>"}
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def selected(self) -> list[RowKey]:
        """The selected steps as (line, step)."""
        keys = {row.id: row.key for row in self.rows}
        return [keys[i] for i in self.steps.value if i in keys]

    def select(self, *steps: int | str | tuple[str, int]) -> None:
        """Select steps as the picker does: ``select(100, 200)`` or ``select(("branch-1", 60))``
        (a bare step number must name one step of one line)."""
        if len(steps) > 2:
            raise ConfigError("select at most two steps: two to diff, one to restore or delete")
        self.steps.value = tuple(self._row_of(step).id for step in steps)

    def _row_of(self, step: int | str | tuple[str, int]) -> StepRow:
        matches = [r for r in self.rows if r.key == step or r.id == step or r.step == step]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ConfigError(f"the run has no committed step {step!r}; it has "
                              f"{', '.join(r.id for r in self.rows) or 'none'}")
        raise ConfigError(f"step {step} is in {' and '.join(r.line for r in matches)}: name the line, "
                          f"e.g. select(({matches[-1].line!r}, {step}))")

    # -- actions: each returns what it did, or None with the reason in ``error`` -------------

    def refresh(self) -> bool:
        """Read the run's steps again (new ones appear, deleted ones go; the selection stays)."""
        return self._act("read the run", self._refresh) is not None

    def _refresh(self) -> bool:
        with index.open_reader(self.directory, self.storage_options, MAIN) as reader:
            lines = reader.lines()
            found = [index.read_row(reader, MAIN, step, self._values) for step in lines[MAIN]["steps"]]
        for name, line in lines.items():
            if name != MAIN and line["steps"]:
                with index.open_reader(self.directory, self.storage_options, name) as reader:
                    found.extend(index.read_row(reader, name, step, self._values) for step in line["steps"])
        self.lines, self.rows = lines, [row for row in found if row is not None]
        live = {row.key: row.checksum for row in self.rows}  # a step saved again is not checked
        self.checks = {key: c for key, c in self.checks.items() if live.get(key, "") == c[0]}
        self._show_rows()
        if not self.rows:
            missing = not is_url(self.url) and not os.path.isdir(self.url)
            self._say("info", f"No committed checkpoint in {self.url}"
                      + (" (the directory does not exist)" if missing else "") + ".")
        return True

    def verify(self) -> list[RowKey] | None:
        """Verify the selected steps (every step when none is selected); return the damaged ones.
        Damage is a result, not an error."""

        def work() -> list[RowKey]:
            keys = self.selected or [row.key for row in self.rows if row.problem is None]
            for line, steps in index.by_line(keys).items():
                with index.open_reader(self.directory, self.storage_options, line) as reader:
                    for step in steps:
                        self.checks[(line, step)] = (self._row((line, step)).checksum,
                                                     index.verdict(reader, line, step))
            damaged = [key for key in keys if self.checks[key][1] != "verified"]
            self._show_rows()
            if damaged:
                self._say("error", f"Damaged: {', '.join(self._row(k).name for k in damaged)} "
                                   f"(of {len(keys)} verified; see the table)")
            else:
                self._say("ok", f"Verified {len(keys)} step(s): every block reads back intact.")
            return damaged

        return self._act("verify", work)

    def diff(self) -> pd.DataFrame | None:
        """Compare the two selected steps tensor by tensor (the one committed first is ``a``)."""

        def work() -> pd.DataFrame:
            if len(picked := self.selected) != 2:
                raise ConfigError(f"select two steps to compare, not {len(picked)}")
            a, b = sorted(map(self._row, picked), key=lambda r: (r.unix_time or 0.0, r.step))
            self._say("info", f"Loading {a.name} and {b.name} ...")
            states = index.load_states(self.directory, self.storage_options, [a.key, b.key])
            self.diff_frame = frame = diff_states(*states)
            self.diff_header.value = index.diff_summary(a, b, frame)
            self.diff_table.show(index.diff_rows(frame))
            self._say("ok", f"Compared {a.name} with {b.name}.")
            return frame

        return self._act("diff", work)

    def restore(self) -> int | None:
        """Load the selected step into ``target``'s objects in place (``Checkpointer.restore``'s
        rules); return its step."""

        def work() -> int:
            key = self._one_selected("restore")
            if self.target is None:
                raise ConfigError("this browser has no target: Browser(..., target={'model': model, ...})")
            with index.open_reader(self.directory, self.storage_options, key[0]) as reader:
                step = reader.restore(self.target, step=key[1])
            self._restored = key
            text = f"Restored {self._row(key).name} into {', '.join(map(repr, self.target))}."
            if any(s > step for s in self.lines.get(key[0], {}).get("steps", ())):
                text += (" To train on from it in a new branch, restore it with the run's "
                         f"Checkpointer too: ckpt.restore(state, step={step}).")
            self._say("ok", text)
            return step

        return self._act("restore", work)

    def delete(self) -> bool:
        """Ask to delete the selected step: the confirm button (or :meth:`confirm_delete`) does it."""

        def work() -> bool:
            key = self._one_selected("delete")
            if (reason := index.refusal(self.directory, self.lines, self._restored, key)) is not None:
                raise ConfigError(reason)
            self._pending = key
            question = f"Delete {self._row(key).name}? This cannot be undone."
            if is_url(self.url):
                question += (" Nothing stops two writers on an object store: opening it for writing "
                             "discards the remains of a save going on there. Confirm only if no "
                             "run is saving into it now.")
            self._ask_confirmation(question)
            self._say("info", question)
            return True

        return self._act("delete", work) is not None

    def confirm_delete(self) -> bool:
        """Delete the step :meth:`delete` asked about, then read the run again."""

        def work() -> bool:
            key, self._pending = self._pending, None
            self._ask_confirmation(None)
            if key is None:
                raise ConfigError("no delete to confirm: select a step and click Delete first")
            row = self._row(key)
            index.delete_step(self.directory, self.storage_options, self.lines, self._restored, key)
            self.checks.pop(key, None)
            self.steps.value = tuple(i for i in self.steps.value if i != row.id)
            self._refresh()
            self._say("ok", f"Deleted {row.name}.")
            return True

        return self._act("delete", work) is not None

    def cancel_delete(self) -> None:
        self._pending = None
        self._ask_confirmation(None)
        self._say("info", "Nothing deleted.")

    def close(self) -> None:
        """Close the widgets; a closed browser does nothing (create a new one)."""
        self.closed = True
        with _live_lock:
            if _live.get(self.url) is self:
                del _live[self.url]
        close_widgets(self.widget)

    def _row(self, key: RowKey) -> StepRow:
        for row in self.rows:
            if row.key == key:
                return row
        raise ConfigError(f"the browser shows no step {key[1]} in line {key[0]}; refresh it")


    # -- the plumbing ---------------------------------------------------------------------------

    def _one_selected(self, what: str) -> RowKey:
        if len(picked := self.selected) != 1:
            raise ConfigError(f"select the one step to {what}, not {len(picked)}")
        return picked[0]

    def _act(self, what: str, work: Callable[[], _T]) -> _T | None:
        """Run one action: its errors and warnings become lines in the widget, never tracebacks."""
        if self.closed:
            self.error = "this browser is closed (a newer one of the same run replaced it)"
            return None
        if not self._lock.acquire(blocking=False):
            self._say("error", f"Cannot {what}: another action is still running")
            return None
        self.error = None
        self._busy(True)
        try:
            # catch_warnings is process-wide: fine here, actions run on the kernel's main thread
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = work()
            self.message.value += "".join(notice("info", one_line(Warning(w.message))) for w in caught)
            return result
        except NbckptError as exc:
            self._fail(f"Cannot {what}: {one_line(exc)}")
        except Exception as exc:  # a bug of ours or of a library: one line, the details in the log
            _log.debug("nbckpt: the browser's %s failed", what, exc_info=True)
            self._fail(f"Cannot {what}: unexpected {type(exc).__name__}: {one_line(exc)}")
        finally:
            self._busy(False)
            self._lock.release()
        return None

    def _fail(self, line: str) -> None:
        self.error = line
        self._say("error", line)

    def _say(self, kind: str, text: str) -> None:
        self.message.value = notice(kind, text)

    def _busy(self, busy: bool) -> None:
        selected = len(self.selected)
        self.refresh_button.disabled = self.verify_button.disabled = busy
        self.diff_button.disabled = busy or selected != 2
        self.restore_button.disabled = busy or selected != 1 or self.target is None
        self.delete_button.disabled = busy or selected != 1
        self.confirm_button.disabled = self.cancel_button.disabled = busy

    def _ask_confirmation(self, question: str | None) -> None:
        """Show the confirm and cancel buttons with ``question``, or hide them (None)."""
        self.confirm_button.layout.display = self.cancel_button.layout.display = (
            "none" if question is None else "")
        self.confirm_button.tooltip = question

    def _on_select(self, change: dict[str, Any]) -> None:
        if self._relisting:
            return
        if self._pending is not None and self._pending not in self.selected:
            self.cancel_delete()
        self.table.marked = self.steps.value
        self.table.draw()
        self._busy(self._lock.locked())

    def _show_rows(self) -> None:
        options = [(row.name, row.id) for row in self.rows]
        if list(self.steps.options) != options:
            # new options drop the selection (not within hold_trait_notifications: the picker
            # resets it after the hold): put back what is still there
            kept = tuple(i for i in self.steps.value if i in {row.id for row in self.rows})
            self._relisting = True
            try:
                self.steps.options = options
                self.steps.value = kept
            finally:
                self._relisting = False
        self.table.marked = self.steps.value
        self.table.show([index.step_row(row, self.checks.get(row.key), self.lines.get(row.line, {}))
                         for row in self.rows])
        lines = len([name for name, line in self.lines.items() if line["steps"]])
        self.title.value = (f'<b>Checkpoints</b> of <code title="{html.escape(self.url)}">'
                            f"{html.escape(self.directory)}</code>: "
                            f"{len(self.rows)} step(s) in {lines} line(s)")
