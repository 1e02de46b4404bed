"""The thread that applies retention: a commit observer the run wires on rank 0 (as it wires the
mirror), which after each commit it is told of deletes what the one retention decision
(:func:`._retention.doomed`) gives up, but the steps another observer still reads."""

from __future__ import annotations

import logging
from functools import partial

from .._errors import describe_error
from ._context import Context
from ._faults import fault_point
from ._format import step_name
from ._retention import RetentionPolicy, doomed
from ._saver import Commit
from ._store import Store
from ._timeline import now_ns
from ._workers import Backlog, Worker

__all__ = ["Retainer"]

_log = logging.getLogger("nbckpt")


class Retainer:
    """Deletes what ``policy`` does not keep, one pass after each commit, on a background thread
    of its own (a slow delete never delays a save)."""

    def __init__(self, policy: RetentionPolicy, context: Context) -> None:
        self.policy, self.timeline = policy, context.timeline
        self._worker = Worker("nbckpt-retention", nice=context.nice)
        self._backlog = Backlog(self._worker)

    def committed(self, commit: Commit) -> None:
        """A pass as after ``commit``: waited for by :meth:`settle` from now on, queued once the
        save's future is set and its callbacks have run (a pointer a framework moved to the step,
        which a ``CustomSteps`` policy reads, is seen)."""
        queue = self._backlog.promise(partial(self._pass, commit))
        commit.settled.add_done_callback(lambda _: queue())

    def release(self, store: Store, steps: list[int]) -> set[int]:
        """It reads no step: all of ``steps`` may go."""
        return set()

    def settle(self) -> None:
        """Block until every pass asked for (queued or not yet) is over."""
        self._backlog.wait()

    def stop(self, wait: bool) -> None:
        self._worker.stop(wait)

    def _pass(self, commit: Commit) -> None:
        """Only the steps committed before ``commit.step`` count (a late pass must not take a
        newer step for an old one), only those of its names (a stray save never rotates out the
        run's real ones), never the step itself."""
        try:
            fault_point("retention.pass", commit.step)
            deleting = doomed(self.policy, commit.facts, commit.step, commit.before)
            busy = commit.release(deleting) if deleting else set()
            for step in deleting:
                if step not in busy:
                    self._delete(commit, step)
        except Exception as exc:
            _log.warning("nbckpt: retention failed: %s", describe_error(exc))

    def _delete(self, commit: Commit, step: int) -> None:
        began = now_ns()
        try:
            commit.store.delete(step)
        except Exception as exc:
            reason = describe_error(exc)
            _log.warning("nbckpt: could not delete old checkpoint %s: %s", step_name(step), reason)
            return
        commit.gone(step)
        self.timeline.record("delete", began, step=step)
