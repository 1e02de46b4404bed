"""The lab's live timeline: it grows as events arrive, a strategy's lanes starting again when its
next run begins, and shows the exact timeline of each strategy's last repeat at the end."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go

from ..engine import Event
from ._live_figure import live_figure
from ._timeline_figures import events_frame, extend_timeline, timeline_figure

__all__ = ["LabTimeline"]


class LabTimeline:
    """A live timeline figure (``figure``) and the rows it shows. Only the lab's updater thread
    (or the main thread between runs) calls it."""

    def __init__(self) -> None:
        self.figure: go.FigureWidget = live_figure(
            timeline_figure(pd.DataFrame(columns=["kind", "start_s", "end_s"]))
        )
        self.figure.update_layout(title="Timeline (live): each strategy's latest run")
        self.figure._config = {**self.figure._config, "responsive": True}
        self._empty_height = self.figure.layout.height
        self._origins: dict[str, int] = {}  # each strategy's bars count from its run's first event
        self._rows: dict[str, list[pd.DataFrame]] = {}
        self._finished: set[str] = set()  # strategies whose run ended: their next events restart

    def clear(self) -> None:
        """No bars, no lanes: a clean slate for a new run."""
        self._origins.clear()
        self._rows.clear()
        self._finished.clear()
        self.redraw(None)

    def finish(self, strategy: str) -> None:
        """``strategy``'s run ended: its next event starts its lanes again."""
        self._finished.add(strategy)

    def redraw(self, timeline: pd.DataFrame | None) -> None:
        """Replace the figure's bars and lanes with ``timeline`` (None: an empty figure)."""
        # Not one batch_update: inside one, reads return the values from before it, and
        # extend_timeline reads the lanes it adds to.
        self.figure.data = ()
        self.figure.update_layout(yaxis_categoryarray=(), height=self._empty_height)
        if timeline is not None and len(timeline):
            extend_timeline(self.figure, timeline, by_rank=False)

    def extend(self, events: Sequence[Event]) -> None:
        """Add ``events`` (the lab's run has one rank) to the figure."""
        by_strategy: dict[str, list[Event]] = {}
        for event in events:
            by_strategy.setdefault(event.label, []).append(event)
        restarted = False
        frames = []
        for strategy, group in by_strategy.items():
            if strategy in self._finished:  # a new run of this strategy: show it from its start
                self._finished.discard(strategy)
                self._rows[strategy] = []
                self._origins.pop(strategy, None)
                restarted = True
            frame = events_frame(group, self._origins.setdefault(strategy, group[0].start_ns))
            self._rows.setdefault(strategy, []).append(frame)
            frames.append(frame)
        if not frames:
            return
        if restarted:
            self.redraw(pd.concat([f for group in self._rows.values() for f in group], ignore_index=True))
        else:
            extend_timeline(self.figure, pd.concat(frames, ignore_index=True), by_rank=False)
