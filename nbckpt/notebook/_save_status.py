"""One save of a notebook session (:class:`Save`) and the live status line under its cell
(:class:`SaveStatus`): staged, persisting, committed or failed."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from .._util import format_bytes
from ..engine import SaveHandle
from ._cell import one_line

__all__ = ["Save", "SaveStatus"]


class SaveStatus:
    """A compact, self-describing line for one save: staged, persisting, committed or failed."""

    def __init__(self, handle: SaveHandle, directory: str, mode: str) -> None:
        self.handle = handle
        self.directory = directory
        self.mode = mode

    def _parts(self) -> tuple[str, str]:
        h = self.handle
        where = f" -> {self.directory}" if self.directory else ""
        head = f"nbckpt {self.mode} step {h.step} ({format_bytes(h.bytes)}){where}"
        error = h.error
        if error is not None:
            return "failed", f"{head}: failed: {one_line(error)}"
        stall = f"stall {h.stall_s * 1e3:.1f} ms"
        if h.wait_s > 1e-4:  # the same names as the bench's: the stall, and its wait part
            stall += f" (wait for the earlier save {h.wait_s * 1e3:.1f} ms)"
        if h.committed.done():
            record = h.committed.result()
            return "committed", (
                f"{head}: committed · {stall} · "
                f"persist {record.persist_s:.2f} s · {record.write_gbs:.2f} GB/s"
            )
        return h.phase, f"{head}: {h.phase} · {stall} · writing in the background"

    def __repr__(self) -> str:
        return self._parts()[1]

    def _repr_html_(self) -> str:
        phase, text = self._parts()
        colour = {"committed": "#1a7f37", "failed": "#cf222e"}.get(phase, "#9a6700")
        return (
            f'<div class="nbckpt-save nbckpt-{phase}" style="font-family:monospace;'
            f'color:{colour}">{html.escape(text)}</div>'
        )


@dataclass(kw_only=True)
class Save:
    """One save of this session, for ``%ckpt_status``, ``%ckpt_wait`` and ``%ckpt_timeline``."""

    key: str
    directory: str
    mode: str
    names: tuple[str, ...]
    handle: SaveHandle
    shown_at: int = 0  # execution count of the cell whose magic displayed it
    live: list[tuple[SaveStatus, Any]] = field(default_factory=list)  # (status, DisplayHandle)

    def finalise(self, live: tuple[SaveStatus, Any]) -> None:
        """Show the save's final state in one of its live displays (at most once)."""
        try:
            self.live.remove(live)
        except ValueError:
            return  # the commit callback and %ckpt_wait raced; the other one updated it
        status, shown = live
        shown.update(status)
