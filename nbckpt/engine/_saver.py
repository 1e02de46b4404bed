"""The save pipeline: flatten and agree across ranks, plan the file layout (cached per
structure), wait for room (backpressure), stage into a slot; then on the persist thread write
every file, agree, build the manifest and commit; then it tells its commit observers (wired
by the run: the mirror, retention), which do their work on threads of their own.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

from .._errors import CheckpointError, ConfigError, NbckptError, describe_error
from ._config import CheckpointConfig
from ._context import Context
from ._dcp_values import ValueItem, dcp_metadata, dcp_values, value_items
from ._faults import fault_point
from ._files import FileResult, copy_file, drop_cached, write_image
from ._format import METADATA_FILE, Layout, RankPlan, data_file, plan
from ._incremental import NOTHING_SHARED, Increments, Sharing
from ._manifest import build, provenance
from ._ranks import Group
from ._retention import StepFacts
from ._shards import check_replicas, fingerprints
from ._staging import Stager, StagingPool
from ._state import Flattened, flatten, rng_capture
from ._store import Store, crash_point
from ._timeline import SaveHandle, SaveRecord, now_ns
from ._workers import Worker, run_all, settle, settle_all

__all__ = ["Commit", "CommitObserver", "Saver"]

_log = logging.getLogger("nbckpt")
_T = TypeVar("_T")
#: Where rank 0 opened a step's files (``Store.begin``), and the keys of its plain values, which
#: the other ranks leave to it (a value every rank holds is written once).
Opened = tuple[str, frozenset[str]]
#: Structures a run alternates between at most (a model, then with its optimizer state, ...).
_LAYOUTS_KEPT = 4


@dataclass(frozen=True)
class Commit:
    """What the saver tells its observers on rank 0 once ``step`` has committed, before the
    save's future is set: a wait for the save waits for what an observer starts now (promised
    to a ``_workers.Backlog``), and work that must see what the future's callbacks do (a pointer a
    framework moves to the step, read by a ``CustomSteps`` policy) is hung on ``settled``."""

    store: Store
    """The run's directory (or object store) the step committed in."""
    step: int
    location: str
    """Where in ``store`` it committed: what an upload reads."""
    before: frozenset[int]
    """The run's steps committed before it: a late retention pass never takes a step committed
    after it for an old one."""
    facts: StepFacts
    """The top-level names and metrics of the run's steps."""
    settled: Future[Any]
    """The save's future, set once every observer has been told."""
    gone: Callable[[int], None]
    """Tells the saver a step of ``store`` was deleted (it no longer counts as committed)."""
    release: Callable[[list[int]], set[int]]
    """Of steps of ``store`` about to be deleted, those an observer still reads (they stay)."""


class CommitObserver(Protocol):
    """Told on rank 0 of each commit (:class:`Commit`); asked, before old steps are deleted,
    which of them it still reads; waited for by :meth:`Saver.wait` as far as it changes the run's
    directory. The run wires them: the mirror (uploads) and the ``Retainer`` (deletes)."""

    def committed(self, commit: Commit) -> None:
        """``commit`` happened (called on the persist thread: queue the work, do not do it)."""
        ...

    def release(self, store: Store, steps: list[int]) -> set[int]:
        """``steps`` of ``store`` are about to be deleted: those it still reads (they stay)."""
        ...

    def settle(self) -> None:
        """Block until what it does to the run's directory after the commits so far is done."""
        ...


class _Agreed(NamedTuple):
    """The plans every rank last agreed on, the layout made from them, and its number."""

    plans: tuple[RankPlan, ...]
    layout: Layout
    generation: int


class _Offer(NamedTuple):
    """What a rank brings to the agreement of a save staged at once."""

    plan: RankPlan
    prints: dict[str, str]
    """Fingerprints of its tensors other ranks may hold too (filled as it stages)."""
    staged: int | None
    """The agreed layout it staged with (its number); None: it stages once this one is agreed."""
    opened: Opened | None = None
    """Rank 0's, where it opened the step's location as it offered (:meth:`Saver._settle_agreement`)."""


class _Agreement(NamedTuple):
    """What the ranks agreed on for a save staged at once."""

    layout: Layout
    late: bool
    """A rank waits for it before staging (its structure changed)."""
    opened: Opened | None
    """Rank 0's location and keys, where it opened the location as it offered."""


class _Pending(NamedTuple):
    """A save staged at once, whose agreement its persist job makes first."""

    offer: _Offer
    layout: Layout
    late: bool
    """The rank waited for the agreement before staging (its structure changed)."""
    opened: Opened | None = None
    """For a rank that waited: what rank 0 opened as the ranks agreed."""


def _fingerprint(
    prints: dict[str, str],
    keys: list[str],
    tensors: Mapping[str, torch.Tensor],
    staged: Mapping[str, torch.Tensor],
) -> None:
    """Fingerprints of ``keys`` as saved: from the staged copy where this rank writes the
    tensor, else from the state (on a stage thread, before the state may change)."""
    prints.update(fingerprints({key: staged.get(key, tensors[key]) for key in keys}))


def _done(future: Future[Any]) -> None:
    future.result()


def _sizes(results: Iterable[FileResult]) -> tuple[int, int]:
    """Bytes of ``results`` written, and shared with the step before."""
    sizes = {False: 0, True: 0}
    for result in results:
        sizes[result.shared] += result.size
    return sizes[False], sizes[True]


class Saver:
    """Everything a save needs and everything in flight; the Checkpointer drives it."""

    def __init__(
        self,
        config: CheckpointConfig,
        store: Store,
        context: Context,
        nonce: str,
        committed: set[int],
        observers: Sequence[CommitObserver] = (),
    ) -> None:
        """``observers``: told of each commit in this order (the run gives them to rank 0's)."""
        self.config, self.store = config, store
        self.ranks, self.timeline, self.io = context.ranks, context.timeline, context.io
        self._observers = tuple(observers)
        self.records: list[SaveRecord] = []
        self.committed = committed
        self._nonce = nonce
        self._state = threading.Lock()  # the bookkeeping below, shared with the background
        self._inflight: deque[SaveHandle] = deque()
        self._unreported: list[SaveHandle] = []
        self._layouts: dict[Any, Layout] = {}
        self._agreed: _Agreed | None = None  # written on either thread, read whole (one reference)
        self._generations: dict[int, Layout] = {}
        self._seq = itertools.count(1)  # each save's proposed number (see _first_exchange)
        self._origin: dict[str, Any] | None = None
        self.facts = StepFacts(store)  # the names and metrics of the run's steps, for retention
        self.pool = StagingPool(config.max_inflight, pin=torch.cuda.is_available())
        self._stager = Stager()
        self._increments = Increments(self._stager.run, self._stager.threads) if config.incremental else None
        self._persister = Worker("nbckpt-persist", nice=context.nice)
        # This rank's files of the newest commit, still in the page cache (see _uncache).
        self._cached: list[str] = []

    # -- the caller's side ----------------------------------------------------------------------

    def start(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        sync: bool,
        overlap: bool,
        capture_rng: bool,
        metrics: Mapping[str, float],
        overwrite: bool,
        owner: object,
    ) -> SaveHandle:
        """Stage ``state`` and queue its persist; with ``sync``, wait for the commit too. The
        persist job holds ``owner`` (the Checkpointer): it lives until the save is over.

        With several ranks, once they have agreed on a layout (the first save, or ``warmup``,
        plans on the caller's group), an async save whose structure is the agreed one stages at once
        with it: no collective on the caller's thread. The ranks agree on that save (its step,
        their plans, the replicas' fingerprints taken as it staged) on the persist thread, before
        anything is written; a disagreement fails the save on every rank (:meth:`_offer`)."""
        start = now_ns()
        self.raise_pending()
        agreed = self._agreed
        # A sync save (a final save on a signal among them) waits for its commit anyway: it plans
        # with the ranks on the caller's thread, which also brings them to it together.
        if agreed is not None and self.ranks.world_size > 1 and self._increments is None and not sync:
            handle = SaveHandle(step, 0, next(self._seq), reported=False)  # rank 0's once agreed
            self._wait_for_room(handle, sync=False)
            job = self._offer(handle, state, agreed, start, overlap, capture_rng, metrics, overwrite, owner)
        else:
            flat, layout, seq = self._plan(state, step, next(self._seq))
            self._warn(flat, step, overwrite)
            handle = SaveHandle(step, flat.nbytes, seq, reported=sync)
            self._wait_for_room(handle, sync)
            rng_state = rng_capture() if capture_rng else None
            stage_done, sharing = self._stage(handle, flat, layout, wait=sync or not overlap)
            job = partial(
                self._persist,
                handle,
                flat,
                layout,
                sharing,
                rng_state,
                metrics,
                stage_done,
                start,
                sync,
                owner,
            )
        with self._state:
            self._inflight.append(handle)
        try:
            self._persister.submit(job)
            handle.stall_s = (now_ns() - start) / 1e9
            self.timeline.record("stall", start, step=step, nbytes=handle.bytes)
        finally:
            handle.returned.set()  # stall_s is final: the record may be built
        if sync:
            try:
                settle(handle.committed)
                handle.committed.result()
            except KeyboardInterrupt:
                handle.reported = False  # it goes on in the background: report its outcome later
                raise
        return handle

    def _warn(self, flat: Flattened, step: int, overwrite: bool) -> None:
        """The warnings a save gives its caller before it commits."""
        slip = self.facts.slip(
            step, flat.tree, bool(flat.specs or flat.aliases), self.committed, self.config.retention
        )
        if slip is not None:  # said before it commits
            warnings.warn(f"nbckpt: {slip}", stacklevel=4)  # the caller of Checkpointer.save
        if not overwrite and self.holds(step):
            warnings.warn(
                f"nbckpt: step {step} already exists in {self.store.url} and is replaced; "
                "pass overwrite=True if that is intended, or save to a new directory",
                stacklevel=4,  # the caller of Checkpointer.save
            )

    def _stage(
        self,
        handle: SaveHandle,
        flat: Flattened,
        layout: Layout,
        *,
        wait: bool,
        then: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
    ) -> tuple[Future[tuple[float, int]], Sharing]:
        """Take a slot fitted to this rank's files of ``layout`` and start copying ``flat`` into
        it (``wait``: until done); ``then`` is given the slot's views once the copies landed."""
        stage_done: Future[tuple[float, int]] = Future()
        stage_began = now_ns()
        stage_done.add_done_callback(partial(self._staged, handle, stage_began))
        files = layout.files.get(self.ranks.rank, ())
        note = self.pool.preflight(sum(f.size for f in files))
        if note is not None:
            warnings.warn(f"nbckpt: {note}", stacklevel=4)  # the caller of Checkpointer.save
            _log.warning("nbckpt: %s", note)
        try:
            slot = self.pool.acquire(handle)
            try:
                slot.fit(files, flat.specs, pin=self.pool.pin)
            except Exception as exc:
                raise CheckpointError(
                    f"could not allocate {flat.nbytes / 1e9:.2f} GB of staging memory: {describe_error(exc)}"
                ) from exc
            sharing = self._share(flat, files, handle.step)
            # A save that shares nothing (every save but an incremental one) stages the state as
            # it is: no copy of a 10,000-key dict on the save path.
            tensors = (
                {k: t for k, t in flat.tensors.items() if k not in sharing.skip}
                if sharing.skip
                else flat.tensors
            )
            after = None if then is None else partial(then, slot.views)
            self._stager.stage(tensors, slot, stage_done, wait=wait, then=after)
        except BaseException:
            if handle.slot is not None:
                self.pool.release(handle.slot, handle)
            raise
        return stage_done, sharing

    def _offer(
        self,
        handle: SaveHandle,
        state: Mapping[str, Any],
        agreed: _Agreed,
        start: int,
        overlap: bool,
        capture_rng: bool,
        metrics: Mapping[str, float],
        overwrite: bool,
        owner: object,
    ) -> Callable[[], None]:
        """The persist job of an async save once the ranks have agreed on a layout. A rank whose plan
        is the agreed one stages with it at once and offers its part of the agreement (its
        plan, and the fingerprints of its replicated tensors, taken on a stage thread from the
        staged copy, or from the state before it may change where another rank writes the
        tensor) on the persist thread. A rank whose plan changed offers it there first and
        waits for the layout. A rank that fails here still takes part, with its error, so that
        the save fails on every rank; the failure is the save's (raised by ``wait`` or the next
        save, on every rank alike)."""
        decided: Future[_Agreement] | None = None
        try:
            flat = flatten(state)
            handle.bytes = flat.nbytes
            mine = RankPlan(tuple(flat.specs), tuple(sorted(flat.aliases.items())))
            copies = [s.key for s in flat.specs if not s.sharded or s.key in flat.replicas]
            prints: dict[str, str] = {}
            if mine == agreed.plans[self.ranks.rank]:
                layout = agreed.layout
                offer = _Offer(mine, prints, agreed.generation)
                then = partial(_fingerprint, prints, copies, flat.tensors)
            else:  # this rank's structure changed: its files wait for every rank's plan
                prints.update(fingerprints({key: flat.tensors[key] for key in copies}))
                offer, then = _Offer(mine, prints, None), None
                decided = Future()
                self._persister.submit(partial(self._decide, decided, handle, offer, flat.paths))
                settle(decided)
                layout = decided.result().layout
            self._warn(flat, handle.step, overwrite)
            rng_state = rng_capture() if capture_rng else None
            late = decided is not None  # its staging is waited for by the others: stage now
            stage_done, sharing = self._stage(handle, flat, layout, wait=not overlap or late, then=then)
        except BaseException as exc:
            withdraw = partial(self._withdraw, handle, exc, decided)
            if isinstance(exc, Exception):
                return withdraw
            handle.reported = True  # raised here (Ctrl-C): the others still hear of it
            self._persister.submit(withdraw)
            raise
        pending = _Pending(offer, layout, late, None if decided is None else decided.result().opened)
        return partial(
            self._persist,
            handle,
            flat,
            layout,
            sharing,
            rng_state,
            metrics,
            stage_done,
            start,
            False,  # not sync
            owner,
            pending,
        )

    def holds(self, step: int) -> bool:
        """Whether committed ``step`` is still in the run, looked for in the store: retention
        deletes on a thread of rank 0's alone, and the savers hear of it late (rank 0's once the
        files are gone) or never (another rank's); every step it deleted was still "committed"
        there, and a save of it again warned that it replaced it."""
        return step in self.committed and self.store.committed_at(step) is not None

    def recount(self) -> None:
        """Steps were moved out of the store (set aside after a rewind): what the saver knew of
        its steps is read again, and the next save shares nothing with an earlier one."""
        with self._state:
            self.committed = set(self.store.committed())
            self.facts = StepFacts(self.store)  # a step number set aside may be saved again
            if self._increments is not None:
                self._increments.forget()

    def warmup(self, state: Mapping[str, Any]) -> None:
        """Plan ``state``'s structure and fit every slot to it (each slot is taken in turn)."""
        # values need not agree yet: a model is often warmed up before DDP broadcasts rank 0's
        flat, layout, _ = self._plan(state, -1, next(self._seq), compare_values=False)
        files = layout.files.get(self.ranks.rank, ())
        note = self.pool.preflight(sum(f.size for f in files))
        if note is not None:
            warnings.warn(f"nbckpt: {note}", stacklevel=3)
        self.pool.prepare(files, flat.specs)

    def _plan(
        self, state: Mapping[str, Any], step: int, seq: int, compare_values: bool = True
    ) -> tuple[Flattened, Layout, int]:
        """Flatten and agree across ranks, then the file layout (cached per structure), and the
        save's number (``seq``, proposed by this rank; see :meth:`_first_exchange`); with
        ``compare_values``, a plain tensor (or a DTensor's replicated chunk) of different values
        on two ranks is refused."""
        box: list[Flattened] = []
        several = self.ranks.world_size > 1

        def local() -> tuple[RankPlan, dict[str, str], frozenset[int]]:
            increments = self._increments
            flat = flatten(state, frozen=increments is not None)
            box.append(flat)
            compared = several and compare_values
            copies = [s.key for s in flat.specs if not s.sharded or s.key in flat.replicas]
            prints = fingerprints({key: flat.tensors[key] for key in copies} if compared else {})
            cold = increments.cold(flat) if increments is not None else frozenset()
            gone = increments.gone(self.store.committed_at) if increments is not None else frozenset()
            return RankPlan(tuple(flat.specs), tuple(sorted(flat.aliases.items())), cold), prints, gone

        seq, everyone = self._first_exchange(self.ranks.caller, step, seq, local)
        flat = box[0]
        plans = tuple(plan_ for plan_, _, _ in everyone)
        if self._increments is not None:  # a step gone for one rank is shared from by none
            self._increments.agree(gone for _, _, gone in everyone)
        layout = self._layouts.get(plans)
        if layout is None:
            gathered = [flat.paths]
            if several:
                gathered = self.ranks.caller.exchange(("plan", step, seq), lambda: flat.paths)
            layout = self._layout(plans, gathered)
        check_replicas(layout.shared, layout.replicated, [prints for _, prints, _ in everyone])
        self._adopt(plans, layout)
        return flat, layout, seq

    @staticmethod
    def _first_exchange(group: Group, step: int, seq: int, run: Callable[[], _T]) -> tuple[int, list[_T]]:
        """A save's first exchange on ``group``: its number on every rank (rank 0's), and every
        rank's ``run``. The number names the save in its later exchanges' tags and its
        temporary location, so it must be the same on every rank."""
        # Each rank numbers a save when it is called, but a save that a rank never came to is
        # refused only at the arrival deadline (30 s), on the persist thread for an async save:
        # by then, with max_inflight > 1 (or a sync save planned on the caller's thread meanwhile),
        # later saves are numbered, and no rank can give the refused one's number back alone
        # (they were then "out of step" for good). So a rank's number is only a proposal, and
        # every rank takes rank 0's: unique, since rank 0 numbers its saves in the order it makes
        # them. Not refused instead: the later saves are ones every rank made alike, and whether
        # they were numbered before the refusal is a matter of timing.
        everyone = group.exchange(("save", step), lambda: (seq, run()))
        return everyone[0][0], [value for _, value in everyone]

    def _layout(self, plans: tuple[RankPlan, ...], paths: list[dict[str, Any]]) -> Layout:
        """The file layout of ``plans`` (every rank's), kept for the next save of that structure."""
        try:
            layout = plan(
                plans,
                {k: v for rank_paths in paths for k, v in rank_paths.items()},
                self.config.writer_threads,
            )
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        with self._state:  # warmup plans on the caller's thread while saves agree on the persist's
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[plans] = layout
        return layout

    def _adopt(self, plans: tuple[RankPlan, ...], layout: Layout) -> None:
        """The layout every rank has agreed on: the next save whose plan is this rank's part of
        ``plans`` stages with it at once. A new one is numbered (the same on every rank: the
        ranks agree in the same order), so that a save staged with an older one is recognised."""
        with self._state:
            agreed = self._agreed
            if agreed is not None and agreed.plans == plans:
                return
            generation = 0 if agreed is None else agreed.generation + 1
            self._generations[generation] = layout
            self._generations.pop(generation - _LAYOUTS_KEPT, None)
            self._agreed = _Agreed(plans, layout, generation)

    # -- the agreement of a save staged at once (several ranks; on the persist thread) ----------

    def _agree(self, handle: SaveHandle, offer: Callable[[], _Offer], paths: dict[str, Any]) -> _Agreement:
        """Every rank's offer for this save (the ranks check in first: one that never comes fails
        it within the arrival deadline); the layout of their plans, whether a rank waits for it
        before staging, and where rank 0 opened the step, if it did. Refused on every rank alike:
        another step, a rank that staged with a layout whose files for it changed (the state's
        structure changed on some ranks only), replicated tensors whose copies differ."""
        step = handle.step
        seq, everyone = self._first_exchange(self.ranks.agreement, step, handle.seq, offer)
        handle.seq = seq  # rank 0's: the later exchanges' tags are the same on every rank
        plans = tuple(o.plan for o in everyone)
        layout = self._layouts.get(plans)
        if layout is None:
            layout = self._layout(plans, self.ranks.background.exchange(("plan", step, seq), lambda: paths))
        stale = [
            str(rank)
            for rank, o in enumerate(everyone)
            if o.staged is not None and self._files(o.staged, rank) != layout.files.get(rank, ())
        ]
        self._adopt(plans, layout)  # the next save stages with it, whatever becomes of this one
        if stale:
            raise CheckpointError(
                f"the state's structure changed on some ranks only and rank(s) {', '.join(stale)} "
                "staged it for the structure before; this save is not committed, the next one "
                "uses the new structure"
            )
        check_replicas(layout.shared, layout.replicated, [o.prints for o in everyone])
        return _Agreement(layout, any(o.staged is None for o in everyone), everyone[0].opened)

    def _files(self, generation: int, rank: int) -> tuple[Any, ...] | None:
        layout = self._generations.get(generation)
        return None if layout is None else tuple(layout.files.get(rank, ()))

    def _decide(
        self, decided: Future[_Agreement], handle: SaveHandle, offer: _Offer, paths: dict[str, Any]
    ) -> None:
        """For a rank whose structure changed: the agreement, before it stages."""
        try:
            decided.set_result(self._agree(handle, lambda: offer, paths))
        except BaseException as exc:
            decided.set_exception(exc)

    def _settle_agreement(
        self,
        handle: SaveHandle,
        pending: _Pending | None,
        layout: Layout,
        flat: Flattened,
        stage_done: Future[tuple[float, int]],
        opened: list[Opened],
    ) -> Layout:
        """The agreement of a save staged at once, once this rank's copy is done; then, where a
        rank waited for it to stage, its staging's outcome: the layout agreed on (``layout``
        for a save planned on the caller's thread, ``pending`` None). Rank 0 opens the step's
        location as it offers, and every rank hears where in the agreement (``opened`` gets it,
        on rank 0 as soon as it is made, for a failure to discard it): every rank starts
        writing once agreed. Measured before (4 ranks x 64 MiB on /dev/shm, 2 loaded cores): the
        ranks that could not yet see rank 0's directory waited for an exchange of its own, 40 ms
        median, the last rank starting its writes 36 ms into a 120 ms persist."""
        if pending is None:
            return layout
        if pending.late:  # agreed before it staged: the others wait to hear it did
            self.ranks.background.exchange(("staged", handle.step, handle.seq), lambda: _done(stage_done))
            if pending.opened is not None:
                opened.append(pending.opened)
            return pending.layout

        def offer() -> _Offer:
            stage_done.result()  # a failed copy is this rank's error in the agreement
            if self.ranks.rank != 0:
                return pending.offer
            opened.append(self._begin(handle, flat.tree))  # its number is rank 0's own already
            plan_, prints, staged, _ = pending.offer
            return _Offer(plan_, prints, staged, opened[0])

        agreement = self._agree(handle, offer, flat.paths)
        if self.ranks.rank != 0 and agreement.opened is not None:
            opened.append(agreement.opened)
        if agreement.late:
            self.ranks.background.exchange(("staged", handle.step, handle.seq), lambda: None)
        return agreement.layout

    def _withdraw(self, handle: SaveHandle, exc: BaseException, decided: Future[_Agreement] | None) -> None:
        """A save that failed on this rank before its persist job: the others hear of it where
        they wait for this rank (the agreement, or its staging), and the save fails on all."""
        began = now_ns()

        def fail() -> Any:
            raise exc

        with contextlib.suppress(BaseException):  # this rank's own error, raised back: told below
            if decided is None:
                self._agree(handle, fail, {})
            elif decided.exception() is None:
                self.ranks.background.exchange(("staged", handle.step, handle.seq), fail)
        self._fail(handle, exc, began)

    def _share(self, flat: Flattened, files: tuple[Any, ...], step: int) -> Sharing:
        """Incremental saves: which of this rank's files are taken from the step before (their
        tensors are not staged); decided while the state is what is being saved."""
        if self._increments is None:
            return NOTHING_SHARED
        began = now_ns()
        sharing = self._increments.decide(flat, files, step, resave=self.store.is_local)
        self.timeline.record(
            "compare",
            began,
            step=step,
            nbytes=sum(flat.tensors[key].nbytes for key in sharing.prints),
            shared=len(sharing.files),
        )
        return sharing

    def _wait_for_room(self, handle: SaveHandle, sync: bool) -> None:
        """Backpressure: wait while ``max_inflight`` saves are in flight (a sync save: for all)."""
        began = now_ns()
        room = 0 if sync else self.config.max_inflight - 1
        with self._state:
            full = len(self._inflight) > room  # else nothing to wait for: wait_s is 0, not the check
        if full:
            fault_point("save.wait", handle.step)
        self._drain(room)
        handle.wait_s = (now_ns() - began) / 1e9 if full else 0.0
        if handle.wait_s > 1e-4:
            self.timeline.record("wait", began, step=handle.step)
        self.raise_pending()

    def _drain(self, room: int) -> list[SaveRecord]:
        """Wait for the oldest saves until at most ``room`` are in flight; their records. Through
        their futures, not a Backlog of the persist jobs: a save waiting for room goes on once the
        oldest's future is set, before its callbacks run, so that a callback that calls into the
        Checkpointer (whose lock the waiting save holds) cannot deadlock it."""
        records: list[SaveRecord] = []
        while True:
            with self._state:
                if len(self._inflight) <= room:
                    return records
                oldest = self._inflight[0]
            with contextlib.suppress(CheckpointError):  # raised by raise_pending, once
                settle(oldest.committed)
                records.append(oldest.committed.result())
            with self._state:  # forgotten only once done: Ctrl-C while waiting keeps it tracked
                if self._inflight and self._inflight[0] is oldest:
                    self._inflight.popleft()

    def wait_staged(self) -> None:
        """Block until every save has finished copying the state (see ``save(overlap=True)``)."""
        with self._state:
            pending = list(self._inflight)
        for handle in pending:
            handle.wait_staged()

    def wait(self) -> list[SaveRecord]:
        """Block until every save in flight has committed and what the observers do to the run's
        directory after it is done (retention's deletes); raise the first background error."""
        records = self._drain(0)
        for observer in self._observers:
            observer.settle()
        self.raise_pending()
        return records

    def raise_pending(self) -> None:
        """Raise the first background failure nobody has been told of (once), of a save a call
        has waited for (``wait``, or a save waiting for room: with ``max_inflight=1``, the next)."""
        # Each save call advances each rank's check-ins (and save numbers) the same way, so a call
        # raises the same failure at the same point on every rank. A failed save fails on every
        # rank, but each rank records it when its own persist thread gets there: raised as soon as
        # recorded, the next save raised before checking in on a rank that had recorded it and
        # went on to check in on one that had not (a 30 s arrival deadline, then every later save
        # "out of step"). A save waited for has been recorded on every rank.
        with self._state:
            inflight = {id(h) for h in self._inflight}
            failed = [h for h in self._unreported if not h.reported and id(h) not in inflight]
            self._unreported = [h for h in self._unreported if id(h) in inflight]
        if failed:
            failed[0].reported = True
            raise failed[0].committed.exception()  # type: ignore[misc]

    @property
    def handles(self) -> list[SaveHandle]:
        with self._state:
            return list(self._inflight)

    def after_its_work(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the persist thread once the work queued there is done (safe from a
        finalizer: a queue's put). It may stop this saver: the thread then ends after it."""
        self._persister.submit(job)

    def stop(self, wait: bool) -> None:
        """Stop the threads (``wait`` for them to end; not from a finalizer, which may run on one)."""
        self._stager.stop(wait)
        self._persister.stop(wait)
        if wait:  # no thread reads the images any more: give the staging memory back
            self.pool.free()

    # -- the background's side ------------------------------------------------------------------

    def _staged(self, handle: SaveHandle, began: int, done: Future[tuple[float, int]]) -> None:
        """Staging ended (on a stage thread): the state may change from now on."""
        if done.exception() is not None:
            return  # reported by the persist job, which fails the save
        ended = done.result()[1]
        handle.stage_s = (ended - began) / 1e9
        self.timeline.record("stage", began, ended, step=handle.step, nbytes=handle.bytes)
        handle.phase = "staged"
        handle.staged.set_result(None)

    def _persist(
        self,
        handle: SaveHandle,
        flat: Flattened,
        layout: Layout,
        sharing: Sharing,
        rng_state: dict[str, Any] | None,
        metrics: Mapping[str, float],
        stage_done: Future[tuple[float, int]],
        start: int,
        sync: bool,
        owner: object,
        pending: _Pending | None = None,
    ) -> None:
        """(Agree, for a save staged at once,) write, agree, commit; every outcome sets
        ``handle.committed`` exactly once."""
        step = handle.step
        background, rank = self.ranks.background, self.ranks.rank
        began = persist_began = now_ns()
        location: str | None = None
        path: str | None = None
        opened: list[Opened] = []  # where rank 0 opened the step as the ranks agreed, if it did
        try:
            layout = self._settle_agreement(handle, pending, layout, flat, stage_done, opened)
            tag = handle.seq  # agreed by now (rank 0's number)
            cpu_s = stage_done.result()[0]
            handle.staged.result()  # set by the stage thread's callback before this returns
            handle.phase = "persisting"
            persist_began = now_ns()
            started: list[Future[FileResult]] = []
            location, shared = opened[0] if opened else self._open(handle, flat.tree, sharing, started)
            written = background.exchange(
                ("write", step, tag),
                lambda: self._write(
                    handle, location or "", layout, flat.tree, rng_state, shared, sharing, started
                ),
            )
            assert handle.slot is not None
            self.pool.release(handle.slot, handle)  # the images are written: the slot is free
            files: dict[str, FileResult] = {}
            for part in written:
                files.update(part[0])
            if rank == 0 and len(written) > 1:  # one process wrote it with its data
                self._write_metadata(location, layout, written, files)
            cpu_s += sum(result.cpu_s for result in written[rank][0].values())
            for result in written[rank][0].values():
                if result.fsync_ns != (0, 0):
                    self.timeline.record("fsync", *result.fsync_ns, step=step, file=result.name)
            persisted = now_ns()
            manifest = build(
                step=step,
                nbytes=layout.nbytes,
                world_size=self.ranks.world_size,
                files=files,
                items=layout.locations,
                tree=flat.tree,
                rank_trees={str(r): part[1] for r, part in enumerate(written) if part[1] != flat.tree},
                rng={str(r): part[2] for r, part in enumerate(written) if part[2] is not None},
                provenance=self._provenance(),
                metrics=metrics,
                timing={"stage_s": handle.stage_s, "write_s": (persisted - persist_began) / 1e9},
            )
            target = location
            path = background.from_rank0(
                ("commit", step, tag), lambda: self.store.commit(target, step, manifest)
            )
        except BaseException as exc:
            # Once committed, the checkpoint stays whatever fails after; before, it goes.
            if handle.slot is not None:
                self.pool.release(handle.slot, handle)
            location = location or (opened[0][0] if opened else None)
            if path is None and location is not None and rank == 0:
                self.store.discard(location)
            self._fail(handle, exc, began)
            return
        if not sync:
            handle.returned.wait()  # stall_s is final once save() has returned
        persist_s = (now_ns() - persist_began) / 1e9
        wrote, skipped = _sizes(written[rank][0].values())
        record = SaveRecord(
            step=step,
            path=path,
            bytes=handle.bytes,
            stall_s=(now_ns() - start) / 1e9 if sync else handle.stall_s,
            stage_s=handle.stage_s,
            persist_s=persist_s,
            wait_s=handle.wait_s,
            write_gbs=wrote / persist_s / 1e9 if persist_s > 0 else 0.0,
            cpu_s=cpu_s,
            bytes_written=wrote,
            bytes_skipped=skipped,
        )
        self.timeline.record(
            "persist",
            persist_began,
            persisted,
            step=step,
            nbytes=handle.bytes,
            written=wrote,
            skipped=skipped,
        )
        self.timeline.record("commit", persisted, step=step)
        with self._state:
            self.records.append(record)
            older = set(self.committed)  # what retention may delete: never a step committed later
            self.committed.add(step)
            self.facts.saved(step, flat.tree, metrics)
            if self._increments is not None:  # the next save compares with this one
                self._increments.committed(path, step, layout.files.get(rank, ()), written[rank][0], sharing)
        self._uncache(path, written[rank][0].values())
        handle.phase = "committed"
        if self._observers:
            told = self._commit(self.store, step, path, frozenset(older), self.facts, handle.committed)
            for observer in self._observers:  # in order: the mirror queues its upload first
                observer.committed(told)
        handle.committed.set_result(record)  # what an observer hung on it runs after its callbacks

    def _uncache(self, path: str, results: Iterable[FileResult]) -> None:
        """Keep only the newest commit's files in the page cache: the step before's go (its
        pages are clean, durable), so the next save writes into the pages they free instead of
        taking pages the kernel has not used for a while (``_files.drop_cached`` says why that
        costs). The newest stays cached for a rewind to it; a file this step shares with the
        one before (a hard link: the same pages) stays too. Runs on the persist thread."""
        if not self.store.is_local:
            return
        kept = {os.path.join(path, result.name) for result in results}
        shared = {result.name for result in results if result.shared}
        for old in self._cached:
            if os.path.basename(old) not in shared:
                drop_cached(old)
        self._cached = sorted(kept)

    def latest(self) -> Commit | None:
        """The newest committed step of the run, as a commit already settled: told to retention
        again, a pass as after it (a policy's answer may have changed since)."""
        with self._state:
            store, facts, before = self.store, self.facts, frozenset(self.committed)
        newest = max(before, default=None)
        location = store.committed_at(newest) if newest is not None else None
        if newest is None or location is None:
            return None
        settled: Future[Any] = Future()
        settled.set_result(None)
        return self._commit(store, newest, location, before, facts, settled)

    def _commit(
        self,
        store: Store,
        step: int,
        location: str,
        before: frozenset[int],
        facts: StepFacts,
        settled: Future[Any],
    ) -> Commit:
        return Commit(
            store,
            step,
            location,
            before,
            facts,
            settled,
            partial(self.deleted, store),
            partial(self._release, store),
        )

    def deleted(self, store: Store, step: int) -> None:
        """Committed ``step`` of ``store`` was deleted (retention, ``delete``, the Browser's through
        this Checkpointer): it no longer counts as committed, and no rank's incremental save shares
        its files (told to the others at the next save's exchange)."""
        with self._state:
            if store.url == self.store.url:  # a mirror's step is not the run's
                self.committed.discard(step)
                if self._increments is not None:
                    self._increments.deleted(step)

    def _release(self, store: Store, steps: list[int]) -> set[int]:
        return set().union(*(observer.release(store, steps) for observer in self._observers))

    def _provenance(self) -> dict[str, Any]:
        if self._origin is None:  # once per Checkpointer: it runs git
            self._origin = provenance()
        return self._origin

    def _begin(self, handle: SaveHandle, tree: dict[str, Any]) -> Opened:
        """Rank 0: the step's new location (named by the save's agreed number), and the keys of
        its plain values (none in one process: it writes them all)."""
        location = self.store.begin(handle.step, f"{self._nonce}{handle.seq:x}")
        several = self.ranks.world_size > 1
        return location, frozenset(key for key, _, _ in dcp_values(tree)) if several else frozenset()

    def _open(
        self, handle: SaveHandle, tree: dict[str, Any], sharing: Sharing, started: list[Future[FileResult]]
    ) -> Opened:
        """Rank 0 opens the step's location (:meth:`_begin`); every rank hears it, with rank 0's
        keys, in an exchange of its own (a save whose ranks agreed on the persist thread heard it
        there). A rank starts writing its data files as soon as it can tell the location
        (``started``: their futures), so that the round trip to hear rank 0, and the wait there
        for the last rank to finish its copy, run beside its writes: rank 0 once it has opened
        it, another where it can see it already (a local directory rank 0 has made). The others'
        plain values wait for rank 0's keys."""
        step = handle.step

        def begin() -> Opened:
            opened = self._begin(handle, tree)
            started.extend(self._start(handle, opened[0], sharing))
            return opened

        seen = self.store.opened(step, f"{self._nonce}{handle.seq:x}") if self.ranks.rank != 0 else None
        if seen is not None:
            started.extend(self._start(handle, seen, sharing))
        try:
            location, shared = self.ranks.background.from_rank0(("begin", step, handle.seq), begin)
        except BaseException:
            settle_all(started)  # nothing may still read its slot, nor write into a removed location
            raise
        if seen not in (None, location):  # the same name on every rank: never, unless a bug
            raise CheckpointError(f"rank {self.ranks.rank} began writing in {seen}, rank 0 in {location}")
        return location, shared

    def _start(self, handle: SaveHandle, location: str, sharing: Sharing) -> list[Future[FileResult]]:
        """This rank's data files, written (or shared with the step before) in parallel from now on."""
        slot = handle.slot
        assert slot is not None
        fsync = self.store.is_local
        return [
            self.io.submit(
                partial(self._share_one, sharing.base, location, sharing.files[name], fsync)
                if name in sharing.files and sharing.base is not None
                else partial(self._write_one, location, name, image.numpy().data, fsync)
            )
            for name, image in slot.images.items()
        ]

    def _write(
        self,
        handle: SaveHandle,
        location: str,
        layout: Layout,
        tree: Any,
        rng_state: Any,
        shared: frozenset[str],
        sharing: Sharing,
        started: list[Future[FileResult]],
    ) -> tuple[dict[str, FileResult], Any, Any, list[ValueItem]]:
        """This rank's files, written (or shared with the step before) in parallel: its tensors'
        (``started`` already, or started now) and its plain values' (DCP byte items, where it has
        any), and where those values are, for rank 0's DCP metadata."""
        fsync = self.store.is_local
        if not started:
            started.extend(self._start(handle, location, sharing))
        jobs: list[Callable[[], FileResult]] = []
        rank = self.ranks.rank
        try:
            # This rank's plain values go to one more file of its own, as DCP byte items.
            name = data_file(rank, len(layout.files.get(rank, ())))
            values, items = value_items(layout, tree, name, frozenset() if rank == 0 else shared)
            if values:
                jobs.append(partial(self._write_one, location, items[0].file, memoryview(values), fsync))
            if self.ranks.world_size == 1:  # no other rank to hear from: the metadata beside the data
                metadata = memoryview(dcp_metadata(layout, [items]))
                jobs.append(partial(self._write_one, location, METADATA_FILE, metadata, fsync))
        except BaseException:
            settle_all(started)  # nothing may still read its slot, nor write into a removed location
            raise
        # All of them finish, even after a failure: nothing may write into a removed location.
        results = {result.name: result for result in run_all(self.io, jobs, started)}
        crash_point("after_data")
        return results, tree, rng_state, items

    def _write_metadata(
        self, location: str, layout: Layout, written: list[Any], files: dict[str, FileResult]
    ) -> None:
        """Rank 0's DCP metadata, once every rank has said where its plain values are."""
        metadata = memoryview(dcp_metadata(layout, [part[3] for part in written]))
        files[METADATA_FILE] = self._write_one(location, METADATA_FILE, metadata, self.store.is_local)

    def _write_one(self, location: str, name: str, data: memoryview, fsync: bool) -> FileResult:
        return write_image(self.store.sink(location, name), data, fsync=fsync)

    def _share_one(self, base: str, location: str, result: FileResult, fsync: bool) -> FileResult:
        """File ``result.name`` of the step at ``base`` made this step's too, unread; copied (its
        blocks checked on the way) where the storage cannot share it (no hard links there)."""
        try:
            self.store.share(base, location, result.name)
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"{result.name} of {base}, which this save shares, is gone ({describe_error(exc)})"
            ) from exc
        except OSError:  # FAT, some FUSE and SMB mounts, an inode's link limit
            source = self.store.source(base, result.name, result.size)
            try:
                copy_file(source, self.store.sink(location, result.name), result.blocks, fsync=fsync)
            finally:
                source.close()
            return FileResult(result.name, result.size, result.blocks)
        return FileResult(result.name, result.size, result.blocks, shared=True)

    def _fail(self, handle: SaveHandle, exc: BaseException, began: int) -> None:
        error = CheckpointError(
            f"save of step {handle.step} to {self.store.url} failed: "
            f"{exc if isinstance(exc, NbckptError) else describe_error(exc)}"
        )
        error.__cause__ = exc
        handle.phase = "failed"
        if self._increments is not None:
            self._increments.forget()  # what it staged is in no step: the next save writes all
        if not handle.staged.done():
            handle.staged.set_exception(error)
        with self._state:
            self._unreported.append(handle)
        handle.committed.set_exception(error)
        self.timeline.record("error", began, step=handle.step, message=str(error))
        _log.warning("%s", error)
