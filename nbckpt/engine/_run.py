"""The run a Checkpointer opens: its directory prepared, locked and cleaned (:func:`open_run`),
and the places its restores read (:class:`Run`), where it sets newer steps aside after a rewind
(the set-aside runs themselves are in :mod:`._set_aside`). A second tier (the mirror, which the
Checkpointer wires) is known here only by what :class:`Tier` says of it."""

from __future__ import annotations

import logging
import uuid
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

from .._errors import CheckpointError, describe_error
from ._context import Context
from ._plain_dcp import PlainDcpSteps, said_shared
from ._restorer import Candidate, Options, Restorer
from ._saver import Saver
from ._set_aside import (
    TierNote,
    announce,
    earlier_branch_note,
    finish,
    listing,
    set_aside,
    set_aside_into,
    visible,
)
from ._store import Readable, Store

__all__ = ["Run", "Tier", "claim_run", "open_run"]

_log = logging.getLogger("nbckpt")


def said_cleaned(url: str, recovered: list[str], stacklevel: int) -> None:
    warnings.warn(
        f"nbckpt: cleaned up {len(recovered)} leftover(s) of interrupted saves in {url}: "
        f"{', '.join(recovered)}",
        stacklevel=stacklevel,
    )


#: ``open_run``'s warnings point at the line that made the Checkpointer, this many frames up:
#: open_run, the _shared function that calls it, Group.exchange, from_rank0 (or _shared's
#: _rank0), open_on_rank0, Checkpointer.__init__, that line.
_AT_CALLER = 7


def claim_run(store: Store, refuse: Callable[[Store], None]) -> None:
    """Rank 0's claim of the run's directory to write it, before :func:`open_run`: prepared and
    locked. ``refuse`` raises where the directory is no run's to write (a second tier's: its
    marker)."""
    store.prepare()
    refuse(store)  # after prepare: it says best why a target is unusable
    store.lock()


def open_run(store: Store, read_only: bool) -> tuple[str, set[int]]:
    """Open the run's directory on rank 0, once claimed (:func:`claim_run`): cleaned of what
    interrupted saves left (not when ``read_only``); this opening's nonce and the committed steps."""
    if read_only:
        return "", set(store.committed())
    try:
        recovered = store.recover()
        finished = finish(store)  # before anything reads it: "newest" never picks a step set aside
        committed = set(store.committed())
        note = earlier_branch_note(store)
    except BaseException:
        store.unlock()  # a failed open must not hold the directory for the process's life
        raise
    if recovered:
        said_cleaned(store.url, recovered, stacklevel=_AT_CALLER + 1)
    if finished is not None:
        warnings.warn(
            f"nbckpt: finished setting steps aside into {store.url}/{finished}", stacklevel=_AT_CALLER
        )
    if note is not None:
        warnings.warn(note, stacklevel=_AT_CALLER)
    said_shared(store, stacklevel=_AT_CALLER + 1)
    return uuid.uuid4().hex[:12], committed


def newer_folders(store: Store, step: int) -> list[str]:
    """The step folders of ``store`` newer than ``step``: nbckpt's and plain DCP's (torchtitan's;
    moved, never deleted), oldest first."""
    steps = {**PlainDcpSteps(store).committed(), **store.committed()}
    root = store.url.rstrip("/")
    locations = [steps[s].rstrip("/") for s in sorted(steps) if s > step]
    return [path.rsplit("/", 1)[-1] for path in locations if path != root]


class Tier(Protocol):
    """A second place that holds the run's steps, written on a thread of its own after each
    commit (the mirror, which the Checkpointer wires): restores read it after the run's directory,
    and the steps the run sets aside go aside there too, once the writes queued before are over."""

    root: Store

    def resume(self, run: Store) -> None:
        """Queue what the tier lacks of ``run``'s committed steps (a crash cut its writes short)."""

    def moved(self, source: Store, locations: Mapping[int, str]) -> None:
        """Committed steps of ``source`` moved to ``locations``: writes waiting for them read there."""

    def after_uploads(self, action: Callable[[Store], None], what: str) -> None:
        """Run ``action`` on :attr:`root`, on the tier's thread, after the writes queued before."""


class Run:
    """The places the run's restores read (its directory, then its second tier; each followed by
    the steps plain DCP wrote there), and the set-aside of newer steps after a rewind."""

    def __init__(
        self,
        root: Store,
        tier: Tier | None,
        saver: Saver,
        context: Context,
        *,
        read_only: bool,
    ) -> None:
        self.root, self.tier, self.saver, self.context = root, tier, saver, context
        group = self.group = context.caller
        self.read_only, self._writes = read_only, group.rank == 0 and not read_only
        self.restored_from: str | None = None
        self._rewound: int | None = None  # the step restored while newer steps exist
        self._note = TierNote(root)  # the tier's folders hidden until its thread sets them aside
        if tier is not None and self._writes:
            self._finish_on_tier(tier)
        places: list[Store] = [root] + ([tier.root] if tier is not None else [])
        # what a set-aside cut short (or the tier's, not yet done) moves is hidden from restores
        views = [visible(root)] + ([visible(tier.root, self._note)] if tier is not None else [])
        stores: list[Readable] = []
        for view, place in zip(views, places, strict=True):
            stores += [view, PlainDcpSteps(place)]
        self.restorer = Restorer(stores, context)
        if tier is not None and self._writes:
            tier.resume(root)  # what a crash kept from the tier goes up now

    def _finish_on_tier(self, tier: Tier) -> None:
        try:
            finish(tier.root)
            self._note.carry_out(tier.root)
        except (OSError, CheckpointError) as exc:
            warnings.warn(
                f"nbckpt: cannot finish setting steps aside in {tier.root.url}: {exc}", stacklevel=5
            )

    def set_aside_if_rewound(self) -> None:
        """Before the first save after restoring an older step: the newer steps move into a
        set-aside run of their own in the run's directory (rank 0 moves, the other ranks wait for
        it), and on the second tier once the writes queued before are over (hidden from restores
        until then), so that the new save's steps never meet them."""
        if self._rewound is None:
            return
        after = self._rewound
        self.saver.wait()  # no commit nor retention pass may touch the steps while they move
        made = self.group.from_rank0(("set aside", after), partial(self._set_aside, after))
        self._rewound = None
        self.saver.recount()  # every rank: the moved steps are no longer the run's
        if made is not None:
            warnings.warn(
                f"nbckpt: step {after} was restored while newer steps exist; those are set aside, "
                f"still restorable, in {made}",
                stacklevel=4,  # the caller of Checkpointer.save
            )

    def _set_aside(self, after: int) -> str | None:
        """Rank 0's part: move the run's steps newer than ``after`` (a set-aside a crash cut short
        is finished first) and queue the tier's; where the run's went (None: there were none)."""
        try:
            # Cut short here (Ctrl-C while they moved, the save raising KeyboardInterrupt), this
            # set-aside is tried again at the next save, which finds its steps moved by this
            # finish: what it moved is told and said as the set-aside's own (before, the retry
            # found nothing left to move, warned nothing and never told the tier, whose uploads
            # waiting for those steps then failed).
            finished = finish(self.root)
            folders = newer_folders(self.root, after)
        except OSError as exc:
            raise self._not_set_aside(after, exc) from exc
        # The tier's intent goes first: killed while the run's steps move (or just after), the
        # tier's copies of them would otherwise be the newest steps the next open restores.
        on_tier = self._announce_on_tier(self.tier, after, folders) if self.tier is not None else None
        try:
            name = set_aside(self.root, after, folders) if folders else None
        except OSError as exc:  # what moved stays moved: the next save (or open) finishes the rest
            raise self._not_set_aside(after, exc) from exc
        moved = [store for n in (finished, name) if n is not None and (store := self.root.child(n))]
        if self.tier is not None and on_tier is not None:
            for store in moved:
                self.tier.moved(self.root, store.committed())  # waiting writes read them there
            self.tier.after_uploads(on_tier, f"set aside its steps newer than {after}")
        return " and ".join(store.url for store in moved) or None

    def _not_set_aside(self, after: int, exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"cannot set the steps newer than {after} aside in {self.root.url}: {describe_error(exc)}"
        )

    def _announce_on_tier(self, tier: Tier, after: int, folders: list[str]) -> Callable[[Store], None]:
        """Durable before the run's steps move: the run's note that the tier's steps newer than
        ``after`` (``folders``, the run's, and those only there) are hidden from every rank's
        restores (:class:`TierNote`), and the tier's own intent to set them aside. Killed before
        its thread carries it out (after the writes queued before), the next writable open does,
        and a reader hides them, so none is the newest step there. Returns what its thread runs."""
        try:
            there = newer_folders(tier.root, after)
        except (OSError, CheckpointError):  # unreachable now: its thread sets them aside later
            there = []
        hidden = sorted({*folders, *there})
        try:
            key = self._note.add(after, hidden)
        except OSError as exc:  # nothing has moved: the next save tries again
            raise self._not_set_aside(after, exc) from exc
        try:
            announce(tier.root, after, hidden)
        except (OSError, CheckpointError) as exc:  # unreachable now: its thread sets them aside later
            _log.warning(
                "nbckpt: cannot note in %s that steps go aside: %s", tier.root.url, describe_error(exc)
            )

        def on_tier(root: Store) -> None:
            finish(root)
            if there := newer_folders(root, after):
                _log.info("nbckpt: set aside in %s/%s", root.url, set_aside(root, after, there))
            self._note.drop(key)  # set aside there now (on a failure they stay hidden)

        return on_tier

    def restored(self, loaded: Candidate) -> None:
        """The restorer loaded ``loaded``: a save after it sets newer steps aside if rank 0's pick
        saw any anywhere the run reads (the second tier too: after a lost disk it may hold the
        only copies), plain-DCP steps included: a restore without a step picks the newest of
        either kind. One answer on every rank: each rank's own listing could differ."""
        self.restored_from = self.restorer.stores[loaded.source].url
        self._rewound = loaded.step if loaded.newer and not self.read_only else None

    def restore(self, state: dict[str, Any], step: int | None, options: Options) -> int:
        """The restorer's restore of ``state``; a Ctrl-C held back until the state was loaded in
        full counts as a restore too (a save after it must still set newer steps aside)."""
        try:
            restored = self.restorer.restore(state, step, options)
        except KeyboardInterrupt:
            if self.restorer.applied is not None:
                self.restored(self.restorer.applied)
            raise
        except CheckpointError as exc:
            where = self._set_aside_into(step)
            if where is None:
                raise
            raise CheckpointError(
                f"step {step} was set aside into {where} (a rewind before a save moved it there): "
                f"restore it from Checkpointer({where!r})"
            ) from exc
        assert self.restorer.applied is not None  # a restore that returns has loaded a step
        self.restored(self.restorer.applied)
        return restored

    def _set_aside_into(self, step: int | None) -> str | None:
        """Where ``step``, which a restore asked for and found in no place the run reads, was set
        aside (a writer may have moved it while this restore ran); None: elsewhere, or there."""
        if step is None:
            return None
        try:
            if any(store.committed_at(step) is not None for store in self.restorer.stores):
                return None
            return set_aside_into(self.root, step)
        except (OSError, CheckpointError):  # unreadable now: the restore's own error says enough
            return None

    def steps(self) -> list[int]:
        """Committed steps of the run's directory, plain DCP checkpoints (torchtitan's) included,
        oldest first."""
        found: set[int] = set()
        for readable in self.restorer.stores[:2]:
            found.update(readable.committed())
        return sorted(found)

    def undeletable(self, step: int) -> str | None:
        """Why ``step`` of the run is not nbckpt's to delete (None: nothing here says so)."""
        if PlainDcpSteps(self.root).committed_at(step) is None:
            return None
        return f"step {step} in {self.root.url} was written by plain DCP; nbckpt never deletes it"

    def set_aside_runs(self) -> list[dict[str, Any]]:
        """The runs set aside in the run's directory (:func:`._set_aside.listing`)."""
        return listing(self.root)
