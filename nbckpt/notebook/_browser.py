"""The checkpoint browser: every step of a run, what was saved with it, and what to do with it.

    >>> from nbckpt.notebook import Browser
    >>> browser = Browser("data/checkpoints/run1", target={"model": model, "optim": opt})
    >>> browser                   # in a notebook: the steps; click two and Diff, one and Restore
    >>> browser.select(100, 200); browser.diff().head()    # the same from Python

A browser only reads (it opens the run read-only), so it can sit beside the Checkpointer that
trains into the same directory; only Delete writes: through that Checkpointer when it is in this
kernel (the magics', an autosave's), else for the length of the delete. Every
action's error is one line in the widget (and in ``browser.error``), never a traceback.
Creating another browser of the same run (re-running the cell) closes the previous one.
"""

from __future__ import annotations

import html
import logging
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import pandas as pd

from .._errors import ConfigError, NbckptError
from .._util import is_url
from ._browser_model import RowKey, RunIndex, StepRow
from ._browser_view import BrowserView, diff_rows, diff_summary, step_row
from ._cell import one_line
from ._lab_widgets import notice, widgets_of

__all__ = ["Browser"]

_log = logging.getLogger("nbckpt")
_T = TypeVar("_T")
_live_lock = threading.Lock()
_live: dict[str, Browser] = {}  # one browser per run: a re-run cell replaces its own


class Browser(BrowserView):
    """A run's checkpoints in a table, to verify, compare, restore into ``target`` and delete.

    ``target`` is what Restore loads into, as ``Checkpointer.restore`` takes it (a dict of
    name to module, optimizer, tensor or value); without it Restore is off.
    ``storage_options`` are fsspec's, for ``s3://`` and other URLs.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        target: dict[str, Any] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if target is not None and not isinstance(target, dict):
            raise ConfigError(f"target must be a dict of name to module, optimizer or tensor, "
                              f"not {type(target).__name__}")
        self.run = RunIndex(directory, storage_options)
        super().__init__()
        self.target = target
        self.error: str | None = None
        self.diff_frame: pd.DataFrame | None = None
        self.closed = False
        self._lock = threading.Lock()  # one action at a time, whichever thread asks
        self._pending: RowKey | None = None  # the step Delete asked to confirm
        self.refresh_button.on_click(lambda _: self.refresh())
        self.verify_button.on_click(lambda _: self.verify())
        self.diff_button.on_click(lambda _: self.diff())
        self.restore_button.on_click(lambda _: self.restore())
        self.delete_button.on_click(lambda _: self.delete())
        self.confirm_button.on_click(lambda _: self.confirm_delete())
        self.cancel_button.on_click(lambda _: self.cancel_delete())
        self.table.observe(self._on_select, names="selected")
        with _live_lock:
            previous = _live.get(self.run.url)
            _live[self.run.url] = self
        if previous is not None:
            previous.close()
        self.refresh()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        if self.closed:
            return {"text/plain": f"<closed nbckpt Browser of {self.run.url}>"}
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def rows(self) -> list[StepRow]:
        """Every step of every line, as the table shows them."""
        return list(self.run.rows)

    @property
    def selected(self) -> list[RowKey]:
        """The selected steps as (line, step), in the order they were selected."""
        keys = {row.id: row.key for row in self.run.rows}
        return [keys[i] for i in self.table.selected if i in keys]

    def select(self, *steps: int | str | tuple[str, int]) -> None:
        """Select steps as a click would: ``select(100, 200)`` or ``select(("branch-1", 60))``
        (a bare step number must name one step of one line)."""
        if len(steps) > 2:
            raise ConfigError("select at most two steps: two to diff, one to restore or delete")
        self.table.selected = [self._row_of(step).id for step in steps]

    def _row_of(self, step: int | str | tuple[str, int]) -> StepRow:
        if isinstance(step, tuple):
            return self.run.row(step)
        matches = [r for r in self.run.rows if r.id == step or (isinstance(step, int) and r.step == step)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise ConfigError(f"the run has no committed step {step!r}; it has "
                              f"{', '.join(r.id for r in self.run.rows) or 'none'}")
        raise ConfigError(f"step {step} is in {' and '.join(r.line for r in matches)}: name the line, "
                          f"e.g. select(({matches[-1].line!r}, {step}))")

    # -- actions: each returns what it did, or None with the reason in ``error`` -------------

    def refresh(self) -> bool:
        """Read the run's steps again (new ones appear, deleted ones go; the selection stays)."""
        return self._act("read the run", self._refresh) is not None

    def _refresh(self) -> bool:
        self.run.refresh()
        self._show_rows()
        if not self.run.rows:
            missing = not is_url(self.run.url) and not os.path.isdir(self.run.url)
            self._say("info", f"No committed checkpoint in {self.run.url}"
                      + (" (the directory does not exist)" if missing else "") + ".")
        return True

    def verify(self) -> list[RowKey] | None:
        """Verify the selected steps (every step when none is selected); return the damaged ones."""

        def work() -> list[RowKey]:
            keys = self.selected or [row.key for row in self.run.rows if row.problem is None]
            checks = self.run.verify(keys)
            damaged = [key for key, check in zip(keys, checks, strict=True) if check.state == "damaged"]
            self._show_rows()
            names = ", ".join(self.run.row(key).name for key in damaged)
            if damaged:
                self._say("error", f"Damaged: {names} (of {len(keys)} verified; see the table)")
            else:
                self._say("ok", f"Verified {len(keys)} step(s): every block reads back intact.")
            return damaged

        return self._act("verify", work)

    def diff(self) -> pd.DataFrame | None:
        """Compare the two selected steps tensor by tensor (the earlier one is ``a``)."""

        def work() -> pd.DataFrame:
            picked = self.selected
            if len(picked) != 2:
                raise ConfigError(f"select two steps to compare, not {len(picked)}")
            a, b = self.run.ordered(*picked)
            self._say("info", f"Loading {a.name} and {b.name} ...")
            a, b, frame = self.run.diff(a.key, b.key)
            self.diff_frame = frame
            self.diff_header.value = diff_summary(a, b, frame)
            self.diff_table.rows = diff_rows(frame)
            self._say("ok", f"Compared {a.name} with {b.name}.")
            return frame

        return self._act("diff", work)

    def restore(self) -> int | None:
        """Load the selected step into ``target``'s objects in place; return its step."""

        def work() -> int:
            key = self._one_selected("restore")
            if self.target is None:
                raise ConfigError("this browser has no target: Browser(..., target={'model': model, ...})")
            step = self.run.restore(key, self.target)
            names = ", ".join(map(repr, self.target))
            text = f"Restored {self.run.row(key).name} into {names}."
            newer = [s for s in self.run.lines.get(key[0], {}).get("steps", ()) if s > step]
            if newer:
                text += (" To train on from it in a new branch, restore it with the run's "
                         f"Checkpointer too: ckpt.restore(state, step={step}).")
            self._say("ok", text)
            return step

        return self._act("restore", work)

    def delete(self) -> bool:
        """Ask to delete the selected step: the confirm button (or :meth:`confirm_delete`) does it."""

        def work() -> bool:
            key = self._one_selected("delete")
            reason = self.run.refusal(key)
            if reason is not None:
                raise ConfigError(reason)
            self._pending = key
            question = f"Delete {self.run.row(key).name}? This cannot be undone."
            if is_url(self.run.url):
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
            row = self.run.row(key)
            self.run.delete(key)
            self.table.selected = [i for i in self.table.selected if i != row.id]
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
            if _live.get(self.run.url) is self:
                del _live[self.run.url]
        for widget in widgets_of(self.widget):
            widget.close()

    # -- the plumbing ---------------------------------------------------------------------------

    def _one_selected(self, what: str) -> RowKey:
        picked = self.selected
        if len(picked) != 1:
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
            notes = [one_line(w.message if isinstance(w.message, Warning) else Warning(w.message))
                     for w in caught]
            if notes:
                self.message.value += "".join(notice("info", note) for note in notes)
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
        self._show_buttons(selected=len(self.selected), can_restore=self.target is not None, busy=busy)

    def _on_select(self, change: dict[str, Any]) -> None:
        if self._pending is not None and self._pending not in self.selected:
            self.cancel_delete()
        self._busy(self._lock.locked())

    def _show_rows(self) -> None:
        self.table.rows = [step_row(row, self.run.checks.get(row.key), self.run.lines.get(row.line, {}))
                           for row in self.run.rows]
        live = {row.id for row in self.run.rows}
        if any(i not in live for i in self.table.selected):
            self.table.selected = [i for i in self.table.selected if i in live]
        lines = len([name for name, line in self.run.lines.items() if line["steps"]])
        self.title.value = (f'<b>Checkpoints</b> of <code title="{html.escape(self.run.url)}">'
                            f"{html.escape(self.run.directory)}</code>: "
                            f"{len(self.run.rows)} step(s) in {lines} line(s)")
