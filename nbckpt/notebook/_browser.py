"""The checkpoint browser: every step of a run, what was saved with it, and what to do with it.

    >>> browser = Browser("data/checkpoints/run1")
    >>> browser                   # in a notebook: the steps; pick two and Diff, one and Delete
    >>> browser.select(100, 200); browser.diff().head()    # the same from Python

Every action's error is one line in the widget (and in ``browser.error``), never a traceback.
Another browser of the same run (re-running the cell) closes this one.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import logging
import os
import threading
import warnings
from collections.abc import Callable, Collection
from typing import Any, Concatenate, ParamSpec, TypeVar

import ipywidgets as widgets
import pandas as pd

from .._errors import ConfigError, NbckptError
from .._util import check_path, is_url
from ..analysis._internal import diff_states
from . import _browser_index as index
from ._browser_index import RowKey, StepRow
from ._cell import one_line
from ._widget_parts import close_widgets, html_table, notice

__all__ = ["Browser", "StepRow"]

_log = logging.getLogger("nbckpt")
_T = TypeVar("_T")
_P = ParamSpec("_P")
_live_lock = threading.Lock()
_live: dict[str, Browser] = {}  # one browser per run: a re-run cell replaces its own
_STEP_COLUMNS = [
    "run",
    "step",
    "size",
    "written (UTC)",
    "stage s",
    "write s",
    "verification",
    "values",
    "provenance",
]
_DIFF_COLUMNS = [
    "tensor",
    "status",
    "dtype",
    "shape",
    "elements",
    "changed",
    "|b - a|",
    "max |b - a|",
    "relative change",
    "cosine",
]
_TONES = {"damaged": "color:#cf222e;", "verified": "color:#1a7f37;", "quiet": "color:#57606a;"}


class _Table:
    """Rows (dicts of ``id``, ``cells``, ``tone``) as an HTML table, those ``marked`` shown
    selected. ipywidgets has no table a click comes back from: steps are picked in a list."""

    def __init__(self, name: str, columns: list[str], left: Collection[int]) -> None:
        self.columns, self.left = columns, left
        self.rows: list[dict[str, Any]] = []
        self.marked: Collection[str] = ()
        self.widget = widgets.HTML()
        self.widget.add_class(name)

    def show(self, rows: list[dict[str, Any]] | None = None) -> None:
        self.rows = self.rows if rows is None else rows
        self.widget.value = (
            '<div style="max-height:420px;overflow:auto;font-size:12px">'
            + html_table("nbckpt-table", self.columns, map(self._tr, self.rows), left=self.left)
            + "</div>"
        )

    def _tr(self, row: dict[str, Any]) -> tuple[str, list[str]]:
        marked = row["id"] in self.marked
        classes = [f"nbckpt-row-{row['tone']}"] if row["tone"] else []
        classes += ["nbckpt-selected"] if marked else []
        style = _TONES.get(row["tone"], "") + ("background:#ddf4ff" if marked else "")
        return (
            f' data-id="{html.escape(row["id"])}" class="{" ".join(classes)}" style="{style}"',
            [html.escape(text) for text in row["cells"]],
        )


def _action(
    what: str,
) -> Callable[[Callable[Concatenate[Browser, _P], _T]], Callable[Concatenate[Browser, _P], _T | None]]:
    """A Browser action: one at a time, whichever thread asks; its errors and warnings are lines
    in the widget (its errors in ``error`` too), never tracebacks; it returns None when it failed."""

    def decorate(
        work: Callable[Concatenate[Browser, _P], _T],
    ) -> Callable[Concatenate[Browser, _P], _T | None]:
        @functools.wraps(work)
        def act(self: Browser, /, *args: _P.args, **kwargs: _P.kwargs) -> _T | None:
            if self.closed:
                self.error = "this browser is closed (a newer one of the same run replaced it)"
                return None
            if not self._lock.acquire(blocking=False):
                self.error = f"Cannot {what}: another action is still running"
                self._say("error", self.error)
                return None
            self.error = None
            self._busy(True)
            try:
                # catch_warnings is process-wide: one action at a time, and they run on the kernel's thread
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    result = work(self, *args, **kwargs)
                self.message.value += "".join(notice("info", one_line(Warning(w.message))) for w in caught)
                return result
            except Exception as exc:  # an NbckptError says why; any other is a bug (details logged)
                _log.debug("nbckpt: the browser's %s failed", what, exc_info=True)
                unexpected = "" if isinstance(exc, NbckptError) else f"unexpected {type(exc).__name__}: "
                self.error = f"Cannot {what}: {unexpected}{one_line(exc)}"
                self._say("error", self.error)
            finally:
                self._busy(False)
                self._lock.release()
            return None

        return act

    return decorate


class Browser:
    """A run's checkpoints in a table, to verify, compare and delete.

    ``directory`` is local, NFS or an fsspec URL (``storage_options`` are fsspec's). ``widget``
    is the whole browser; ``steps`` is its step picker.
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
    ) -> None:
        self.directory = check_path(directory, "directory")
        self.url = (
            self.directory.rstrip("/")
            if is_url(self.directory)
            else os.path.abspath(os.path.expanduser(self.directory))
        )
        self.storage_options = dict(storage_options or {})
        self.rows: list[StepRow] = []  # every step of the run and of those set aside in it
        self.runs: dict[str, dict[str, Any]] = {}  # by name ("": the run itself): path, steps, after
        self.error: str | None = None
        self.diff_frame: pd.DataFrame | None = None
        self.closed = False
        self._lock = threading.Lock()  # one action at a time, whichever thread asks
        self._values: dict[str, dict[str, Any]] = {}  # by manifest checksum: read once per save
        self._pending: RowKey | None = None  # the step Delete asked to confirm
        self.title, self.message, self.diff_header = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.steps = widgets.SelectMultiple(
            description="steps", rows=6, layout={"width": "auto", "min_width": "320px"}
        )
        self.steps.add_class("nbckpt-pick")
        self.table = _Table("nbckpt-steps", _STEP_COLUMNS, left={0, 3, 6, 7, 8})
        self.diff_table = _Table("nbckpt-diff", _DIFF_COLUMNS, left={0, 1, 2, 3})
        buttons = [
            widgets.Button(description=name, icon=icon, tooltip=tip)
            for name, icon, tip in (
                ("Refresh", "refresh", "read the run's steps again"),
                (
                    "Verify",
                    "check",
                    "check every block of the selected steps (every step when none is selected)",
                ),
                ("Diff", "exchange", "compare the two selected steps tensor by tensor"),
                ("Delete", "trash", "delete the selected step (asks first)"),
            )
        ]
        self.refresh_button, self.verify_button, self.diff_button, self.delete_button = buttons
        self.confirm_button = widgets.Button(
            description="Confirm delete", button_style="danger", layout={"display": "none"}
        )
        self.cancel_button = widgets.Button(description="Cancel", layout={"display": "none"})
        actions = [self.refresh, self.verify, self.diff, self.delete, self.confirm_delete, self.cancel_delete]
        for button, action in zip([*buttons, self.confirm_button, self.cancel_button], actions, strict=True):
            button.on_click(lambda _, action=action: action())
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.title, self.refresh_button]),
                self.steps,
                self.table.widget,
                widgets.HBox([*buttons[1:], self.confirm_button, self.cancel_button]),
                self.message,
                self.diff_header,
                self.diff_table.widget,
            ]
        )
        self.widget.add_class("nbckpt-browser")
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
        """The selected steps as (run, step): ``("", 20)``, or ``("set-aside-1", 30)`` for a
        step set aside after a rewind."""
        return [row.key for row in self.rows if row.id in self.steps.value]

    def select(self, *steps: int | str | tuple[str, int]) -> None:
        """Select steps as the picker does: ``select(100, 200)`` (the run's steps) or
        ``select(("set-aside-1", 300))`` (a step set aside after a rewind)."""
        self.steps.value = tuple(self._row_of(step).id for step in steps)

    def _row_of(self, step: int | str | tuple[str, int]) -> StepRow:
        for row in self.rows:  # a bare number is a step of the run itself
            if step in (row.key, row.id) or (row.run == index.HERE and step == row.step):
                return row
        raise ConfigError(
            f"the run has no committed step {step!r}; it has {', '.join(r.id for r in self.rows) or 'none'}"
        )

    # -- actions: each returns what it did, or None with the reason in ``error`` -------------

    def _read(self) -> bool:
        """Read the run's steps again (new ones appear, deleted ones go; the selection stays)."""
        before = {row.key: row for row in self.rows}
        self.runs, rows = index.read_run(self.directory, self.storage_options, self._values)
        # a verdict holds while the step is the one verified (not saved again since)
        self.rows = [
            dataclasses.replace(row, verdict=old.verdict)
            if (old := before.get(row.key)) and old.checksum == row.checksum
            else row
            for row in rows
        ]
        self._show_rows()
        if not self.rows:
            missing = not is_url(self.url) and not os.path.isdir(self.url)
            self._say(
                "info",
                f"No committed checkpoint in {self.url}"
                + (" (the directory does not exist)" if missing else "")
                + ".",
            )
        return True

    refresh = _action("read the run")(_read)

    @_action("verify")
    def verify(self) -> list[RowKey]:
        """Verify the selected steps (every step when none is selected); return the damaged ones.
        Damage is a result, not an error."""
        keys = self.selected or [row.key for row in self.rows if row.problem is None]
        found = index.per_run(self.directory, self.storage_options, keys, index.verdict)
        self.rows = [dataclasses.replace(row, verdict=found.get(row.key, row.verdict)) for row in self.rows]
        damaged = [key for key in keys if found[key] != "verified"]
        self._show_rows()
        if damaged:
            self._say(
                "error",
                f"Damaged: {', '.join(self._row_of(k).name for k in damaged)} "
                f"(of {len(keys)} verified; see the table)",
            )
        else:
            self._say("ok", f"Verified {len(keys)} step(s): every block reads back intact.")
        return damaged

    @_action("diff")
    def diff(self) -> pd.DataFrame:
        """Compare the two selected steps tensor by tensor (the one committed first is ``a``)."""
        if len(picked := self.selected) != 2:
            raise ConfigError(f"select two steps to compare, not {len(picked)}")
        a, b = sorted(map(self._row_of, picked), key=lambda r: (r.unix_time or 0.0, r.step))
        self._say("info", f"Loading {a.name} and {b.name} ...")
        states = index.per_run(
            self.directory,
            self.storage_options,
            [a.key, b.key],
            lambda reader, _, step: reader.load(step, map_location="cpu"),
        )
        self.diff_frame = frame = diff_states(states[a.key], states[b.key])  # weights only, on the CPU
        self.diff_header.value = index.diff_summary(a, b, frame)
        self.diff_table.show(index.diff_rows(frame))
        self._say("ok", f"Compared {a.name} with {b.name}.")
        return frame

    @_action("restore")
    def restore(self, state: dict[str, Any], step: int | str | tuple[str, int] | None = None) -> int:
        """Restore the selected step (or ``step``, named as :meth:`select` names it) into ``state``
        from the run it is in, a run set aside after a rewind too (read-only); return its step.
        Saving it with the run's Checkpointer goes on from it."""
        row = self._row_of(step if step is not None else self._one_selected("restore"))
        restored = index.restore_step(self.directory, self.storage_options, row.key, state)
        self._say("ok", f"Restored {row.name} into the state.")
        return restored

    @_action("delete")
    def delete(self) -> bool:
        """Ask to delete the selected step: the confirm button (or :meth:`confirm_delete`) does it."""
        key = self._deletable(self._one_selected("delete"))
        self._pending = key
        question = f"Delete {self._row_of(key).name}? This cannot be undone."
        if is_url(self.url):
            question += (
                " Nothing stops two writers on an object store: opening it for writing "
                "discards the remains of a save going on there. Confirm only if no "
                "run is saving into it now."
            )
        self.confirm_button.tooltip = question
        self._say("info", question)
        return True

    @_action("delete")
    def confirm_delete(self) -> bool:
        """Delete the step :meth:`delete` asked about, then read the run again."""
        key, self._pending = self._pending, None
        if key is None:
            raise ConfigError("no delete to confirm: select a step and click Delete first")
        row = self._row_of(key)
        index.delete_step(self.directory, self.storage_options, self._deletable(key))
        self.steps.value = tuple(i for i in self.steps.value if i != row.id)
        self._read()
        self._say("ok", f"Deleted {row.name}.")
        return True

    def cancel_delete(self) -> None:
        self._pending = None
        self._busy(False)
        self._say("info", "Nothing deleted.")

    def close(self) -> None:
        """Close the widgets; a closed browser does nothing (create a new one)."""
        self.closed = True
        with _live_lock:
            if _live.get(self.url) is self:
                del _live[self.url]
        close_widgets(self.widget)

    # -- the plumbing ---------------------------------------------------------------------------

    def _one_selected(self, what: str) -> RowKey:
        if len(picked := self.selected) != 1:
            raise ConfigError(f"select the one step to {what}, not {len(picked)}")
        return picked[0]

    def _deletable(self, key: RowKey) -> RowKey:
        if (reason := index.refusal(self.directory, key)) is not None:
            raise ConfigError(reason)
        return key

    def _say(self, kind: str, text: str) -> None:
        self.message.value = notice(kind, text)

    def _busy(self, busy: bool) -> None:
        selected = len(self.selected)
        self.refresh_button.disabled = self.verify_button.disabled = busy
        self.diff_button.disabled = busy or selected != 2
        self.delete_button.disabled = busy or selected != 1
        self.confirm_button.disabled = self.cancel_button.disabled = busy
        # the confirm and cancel buttons show while a delete waits for its answer
        self.confirm_button.layout.display = self.cancel_button.layout.display = (
            "none" if self._pending is None else ""
        )

    def _on_select(self, change: dict[str, Any]) -> None:
        if self._pending is not None and self._pending not in self.selected:
            self.cancel_delete()
        self.table.marked = self.steps.value
        self.table.show()
        self._busy(False)

    def _show_rows(self) -> None:
        options = [(row.name, row.id) for row in self.rows]
        if list(self.steps.options) != options:
            # new options drop the selection (not within hold_trait_notifications: the picker
            # resets it after the hold): put back what is still there
            kept = tuple(i for i in self.steps.value if i in {row.id for row in self.rows})
            self.steps.unobserve(self._on_select, names="value")
            self.steps.options, self.steps.value = options, kept
            self.steps.observe(self._on_select, names="value")
        self.table.marked = self.steps.value
        self.table.show([index.step_row(row, self.runs.get(row.run, {})) for row in self.rows])
        aside = len([name for name, run in self.runs.items() if name and run["steps"]])
        self.title.value = (
            f'<b>Checkpoints</b> of <code title="{html.escape(self.url)}">'
            f"{html.escape(self.directory)}</code>: "
            f"{len(self.rows)} step(s)" + (f", {aside} run(s) set aside in it" if aside else "")
        )
