"""The run a Checkpointer opens: its directory prepared, locked and cleaned (:func:`open_run`),
and the places its restores read (:class:`Run`), where it sets newer steps aside after a rewind
(the set-aside runs themselves are in :mod:`._set_aside`)."""

from __future__ import annotations

import logging
import uuid
import warnings
from functools import partial
from typing import Any

from .._errors import CheckpointError, ConfigError, describe_error
from ._context import Context
from ._mirror import Mirror, mirror_of
from ._plain_dcp import PlainDcpSteps, said_shared
from ._restorer import Options, Restorer
from ._saver import Saver
from ._set_aside import announce, earlier_branch_note, finish, listing, set_aside, visible
from ._store import Readable, Store

__all__ = ["Run", "open_run"]

_log = logging.getLogger("nbckpt")


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
        finished = finish(store)  # before anything reads it: "newest" never picks a step set aside
        committed = set(store.committed())
        note = earlier_branch_note(store)
    except BaseException:
        store.unlock()  # a failed open must not hold the directory for the process's life
        raise
    if recovered:
        said_cleaned(store.url, recovered, stacklevel=6)
    if finished is not None:
        warnings.warn(f"nbckpt: finished setting steps aside into {store.url}/{finished}", stacklevel=6)
    if note is not None:
        warnings.warn(note, stacklevel=6)
    said_shared(store)
    return uuid.uuid4().hex[:12], committed


def newer_folders(store: Store, step: int) -> list[str]:
    """The step folders of ``store`` newer than ``step``: nbckpt's and plain DCP's (torchtitan's;
    moved, never deleted), oldest first."""
    steps = {**PlainDcpSteps(store).committed(), **store.committed()}
    root = store.url.rstrip("/")
    locations = [steps[s].rstrip("/") for s in sorted(steps) if s > step]
    return [path.rsplit("/", 1)[-1] for path in locations if path != root]


class Run:
    """The places the run's restores read (its directory, then the mirror; each followed by the
    steps plain DCP wrote there), and the set-aside of newer steps after a rewind."""

    def __init__(
        self,
        root: Store,
        mirror: Mirror | None,
        saver: Saver,
        context: Context,
        *,
        read_only: bool,
    ) -> None:
        self.root, self.mirror, self.saver, self.context = root, mirror, saver, context
        group = self.group = context.caller
        self.read_only, self._writes = read_only, group.rank == 0 and not read_only
        self.restored_from: str | None = None
        self._rewound: int | None = None  # the step restored while newer steps exist
        if mirror is not None and self._writes:
            self._finish_on_mirror(mirror)
        places: list[Store] = [root] + ([mirror.root] if mirror is not None else [])
        # what a set-aside cut short (or the mirror's, not yet done) moves is hidden from restores
        self._views = [visible(place) for place in places]
        stores: list[Readable] = []
        for view, place in zip(self._views, places, strict=True):
            stores += [view, PlainDcpSteps(place)]
        self.restorer = Restorer(stores, context)
        if mirror is not None and self._writes:
            mirror.resume(root)  # what a crash kept from the mirror goes up now

    @staticmethod
    def _finish_on_mirror(mirror: Mirror) -> None:
        try:
            finish(mirror.root)
        except (OSError, CheckpointError) as exc:
            warnings.warn(f"nbckpt: cannot finish setting steps aside on the mirror: {exc}", stacklevel=5)

    def set_aside_if_rewound(self) -> None:
        """Before the first save after restoring an older step: the newer steps move into a
        set-aside run of their own in the run's directory (rank 0 moves, the other ranks wait for
        it), and on the mirror once the uploads queued before are over (hidden from restores
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
        is finished first) and queue the mirror's; where the run's went (None: there were none)."""
        try:
            finish(self.root)
            folders = newer_folders(self.root, after)
        except OSError as exc:
            raise self._not_set_aside(after, exc) from exc
        # The mirror's intent goes first: killed while the run's steps move (or just after), the
        # mirror's copies of them would otherwise be the newest steps the next open restores.
        hidden = self._announce_on_mirror(after, folders) if self.mirror is not None else set()
        try:
            name = set_aside(self.root, after, folders) if folders else None
        except OSError as exc:  # what moved stays moved: the next save (or open) finishes the rest
            raise self._not_set_aside(after, exc) from exc
        moved = self.root.child(name) if name is not None else None
        if self.mirror is not None:
            if moved is not None:
                self.mirror.moved(self.root, moved.committed())  # waiting uploads read them there
            view = self._views[1]

            def on_mirror(root: Store) -> None:
                finish(root)
                if there := newer_folders(root, after):
                    _log.info(
                        "nbckpt: set aside on the mirror in %s/%s", root.url, set_aside(root, after, there)
                    )
                view.hidden -= hidden  # set aside there now (on a failure they stay hidden)

            self.mirror.after_uploads(on_mirror, f"set aside its steps newer than {after}")
        return None if moved is None else moved.url

    def _not_set_aside(self, after: int, exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"cannot set the steps newer than {after} aside in {self.root.url}: {describe_error(exc)}"
        )

    def _announce_on_mirror(self, after: int, folders: list[str]) -> set[str]:
        """Durable before the run's steps move: the mirror's own intent to set aside its steps
        newer than ``after`` (``folders``, the run's, and those only there; its thread carries it
        out after the uploads queued before). Killed before that, the next writable open carries
        it out and a reader hides them, so none is the newest step there. Hidden from this
        run's restores until then: what this hides (the mirror's thread shows it again)."""
        assert self.mirror is not None
        view = self._views[1]
        try:
            there = newer_folders(self.mirror.root, after)
        except (OSError, CheckpointError):  # unreachable now: its thread sets them aside later
            there = []
        hide = {*folders, *there} - view.hidden
        view.hidden |= hide
        try:
            announce(self.mirror.root, after, sorted({*folders, *there}))
        except (OSError, CheckpointError) as exc:  # unreachable now: its thread sets them aside later
            _log.warning("nbckpt: cannot note on the mirror that steps go aside: %s", describe_error(exc))
        return hide

    def restored(self, step: int) -> None:
        """The restorer loaded ``step``: a save after it sets newer steps aside if there are any
        anywhere the run reads (the mirror too: after a lost disk it may hold the only copies),
        plain-DCP steps included: a restore without a step picks the newest of either kind."""
        newer = [s for store in self.restorer.stores for s in store.committed() if s > step]
        self.restored_from = self.restorer.stores[self.restorer.last_source].url
        self._rewound = step if newer and not self.read_only else None

    def restore(self, state: dict[str, Any], step: int | None, options: Options) -> int:
        """The restorer's restore of ``state``; a Ctrl-C held back until the state was loaded in
        full counts as a restore too (a save after it must still set newer steps aside)."""
        try:
            restored = self.restorer.restore(state, step, options)
        except KeyboardInterrupt:
            if self.restorer.applied is not None:
                self.restored(self.restorer.applied)
            raise
        self.restored(restored)
        return restored

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
