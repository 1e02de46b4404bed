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
import uuid
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointError, ConfigError
from ._files import Source
from ._format import BRANCH_FILE, BRANCH_LIMIT, MAIN, MANIFEST, branch_name, is_branch
from ._ranks import Group
from ._reader import Readable
from ._restorer import Restorer
from ._saver import Saver
from ._store import Store
from ._timeline import Timeline
from ._workers import Pool

if TYPE_CHECKING:
    from ._mirror import Mirror

__all__ = ["Line", "Run", "discover", "on", "open_run", "write_record"]


@dataclass(frozen=True)
class Line:
    """One line of a run: where its steps are, and where it branched off."""

    name: str
    store: Store
    parent: str | None = None
    from_step: int | None = None


class StepLimited:
    """A parent line as its branch sees it: only the steps up to where the branch started."""

    def __init__(self, store: Store, last_step: int) -> None:
        self._store, self._last = store, last_step
        self.url = store.url
        self.is_local = store.is_local

    def committed(self) -> dict[int, str]:
        return {s: path for s, path in self._store.committed().items() if s <= self._last}

    def committed_at(self, step: int) -> str | None:
        return self._store.committed_at(step) if step <= self._last else None

    def foreign(self) -> dict[int, str]:
        return {s: path for s, path in self._store.foreign().items() if s <= self._last}

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


def ancestry(lines: dict[str, Line], name: str) -> list[Store | StepLimited]:
    """Where line ``name`` reads its steps (:func:`lineage`'s order): itself, then each ancestor
    up to the earliest fork point on the way there."""
    names = lineage(lines, name)
    chain: list[Store | StepLimited] = [lines[name].store]
    last: int | None = None
    for child, parent in itertools.pairwise(names):
        from_step = lines[child].from_step
        assert from_step is not None  # lineage follows only lines that name their fork point
        last = from_step if last is None else min(last, from_step)
        chain.append(StepLimited(lines[parent].store, last))
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


def said_cleaned(url: str, recovered: list[str], stacklevel: int) -> None:
    warnings.warn(f"nbckpt: cleaned up {len(recovered)} leftover(s) of interrupted saves in {url}: "
                  f"{', '.join(recovered)}", stacklevel=stacklevel)


def open_run(store: Store, read_only: bool) -> tuple[str, set[int]]:
    """Open the run's directory on rank 0: prepared, locked and cleaned of what interrupted saves
    left (none of it when ``read_only``); this opening's nonce and the committed steps."""
    from ._mirror import mirror_of  # the mirror imports the lines

    if read_only:
        return "", set(store.committed())
    store.prepare()
    owner = mirror_of(store)  # after prepare: it says best why a target is unusable
    if owner is not None:
        raise ConfigError(
            f"{store.url} is the mirror of the run {owner}; open it with read_only=True to "
            "read it, or name it as mirror= of that run"
        )
    store.lock()
    try:
        recovered = store.recover()
        committed = set(store.committed())
    except BaseException:
        store.unlock()  # a failed open must not hold the directory for the process's life
        raise
    if recovered:
        said_cleaned(store.url, recovered, stacklevel=6)
    return uuid.uuid4().hex[:12], committed


class Run:
    """The lines of the run in ``root`` and the one this Checkpointer is on."""

    def __init__(
        self, root: Store, mirror: Mirror | None, saver: Saver, io: Pool, group: Group, timeline: Timeline, *,
        line: str | None, read_only: bool,
    ) -> None:
        self.root, self.mirror, self.saver, self._io, self.group, self.timeline = (
            root, mirror, saver, io, group, timeline
        )
        self.read_only, self._writes = read_only, group.rank == 0 and not read_only
        self.current = MAIN
        self.restored_from: str | None = None
        self._from_mirror: set[str] = set()  # lines only the mirror still holds (a lost disk)
        self._fork: tuple[str, int] | None = None  # (line, step) restored while newer steps exist
        self._chain: list[str] = []  # the line each of the restorer's stores belongs to
        self.lines = self._discover()
        self.restorer = self._switch(line or group.from_rank0(("line",), self._default_line), stacklevel=5)
        if mirror is not None and self._writes:
            mirror.resume(self.lines)  # what a crash kept from the mirror goes up now

    def _discover(self) -> dict[str, Line]:
        """The run's lines; with a mirror, also those only the mirror still holds (after the
        local disk was lost), so that a restore from the mirror goes on in the right line."""
        lines = discover(self.root)
        if self.mirror is not None:
            for name, line in self.mirror.lines().items():
                store = None if name in lines else self.root.child(name)
                if store is not None:
                    lines[name] = Line(name, store, line.parent, line.from_step)
                    self._from_mirror.add(name)
        return lines

    def _default_line(self) -> str:
        """The line committed to last: in the run's directory, else (a lost disk) on the mirror."""
        found = last_committed(self.lines)
        if found is None and self.mirror is not None:
            found = last_committed(on(self.lines, self.mirror.root))
        return found or MAIN

    def _switch(self, name: str, stacklevel: int = 5) -> Restorer:
        """Make line ``name`` the one saves go to and restores read from (its ancestors too)."""
        chain = ancestry(self.lines, name)
        names = lineage(self.lines, name)
        line = self.lines[name]
        if name != self.current:
            if self._writes:
                for missing in [n for n in names if n in self._from_mirror]:
                    write_record(self.lines[missing])  # the mirror's record, back in the run
                    self._from_mirror.discard(missing)
                recovered = line.store.recover()  # a branch's leftovers, as the main line's at open
                if recovered:
                    said_cleaned(line.store.url, recovered, stacklevel)
            self.saver.follow(line.store)
        self.current = name
        stores: list[Readable] = list(chain)
        if self.mirror is not None:
            self.mirror.follow(name, [self.lines[n] for n in names])
            mirrored = on(self.lines, self.mirror.root)
            if name in mirrored:
                stores.extend(ancestry(mirrored, name))
                names = names + lineage(mirrored, name)
        self._chain = names
        return Restorer(stores, self._io, self.group, self.timeline)

    def branch_if_rewound(self) -> None:
        """Before the first save after restoring an older step: go on in a new line."""
        if self._fork is None:
            return
        parent, step = self._fork
        self._fork = None

        def start() -> str:
            return start_branch(self.root, self.lines, parent, step).name

        name = self.group.from_rank0(("branch", step), start)
        self.lines = self._discover()
        self.restorer = self._switch(name)
        warnings.warn(
            f"nbckpt: step {step} was restored while newer steps exist; saves now go to a new line, "
            f"{name} ({self.root.url}/{name}), and the newer steps stay where they are",
            stacklevel=4,  # the caller of Checkpointer.save
        )

    def restored(self, step: int) -> None:
        """The restorer loaded ``step``: a save after it branches off if newer steps exist
        anywhere the line reads from (the mirror too: after a lost disk it may hold the only
        copies)."""
        newer = [s for store in self.restorer.stores for s in store.committed() if s > step]
        source = self.restorer.last_source
        self.restored_from = self.restorer.stores[source].url
        line = self._chain[source] if source < len(self._chain) else self.current
        self._fork = (line, step) if newer and not self.read_only else None

    def restore(self, state: dict[str, Any], step: int | None, **options: Any) -> int:
        """The restorer's restore of ``state``; a Ctrl-C held back until the state was loaded in
        full counts as a restore too (a save after it must still branch off)."""
        try:
            restored: int = self.restorer.restore(state, step, **options)
        except KeyboardInterrupt:
            if self.restorer.applied is not None:
                self.restored(self.restorer.applied)
            raise
        self.restored(restored)
        return restored

    def steps(self) -> list[int]:
        """Committed steps of the current line and of its ancestors up to where it went on from
        them, plain DCP checkpoints (torchtitan's) included, oldest first."""
        found: set[int] = set()
        for readable in ancestry(self.lines, self.current):
            found.update(readable.committed())
            found.update(readable.foreign())
        return sorted(found)

    def store_of(self, name: str) -> Store:
        """The store of line ``name`` (one started by another run since this one opened, too)."""
        if name not in self.lines:
            self.lines = self._discover()
        if name not in self.lines:
            raise CheckpointError(f"{self.root.url} has no line {name!r}")
        return self.saver.store if name == self.current else self.lines[name].store

    def describe(self) -> dict[str, dict[str, Any]]:
        """Each line's parent, the step it went on from, its own steps, and which is current."""
        return {
            name: {
                "parent": line.parent,
                "from_step": line.from_step,
                "steps": list(line.store.committed()),
                "current": name == self.current,
            }
            for name, line in discover(self.root).items()
        }
