"""Restore: rank 0 picks the checkpoint, every rank checks the caller's state against it, reads and
verifies its part, and only then is anything of the caller's touched. A mistake of the caller is
a ConfigError at once, on every rank; damage falls back to the next older checkpoint (or copy).
"""

from __future__ import annotations

import gc
import itertools
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, NamedTuple

import torch

from .._errors import CheckpointError, ConfigError, NbckptError, describe_error
from ._context import Context
from ._dcp_check import check_dcp_metadata, check_values
from ._format import MANIFEST, METADATA_FILE, step_name
from ._manifest import Manifest
from ._reader import (
    Readable,
    ReadPlan,
    check_read,
    fill,
    plan_read,
    read_metadata,
    read_tensors,
    stat_files,
    tensor_files,
    verify_files,
    verify_framing,
)
from ._retention import listed
from ._shards import Region, region_of, wrap_like
from ._state import decode, node_tensors, rng_owner, rng_parse, rng_process, tree_specs
from ._template import (
    Loaders,
    Refused,
    align,
    apply,
    check_loadable,
    check_template,
    destinations,
    sharded_targets,
)
from ._timeline import now_ns
from ._workers import Pool, deferred_interrupt

__all__ = ["Candidate", "Options", "Restorer", "device_of"]


class Restorer:
    """Reads the checkpoints of a run for one rank (``group`` agrees every step with the others)
    from ``stores``, in the order they are preferred (the run's directory, the mirror; each
    place followed by the steps another writer left in it, read-only)."""

    def __init__(self, stores: Sequence[Readable], context: Context) -> None:
        self.stores, self.io, self.group, self.timeline = stores, context.io, context.caller, context.timeline
        self.store = stores[0]
        self.rank = self.group.rank
        # What the last restore loaded into the state (rank 0's pick: its step, where from,
        # whether a newer step exists): set inside the section a Ctrl-C cannot cut, so an
        # interrupt delivered as it ends still knows the state was loaded.
        self.applied: Candidate | None = None

    def find(self, step: int) -> tuple[Readable, str]:
        """The store and location of committed ``step`` (the first store that has it)."""
        for store in self.stores:
            location = store.committed_at(step)
            if location is not None:
                return store, location
        have = ", ".join(map(str, self.store.committed())) or "none"
        raise CheckpointError(f"no committed checkpoint for step {step} in {self.store.url} (steps: {have})")

    def manifest(self, step: int) -> Manifest:
        """The checked manifest of committed ``step``, from the first store that has it."""
        store, location = self.find(step)
        return store.read_manifest(step, location)[0]

    def verify(self, step: int) -> dict[str, Any]:
        """Every check of ``step``; whatever is wrong with it is a CheckpointError naming it."""
        store, location = self.find(step)
        try:
            manifest = store.read_manifest(step, location)[0]
            for record in manifest.body.get("rng", {}).values():
                rng_parse(record)  # what restore refuses, verify refuses (its streams are set nowhere)
            verify_files(store, self.io, location, manifest)
            check_step_files(store, self.io, location, manifest, True)
            verify_framing(store, self.io, location, manifest)
        except NbckptError:
            raise
        except Exception as exc:  # a hostile file the checks did not foresee: still a bad step
            raise CheckpointError(f"{step_name(step)} is malformed: {describe_error(exc)}") from exc
        return manifest.body

    def restore(self, state: dict[str, Any], step: int | None, options: Options) -> int:
        """Load the newest step that reads back intact (or ``step``) into ``state``; its step."""
        self.applied = None
        with gc_paused():
            return _Restore(self, state, step, options).run()

    def candidates(self, step: int | None, tried: Collection[tuple[int, int]]) -> list[Candidate]:
        """The steps not yet tried, as (step, store index, location): newest step first,
        preferred store first; ``step`` alone in each store that has it, when one is asked for."""
        found: list[Candidate] = []
        for index, store in enumerate(self.stores):
            if step is None:
                listed = list(store.committed().items())
            else:  # one check per store, not a listing
                location = store.committed_at(step)
                listed = [] if location is None else [(step, location)]
            found.extend(Candidate(s, index, where) for s, where in listed if (s, index) not in tried)
        return sorted(found, key=lambda c: (-c.step, c.source))

    def pick(self, step: int | None, tried: Collection[tuple[int, int]]) -> Candidate:
        """Rank 0's choice of checkpoint, which every rank then uses (one listing, one answer),
        saying whether a newer step is committed anywhere: only rank 0's view of a store hides
        the steps a set-aside still moves there, so no other rank may answer that for itself."""
        left = self.candidates(step, tried)
        if not left:
            if step is not None:
                self.find(step)  # names the steps there are
            raise CheckpointError(f"no valid checkpoint in {self.store.url}")
        best = left[0]
        newer = any(s > best.step for store in self.stores for s in store.committed())
        return Candidate(best.step, best.source, best.location, newer)

    def load(self, step: int, *, verify: bool, map_location: str | torch.device | None) -> dict[str, Any]:
        store, location = self.find(step)
        manifest = store.read_manifest(step, location)[0]
        saved = manifest.tree(self.rank)
        if map_location is not None and torch.device(map_location).type == "meta":
            # Shapes and dtypes without a byte read: the cheap look at what a checkpoint holds.
            specs = tree_specs(saved)
            meta = {key: torch.empty(s.shape, dtype=s.dtype, device="meta") for key, s in specs.items()}
            return dict(decode(saved, meta))
        check_step_files(store, self.io, location, manifest, verify)
        wanted: dict[str, Region | None] = {leaf["key"]: None for leaf in node_tensors(saved)}
        tensors, _ = read_tensors(store, self.io, location, manifest, wanted, verify=verify)
        if map_location is not None:
            tensors = {k: t.to(map_location) for k, t in tensors.items()}
        return dict(_decodes(saved, tensors, step))


class Options(NamedTuple):
    """How a restore reads and loads: ``Checkpointer.restore``'s keywords."""

    verify: bool
    rng: bool
    strict: bool
    key_map: Callable[[str], str | None] | None


class Candidate(NamedTuple):
    """A step a restore may load: which step, from which of the restorer's stores, and where;
    for rank 0's pick, whether a newer step is committed in any of them (damaged ones too)."""

    step: int
    source: int
    location: str
    newer: bool = False


class _Restore:
    """One restore: candidates tried newest first, every rank the same one, until one loads. A
    damaged candidate is skipped with a warning (or raised, when the step was asked for and no
    copy is left); one that holds other names than the state asks for is skipped quietly, and
    if none holds them, the first such is the refusal."""

    def __init__(self, restorer: Restorer, state: dict[str, Any], step: int | None, options: Options) -> None:
        self.restorer, self.state, self.step, self.options = restorer, state, step, options
        self.tried: list[tuple[int, int]] = []
        self.lacking: list[_Lacks] = []  # newer steps that hold other names than the state asks for

    def run(self) -> int:
        for attempt in itertools.count(1):
            candidate = self.next(attempt)
            began = now_ns()
            read = _Read(self.restorer, self.state, candidate, self.options, attempt, self.step is not None)
            failure = self.attempt(read)
            if failure is None:
                return self.done(read, began)
            self.tried.append((candidate.step, candidate.source))
            if not isinstance(failure, _Lacks) and not self.gone(candidate, attempt):
                self.skip(candidate.step, failure)
        raise AssertionError("unreachable")  # itertools.count never ends

    def next(self, attempt: int) -> Candidate:
        """Rank 0's pick of the next candidate, every rank's."""
        pick = partial(self.restorer.pick, self.step, self.tried)
        try:
            return Candidate(*self.restorer.group.from_rank0(("pick", self.step, attempt), pick))
        except CheckpointError:
            if self.lacking:
                raise self.lacking[0].refusal(self.restorer.store.url) from None
            raise

    def attempt(self, read: _Read) -> CheckpointError | None:
        """Check and read the candidate on every rank, then load it: None once it is loaded,
        else why it was not (the state is unchanged then); the caller's mistakes raise."""
        try:
            read.check()
            read.read()
        except _Lacks as exc:
            self.lacking.append(exc)
            return exc
        except CheckpointError as exc:
            return exc
        with deferred_interrupt():  # a Ctrl-C from here would leave the state half loaded
            failure = read.load()
            if failure is None:
                if read.streams is not None:
                    read.streams()
                self.restorer.applied = read.candidate
        return failure

    def gone(self, candidate: Candidate, attempt: int) -> bool:
        """Whether ``candidate`` failed because it is no longer committed where it was picked (a
        writer set it aside or deleted it since): no damage then, and the next pick is from what
        is there now. Rank 0's answer, every rank's."""

        def check() -> bool:
            try:
                return self.restorer.stores[candidate.source].committed_at(candidate.step) is None
            except (OSError, CheckpointError):  # unreachable: nothing says it went
                return False

        return bool(self.restorer.group.from_rank0(("gone", candidate.step, attempt), check))

    def skip(self, step: int, failure: CheckpointError) -> None:
        """Go on past damaged ``step``, with a warning, while another copy or step is left."""
        if self.step is not None and not self.restorer.candidates(self.step, self.tried):
            raise failure
        next_one = "its mirror copy" if self.restorer.candidates(step, self.tried) else "an older checkpoint"
        warnings.warn(
            f"nbckpt: skipping {step_name(step)}: {failure}; trying {next_one}",
            stacklevel=6,  # the caller of Checkpointer.restore
        )

    def done(self, read: _Read, began: int) -> int:
        if self.lacking:
            lacks = self.lacking[0]
            warnings.warn(
                f"nbckpt: restored step {read.step}, the newest holding {listed(lacks.asked)} "
                f"(step {lacks.step} holds {listed(lacks.holds)})",
                stacklevel=6,  # the caller of Checkpointer.restore
            )
        nbytes = sum(t.nbytes for t in read.tensors.values())
        self.restorer.timeline.record("restore", began, step=read.step, nbytes=nbytes)
        return read.step


class _Read:
    """One candidate as one rank restores it, agreed by all ranks at each stage: :meth:`check`
    its manifest against the caller's state, :meth:`read` and check the bytes this rank needs,
    then :meth:`load` them into the state, every rank at once."""

    def __init__(
        self,
        restorer: Restorer,
        state: dict[str, Any],
        candidate: Candidate,
        options: Options,
        attempt: int,
        asked_for: bool,
    ) -> None:
        self.group, self.io, self.rank = restorer.group, restorer.io, restorer.rank
        self.store = restorer.stores[candidate.source]
        self.state, self.candidate, self.options, self.asked_for = state, candidate, options, asked_for
        self.step, self.location = candidate.step, candidate.location
        self.tag = (candidate.step, attempt)
        # which rank's template a refusal is about: another rank is told it too (the same line)
        self.whose = f"rank {self.rank}'s state" if self.group.world_size > 1 else "this state"
        # What each stage found, for the next (set on this rank, whatever the others did).
        self.manifest: Manifest
        self.saved: dict[str, Any]
        self.targets: dict[str, Any]
        self.plan: ReadPlan
        self.tensors: dict[str, Any] = {}
        self.streams: Callable[[], None] | None = None
        self.loaders: Loaders

    def check(self) -> None:
        """Every rank's manifest read alike and holding what its state asks for, the step's own
        files agreeing with it (rank 0 checks), and the state able to take it."""
        checked = self.group.exchange(("check", *self.tag), self._check)
        if len({checksum for checksum, _, _ in checked}) > 1:
            raise CheckpointError(f"{step_name(self.step)}/{MANIFEST} reads differently on different ranks")
        lacks = {rank: missing for rank, (_, missing, _) in enumerate(checked) if missing}
        if lacks:  # every rank names the ranks and keys: one rank's template may differ
            holds = checked[min(lacks)][2]
            raise _Lacks(self.step, [str(k) for k in self.state], holds, lacks if len(checked) > 1 else {})

    def _check(self) -> tuple[str, list[str], list[str]]:
        """This rank's check: the manifest's checksum, the state's keys it lacks, what it holds."""
        store, location, state = self.store, self.location, self.state
        manifest = self.manifest = store.read_manifest(self.step, location)[0]
        saved_keys = [key for key, _ in manifest.tree(self.rank)["items"]]
        present, holds = set(saved_keys), [str(key) for key in saved_keys]
        missing = [str(key) for key in state if key not in present]
        if missing and not self.asked_for:  # the newest step saved other things: an older one may do
            return manifest.checksum, missing, holds
        if self.rank == 0:
            # Damage before the caller's mistakes: a tree edited to another shape must be a
            # damaged step (the next one is tried), not a template the caller got wrong.
            check_step_files(store, self.io, location, manifest, self.options.verify)
        saved = self.saved = align(state, manifest.tree(self.rank), self.options.key_map)
        problems = check_template(state, saved, "")
        left = [repr(key) for key, _ in saved["items"] if key not in state] if self.options.strict else []
        if left:
            problems.append(f"strict: the state does not name the saved {', '.join(left)}")
        if problems and self.rank == 0:
            # A shape the manifest and .metadata agree on but the blobs do not hold is damage
            # (fall back), not the caller's template: check the blobs before blaming it.
            verify_framing(store, self.io, location, manifest)
        _refuse(problems, self.step, self.whose)
        self.targets = sharded_targets(state, saved)
        return manifest.checksum, [], holds

    def read(self) -> None:
        """Every rank reads and checks the bytes it needs; nothing of the caller's changes yet."""
        self.group.exchange(("read", *self.tag), self._read)

    def _read(self) -> None:
        subtree = {"t": "dict", "items": [[k, n] for k, n in self.saved["items"] if k in self.state]}
        targets = self.targets
        wanted = {
            leaf["key"]: (region_of(targets[leaf["key"]]) if leaf["key"] in targets else None)
            for leaf in node_tensors(subtree)
        }
        self.loaders = Loaders(self.state, self.saved)
        # The tensors in their state are read first, apart: they load before the others are read.
        early = {key: wanted.pop(key) for key in self.loaders.tensor_keys() & wanted.keys()}
        store, location, manifest, verify = self.store, self.location, self.manifest, self.options.verify
        first, _ = read_tensors(store, self.io, location, manifest, early, verify=verify)
        self.plan = self._plan(wanted)
        tensors = self.tensors = {**first, **self.plan.tensors}
        for key, like in targets.items():
            if key in tensors:
                tensors[key] = wrap_like(tensors[key], like)
        _decodes(subtree, tensors, self.step)
        _refuse(check_loadable(self.state, self.saved, tensors), self.step, self.whose)
        self.streams = _owned_rng(manifest, self.rank, self.step) if self.options.rng else None

    def _plan(self, wanted: dict[str, Region | None]) -> ReadPlan:
        """The read of ``wanted``, checked: straight into the caller's own tensors where they can
        take the bytes (no fresh memory to fault in: half of a restore's time), filled only
        once every rank checked every byte (:meth:`load`); fresh tensors read already."""
        store, location, manifest, verify = self.store, self.location, self.manifest, self.options.verify
        into = destinations(self.state, self.saved, self.targets, manifest.specs) if store.is_local else None
        stat_files(store, location, manifest, tensor_files(manifest, wanted))  # before allocating
        plan = plan_read(manifest, wanted, into)
        if not plan.direct:
            fill(store, self.io, location, manifest, plan, verify=verify)
        check_read(store, self.io, location, manifest, plan, verify=verify)
        return plan

    def load(self) -> CheckpointError | None:
        """Load the checked step into the caller's state, every rank at once: first the objects
        that load their own small state (one refusing it puts them back: nothing else has
        changed yet), then the bytes into the caller's tensors, then the rest. Damage found
        meanwhile is returned, a refusal raised; either way those objects are put back first."""
        loaders, tag = self.loaders, self.tag
        try:
            self.group.exchange(("load", *tag), partial(_load_own, loaders, self.tensors, self.step))
            self.group.exchange(("fill", *tag), self._fill)
        except CheckpointError as exc:
            loaders.undo()
            return exc
        except BaseException:
            loaders.undo()
            raise
        try:
            apply_all = partial(_apply, self.state, self.saved, self.tensors, self.step, loaders.done)
            self.group.exchange(("apply", *tag), apply_all)
        except BaseException:
            loaders.undo()
            raise
        return None

    def _fill(self) -> None:
        """Every rank has checked all it reads: only now may the caller's memory be written."""
        if self.plan.direct:
            fill(self.store, self.io, self.location, self.manifest, self.plan, verify=self.options.verify)


def check_step_files(store: Readable, io: Pool, location: str, manifest: Manifest, verify: bool) -> None:
    """Beyond the tensors a restore reads: the DCP metadata says what the manifest says, and the
    plain values' byte items hold the manifest's values (``_dcp_check``)."""
    if METADATA_FILE not in manifest.files:
        # A manifest made from the step's .metadata itself (parse refuses an nbckpt manifest
        # that lists none): one description of the step, nothing to compare it with.
        return
    name = f"{step_name(manifest.step)}/{METADATA_FILE}"
    spans = check_dcp_metadata(read_metadata(store, location, manifest), manifest, name)
    check_values(store, location, manifest, spans)


class _Lacks(CheckpointError):
    """The newest step holds other names than the caller's state asks for: try an older one."""

    def __init__(self, step: int, asked: list[str], holds: list[str], by_rank: dict[int, list[str]]) -> None:
        super().__init__(f"{step_name(step)} holds {listed(holds)}")
        self.step, self.asked, self.holds, self.by_rank = step, asked, holds, by_rank

    def refusal(self, url: str) -> ConfigError:
        newest = f"(the newest, step {self.step}, holds {listed(self.holds)})"
        if not self.by_rank:  # one process
            return ConfigError(f"no step in {url} holds {listed(self.asked)} {newest}")
        ranks: dict[tuple[str, ...], list[int]] = {}
        for rank, missing in sorted(self.by_rank.items()):
            ranks.setdefault(tuple(missing), []).append(rank)
        whose = "; ".join(
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {listed(list(m))}"
            for m, r in ranks.items()
        )
        return ConfigError(
            f"no step in {url} holds every key the ranks' states name (missing on {whose}) {newest}"
        )


def _refuse(problems: list[str], step: int, whose: str = "this state") -> None:
    if problems:
        more = (
            f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
            if len(problems) > 1
            else ""
        )
        raise ConfigError(f"cannot restore {step_name(step)} into {whose}: {problems[0]}{more}")


def _owned_rng(manifest: Manifest, rank: int, step: int) -> Callable[[], None] | None:
    """The RNG streams this process saved in ``step``, parsed (so a malformed record fails the
    read, before anything is changed); None, with a warning, when another process saved them."""
    record = manifest.rng(rank)
    if record is None:
        return None
    owner, me = rng_owner(record, rank), rng_process()
    if owner[0] != me[0]:
        warnings.warn(
            f"nbckpt: {step_name(step)} holds the RNG streams of rank {owner[0]}; rank {me[0]} keeps "
            "its own (to resume every rank's streams, every rank saves: ranks='all')",
            stacklevel=10,  # the caller of Checkpointer.restore
        )
        return None
    return rng_parse(record)


def _decodes(tree: dict[str, Any], tensors: dict[str, Any], step: int) -> Any:
    """The values of ``tree``; one that does not decode (the manifest's checks missed it) is a
    damaged step, found before the caller's state changes."""
    try:
        return decode(tree, tensors)
    except NbckptError:
        raise
    except Exception as exc:  # whatever a hostile tree makes decoding raise
        raise CheckpointError(
            f"{step_name(step)}/{MANIFEST} holds a value that does not decode: {describe_error(exc)}"
        ) from exc


def _load_own(loaders: Loaders, tensors: dict[str, Any], step: int) -> None:
    try:
        loaders.load(tensors)
    except Refused as exc:
        raise ConfigError(f"cannot restore {step_name(step)} into this state: {exc}") from exc


def _apply(
    state: dict[str, Any], saved: dict[str, Any], tensors: dict[str, Any], step: int, done: set[int]
) -> None:
    try:
        apply(state, saved, tensors, done)
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:  # e.g. an optimizer's groups
        raise ConfigError(f"cannot restore {step_name(step)} into this state: {describe_error(exc)}") from exc


def device_of(map_location: Any) -> torch.device | None:
    """``map_location`` as a device this process has; ConfigError in one line if it is none."""
    if map_location is None:
        return None
    if not isinstance(map_location, (str, torch.device)):
        raise ConfigError(
            "map_location must be a device such as 'cpu', 'cuda:0' or 'meta', "
            f"not {type(map_location).__name__}"
        )
    try:
        device = torch.device(map_location)
        torch.empty(0, device=device)  # the device exists here (a CPU-only torch has no 'cuda')
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:
        reason = describe_error(exc)
        raise ConfigError(f"map_location {map_location!r} is not a device here: {reason}") from None
    return device


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector held off while a restore makes its objects: reading 10,000
    tensors' manifest, ``.metadata`` and plans makes millions, and the collector's passes over
    them were a third of the restore (unpickling the ``.metadata``: 0.22 s, 0.04 s without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
