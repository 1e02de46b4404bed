"""The lines of a run, and the one a Checkpointer follows: restoring an older step and training on
starts a branch, so that the new saves never meet the abandoned line's higher steps (and
"newest" never picks one of those); restores read a line's ancestors and the mirror's copies too.

    run1/                      the first line ("main")
      step-000050/ step-000100/
      branch-1/                a line that went on from main's step 50
        branch.json            {"parent": "main", "from_step": 50, "created": ...}
        step-000060/

A branch sees its parent's steps up to the one it started from. Opening a run continues the
line committed to last, unless one is named. A ``branch-N`` that is a symlink is never a line
(it could point anywhere). A mirror holds the same lines in the same layout.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import CheckpointError, ConfigError
from ._files import Source
from ._format import BRANCH_FILE, BRANCH_LIMIT, MAIN, MANIFEST, branch_name, is_branch
from ._manifest import Manifest
from ._store import Readable, Store

__all__ = ["Line", "ancestry", "discover", "last_committed", "lineage", "on", "start_branch", "write_record"]


@dataclass(frozen=True)
class Line:
    """One line of a run: where its steps are, and where it branched off."""

    name: str
    store: Store
    parent: str | None = None
    from_step: int | None = None


class StepLimited:
    """A parent line as its branch sees it: only the steps up to where the branch started."""

    def __init__(self, store: Readable, last_step: int) -> None:
        self._store, self._last = store, last_step
        self.url = store.url
        self.is_local = store.is_local

    def committed(self) -> dict[int, str]:
        return {s: path for s, path in self._store.committed().items() if s <= self._last}

    def committed_at(self, step: int) -> str | None:
        return self._store.committed_at(step) if step <= self._last else None

    def read_manifest(self, step: int, location: str) -> tuple[Manifest, bytes]:
        return self._store.read_manifest(step, location)

    def modified(self, location: str, name: str) -> float:
        return self._store.modified(location, name)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        return self._store.read_small(location, name, limit)

    def source(self, location: str, name: str, size: int | None) -> Source:
        return self._store.source(location, name, size)


def discover(root: Store) -> dict[str, Line]:
    """Every line of the run at ``root``: main, and each ``branch-N`` directory (never a symlink)
    with a valid branch.json."""
    lines = {MAIN: Line(MAIN, root)}
    for name in sorted(root.names(), key=lambda n: (len(n), n)):
        store = root.child(name) if is_branch(name) else None
        if store is None:
            continue
        try:
            record = json.loads(store.read_small(store.url, BRANCH_FILE, BRANCH_LIMIT))
            parent, from_step = str(record["parent"]), int(record["from_step"])
        except (OSError, ValueError, KeyError, TypeError, CheckpointError):
            continue  # a branch whose record never got written: it holds nothing that counts
        lines[name] = Line(name, store, parent, from_step)
    return lines


def last_committed(lines: dict[str, Line]) -> str | None:
    """The line a run continues on by default: the one with the most recent commit (None when
    no line has one)."""
    best, best_time = None, -1.0
    for name, line in lines.items():
        committed = line.store.committed()
        if not committed:
            continue
        try:  # a line's highest step is its last commit (a branch's steps only go up)
            modified = line.store.modified(committed[max(committed)], MANIFEST)
        except OSError:
            continue
        if modified > best_time:
            best, best_time = name, modified
    return best


def lineage(lines: dict[str, Line], name: str) -> list[str]:
    """Line ``name``, then its parent, its parent's parent... (a cycle of records ends the walk)."""
    if name not in lines:
        raise ConfigError(f"the run has no line {name!r}; it has {', '.join(lines)}")
    names = [name]
    line = lines[name]
    while line.parent is not None and line.from_step is not None and line.parent in lines:
        if line.parent in names:
            break
        names.append(line.parent)
        line = lines[line.parent]
    return names


def ancestry(
    lines: dict[str, Line], name: str, view: Callable[[Store], Readable] | None = None
) -> list[Readable]:
    """Where line ``name`` reads its steps (:func:`lineage`'s order): itself, then each ancestor
    up to the earliest fork point on the way there; each line's store seen through ``view``
    (the store itself by default)."""
    see: Callable[[Store], Readable] = view or (lambda store: store)
    names = lineage(lines, name)
    chain: list[Readable] = [see(lines[name].store)]
    last: int | None = None
    for child, parent in itertools.pairwise(names):
        from_step = lines[child].from_step
        assert from_step is not None  # lineage follows only lines that name their fork point
        last = from_step if last is None else min(last, from_step)
        chain.append(StepLimited(see(lines[parent].store), last))
    return chain


def on(lines: dict[str, Line], root: Store) -> dict[str, Line]:
    """The same lines in another place with the same layout (the mirror, at ``root``)."""
    placed = {}
    for name, line in lines.items():
        store = root if name == MAIN else root.child(name)
        if store is not None:
            placed[name] = Line(name, store, line.parent, line.from_step)
    return placed


def write_record(line: Line) -> None:
    """Create the folder of branch ``line`` and write its branch.json (before any step of it)."""
    line.store.prepare()
    record = {"parent": line.parent, "from_step": line.from_step, "created": time.time()}
    line.store.write_small(BRANCH_FILE, json.dumps(record).encode())


def start_branch(root: Store, lines: dict[str, Line], parent: str, from_step: int) -> Line:
    """A new line going on from ``parent``'s ``from_step``; its record is written before any step."""
    # Numbered past every branch-N entry, lines or not: a symlink or a branch whose record never
    # got written must not be taken over.
    numbers = [int(name.split("-")[1]) for name in [*lines, *root.names()] if is_branch(name)]
    name = branch_name(max(numbers, default=0) + 1)
    store = root.child(name)
    if store is None:  # appeared since the listing: not ours to write into
        raise CheckpointError(f"cannot start line {name} in {root.url}: {name} appeared meanwhile")
    line = Line(name, store, parent, from_step)
    write_record(line)
    lines[name] = line
    return line
