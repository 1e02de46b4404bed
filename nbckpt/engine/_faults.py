"""Named fault seams: the points where a test makes the engine fail, or wait, by name, instead of
patching a private function that a refactoring renames without the test noticing (the sibling of
``_store.arm_crash``, which kills the process at its points).

A point is reached with :func:`fault_point`; nothing armed there costs one dict lookup. The
points, and what their action is called with:

- ``staging.fit`` (): a slot is about to be fitted to a save's files;
- ``save.wait`` (step): a save found ``max_inflight`` saves in flight and waits for room;
- ``store.sink`` (location, file name): a local store is about to create a step's file (a
  save's data, an upload's copy; not the manifest, nor the store's own small files);
- ``store.names`` (the store's URL): a store (local or object) is about to list its root;
- ``file.write`` (path): bytes are about to be written to a new local file;
- ``file.open`` (path): a local checkpoint file is about to be opened for reading;
- ``dir.fsync`` (path): a local directory's entries are about to be made durable;
- ``file.exchange`` (path, path): two local paths are about to be swapped atomically (a step
  saved again over itself); an OSError raised there is a file system without the exchange
  (NFS: no ``renameat2``), and the store renames in two steps instead;
- ``retention.pass`` (newest step): a retention pass begins, on its thread;
- ``mirror.upload`` (local step location, file name): the mirror is about to copy one file;
- ``store.share`` (committed step's location, new location, file name): a directory is about to
  hard-link one file into a new step (an OSError raised there is a file system refusing links);
- ``ranks.arrive`` (tag): a thread has checked in before a collective of several ranks (the
  caller's, or the background's agreement on a save staged at once) and is about to wait for the
  other ranks' check-ins;
- ``set_aside.moved`` (the run's URL, folder): a set-aside has just moved one step folder into
  its set-aside run (beside crash point ``set_aside_moving``: a Ctrl-C there, not a kill).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["POINTS", "armed", "fault_point"]

POINTS = (
    "staging.fit",
    "save.wait",
    "store.sink",
    "store.names",
    "file.write",
    "file.open",
    "dir.fsync",
    "file.exchange",
    "retention.pass",
    "mirror.upload",
    "store.share",
    "ranks.arrive",
    "set_aside.moved",
)
_actions: dict[str, Callable[..., None]] = {}


@contextmanager
def armed(point: str, action: Callable[..., None]) -> Iterator[None]:
    """Call ``action`` at ``point`` (on whichever thread reaches it) until the block ends; what it
    raises is raised there."""
    if point not in POINTS:
        raise ValueError(f"no fault point {point!r}; the points are {', '.join(POINTS)}")
    _actions[point] = action
    try:
        yield
    finally:
        _actions.pop(point, None)


def fault_point(point: str, *args: Any) -> None:
    action = _actions.get(point)
    if action is not None:
        action(*args)
