"""What the parts of one Checkpointer share and are each given at their making: the timeline
they record on, the I/O pool their reads and writes run on, the ranks they agree with, and how
far below the caller's priority their threads run. One object, so that a part that needs one
more of them changes no signature on the way to it."""

from __future__ import annotations

from dataclasses import dataclass

from ._ranks import Group, RankInfo
from ._timeline import Timeline
from ._workers import Pool

__all__ = ["Context"]


@dataclass(frozen=True)
class Context:
    """The Checkpointer's timeline, I/O pool, ranks and its threads' ``nice`` (``writer_nice``)."""

    timeline: Timeline
    io: Pool
    ranks: RankInfo
    nice: int

    @property
    def caller(self) -> Group:
        """The ranks' group of the caller's thread (opening, planning, restoring, branching)."""
        return self.ranks.caller
