"""The run a Checkpointer opens: its directory prepared, locked and cleaned (:func:`open_run`),
and the line it follows (:class:`Run`; the lines themselves are in :mod:`._lines`)."""

from __future__ import annotations

import uuid
import warnings
from typing import Any

from .._errors import CheckpointError, ConfigError
from ._context import Context
from ._format import MAIN
from ._lines import Line, ancestry, discover, last_committed, lineage, on, start_branch, write_record
from ._mirror import Mirror, mirror_of
from ._plain_dcp import PlainDcpSteps, said_shared
from ._reader import Readable
from ._restorer import Options, Restorer
from ._saver import Saver
from ._store import Store

__all__ = ["Run", "open_run"]


def said_cleaned(url: str, recovered: list[str], stacklevel: int) -> None:
    warnings.warn(
        f"nbckpt: cleaned up {len(recovered)} leftover(s) of interrupted saves in {url}: "
        f"{', '.join(recovered)}",
        stacklevel=stacklevel,
    )


def open_run(store: Store, read_only: bool) -> tuple[str, set[int]]:
    """Open the run's directory on rank 0: prepared, locked and cleaned of what interrupted saves
    left (none of it when ``read_only``); this opening's nonce and the committed steps."""
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
    said_shared(store)
    return uuid.uuid4().hex[:12], committed


def readables(lines: dict[str, Line], name: str) -> tuple[list[Readable], list[str]]:
    """Where line ``name`` reads its steps (:func:`ancestry`), each place followed by the steps
    plain DCP wrote in its folder (torchtitan's, read-only); and the line each belongs to."""
    own, plain = ancestry(lines, name), ancestry(lines, name, PlainDcpSteps)
    places = [place for pair in zip(own, plain, strict=True) for place in pair]
    return places, [line for line in lineage(lines, name) for _ in range(2)]


class Run:
    """The lines of the run in ``root`` and the one this Checkpointer is on."""

    def __init__(
        self,
        root: Store,
        mirror: Mirror | None,
        saver: Saver,
        context: Context,
        *,
        line: str | None,
        read_only: bool,
    ) -> None:
        self.root, self.mirror, self.saver, self.context = root, mirror, saver, context
        group = self.group = context.caller
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
        stores, chain_names = readables(self.lines, name)
        if self.mirror is not None:
            self.mirror.follow(name, [self.lines[n] for n in names])
            mirrored = on(self.lines, self.mirror.root)
            if name in mirrored:
                more, more_names = readables(mirrored, name)
                stores, chain_names = stores + more, chain_names + more_names
        self._chain = chain_names
        return Restorer(stores, self.context)

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
        copies), plain-DCP steps included: a restore without a step picks the newest of either kind."""
        newer = [s for store in self.restorer.stores for s in store.committed() if s > step]
        source = self.restorer.last_source
        self.restored_from = self.restorer.stores[source].url
        line = self._chain[source] if source < len(self._chain) else self.current
        self._fork = (line, step) if newer and not self.read_only else None

    def restore(self, state: dict[str, Any], step: int | None, options: Options) -> int:
        """The restorer's restore of ``state``; a Ctrl-C held back until the state was loaded in
        full counts as a restore too (a save after it must still branch off)."""
        try:
            restored = self.restorer.restore(state, step, options)
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
        for readable in readables(self.lines, self.current)[0]:
            found.update(readable.committed())
        return sorted(found)

    def undeletable(self, store: Store, step: int) -> str | None:
        """Why ``step`` of ``store`` is not nbckpt's to delete (None: nothing here says so)."""
        if PlainDcpSteps(store).committed_at(step) is None:
            return None
        return f"step {step} in {self.root.url} was written by plain DCP; nbckpt never deletes it"

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
