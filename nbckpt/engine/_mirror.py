"""A second tier: every step committed in the run's directory is also uploaded, in the
background, to a mirror (an object store, or another directory) with its own commit there.

Saves never wait for it; a restore reads it only when the local copy is gone or damaged. An
upload checks every block against the manifest (a damaged copy is never passed on) and writes
the manifest last. A mirror holds one run (``.nbckpt-mirror.json`` names it; two runs would
delete each other's steps), in the run's layout, and keeps what the run's retention keeps (of
the run's own steps: the run sets steps aside on the mirror as in its directory, and retention
never looks into a set-aside run). The backlog is bounded: a step retention gives up while its
upload waits is not uploaded (said in the log); a run reopened after a crash uploads what its
mirror lacks.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError, ConfigError, describe_error
from .._util import is_url
from ._config import CheckpointConfig
from ._context import Context
from ._faults import fault_point
from ._files import copy_file, damage_named
from ._format import LOCK_FILE, step_name
from ._open_store import open_store
from ._retention import RetentionPolicy, StepFacts, StepInfo, doomed, expired, top_names
from ._saver import Commit
from ._shared import open_on_rank0
from ._store import Store
from ._timeline import now_ns
from ._workers import Backlog, Worker

__all__ = ["Mirror", "mirror_of", "mirror_target", "open_mirror", "refuse_a_mirror"]

_log = logging.getLogger("nbckpt")
#: At the mirror's root: the run the mirror belongs to.
MARKER = ".nbckpt-mirror.json"


def mirror_of(store: Store) -> str | None:
    """The run whose mirror ``store`` is (from its marker), or None when it is no mirror."""
    try:
        data = store.read_small(store.url, MARKER, 1 << 16)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, CheckpointError) as exc:
        raise CheckpointError(f"cannot read {store.url}/{MARKER}: {describe_error(exc)}") from exc
    try:
        run = json.loads(data)["run"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{store.url}/{MARKER} is not a mirror marker nbckpt wrote") from exc
    return str(run)


def refuse_a_mirror(store: Store) -> None:
    """ConfigError when ``store``, about to be opened as a run to write into, is a run's mirror."""
    owner = mirror_of(store)
    if owner is not None:
        raise ConfigError(
            f"{store.url} is the mirror of the run {owner}; open it with read_only=True to "
            "read it, or name it as mirror= of that run"
        )


@dataclass
class _Upload:
    """A committed step waiting for (or in) its upload."""

    step: int
    source: Store
    location: str


@dataclass
class _Job:
    """Work on the mirror's own steps that must come after the uploads queued before it."""

    action: Callable[[Store], None]
    what: str


class Mirror:
    """Uploads committed steps to ``root`` on one background thread, in commit order."""

    def __init__(
        self,
        root: Store,
        *,
        policy: RetentionPolicy | None,
        context: Context,
        nonce: str,
        writes: bool,
    ) -> None:
        """``writes``: this process uploads (rank 0 of a run not opened read-only)."""
        self.root, self.policy, self.timeline = root, policy, context.timeline
        self._nonce, self._writes = nonce, writes
        self._worker = Worker("nbckpt-mirror", nice=context.nice)
        self._lock = threading.Lock()
        self._waiting: deque[_Upload | _Job] = deque()
        self._uploading: _Upload | None = None
        self._backlog = Backlog(self._worker)
        self._skipped = 0
        self._facts: dict[str, StepFacts] = {}  # per store (its URL), for retention
        self.failures: list[str] = []
        self._count = 0
        # Per store (its URL): where the last upload committed and its files, whose
        # unchanged ones the next upload shares there instead of sending (incremental saves).
        self._last: dict[str, tuple[str, dict[str, Any]]] = {}
        # Jobs that failed (a set-aside the mirror refused for a while): each is tried again
        # before every later upload until it is done, on the mirror's thread.
        self._owed: list[_Job] = []

    def claim(self, run: str) -> None:
        """Make the mirror this run's; ConfigError when it belongs to another run or is a run."""
        owner = mirror_of(self.root)
        if owner is not None and owner != run:
            raise ConfigError(
                f"the mirror {self.root.url} belongs to the run {owner}; a mirror holds one run (two "
                f"would delete each other's steps): give {run} a mirror of its own, or delete "
                f"{self.root.url}/{MARKER} to hand the mirror over"
            )
        if owner is None:
            if LOCK_FILE in self.root.names():
                raise ConfigError(
                    f"the mirror {self.root.url} is a run's directory (it has {LOCK_FILE}); "
                    "give the mirror a directory of its own"
                )
            record = {"run": run, "created": time.time()}
            self.root.write_small(MARKER, json.dumps(record).encode())

    def check(self, run: str) -> None:
        """For a reader: ConfigError when the mirror holds another run's (unreachable: a warning)."""
        try:
            owner = mirror_of(self.root)
        except CheckpointError as exc:
            _log.warning("nbckpt: %s; reading without it", exc)
            return
        if owner is not None and owner != run:
            raise ConfigError(f"the mirror {self.root.url} belongs to the run {owner}, not to {run}")

    def committed(self, commit: Commit) -> None:
        """As a commit observer: ``commit`` goes up, after the uploads queued before it."""
        self.upload(commit.store, commit.step, commit.location)

    def release(self, store: Store, steps: list[int]) -> set[int]:
        """Of ``steps`` of ``store`` (retention deletes them), the one being uploaded (it stays for
        now); the waiting uploads of the others are dropped."""
        with self._lock:
            doomed = set(steps)
            dropped = [
                e
                for e in self._waiting
                if isinstance(e, _Upload) and e.source.url == store.url and e.step in doomed
            ]
            for entry in dropped:
                self._waiting.remove(entry)
            uploading = self._uploading
        for entry in dropped:
            self._said_skip(entry)
        busy = {uploading.step} if uploading is not None and uploading.source.url == store.url else set()
        return busy & doomed

    def settle(self) -> None:
        """Returns at once: the mirror changes nothing in the run's directory (a save is over
        without its upload; :meth:`wait` waits for the uploads)."""

    def upload(self, source: Store, step: int, location: str) -> None:
        """Queue ``step`` (committed at ``location`` of ``source``) for upload."""
        with self._lock:
            entry = _Upload(step, source, location)
            same = None
            for waiting in reversed(self._waiting):
                if isinstance(waiting, _Job):
                    # A job (a set-aside) lies between: the step waiting is one it moves on the
                    # mirror, saved again since. Taking its place, the new copy went up first
                    # and was moved aside there as the old one.
                    break
                if waiting.step == step:
                    same = waiting
                    break
            if same is not None:  # saved again before its upload began: the one upload takes the newest copy
                same.source, same.location = source, location
                return
            self._waiting.append(entry)
        self._submit()

    def _said_skip(self, entry: _Upload) -> None:
        self._skipped += 1
        level = logging.WARNING if self._skipped == 1 else logging.INFO
        _log.log(
            level,
            "nbckpt: the mirror %s is slower than the saves: step %d is not uploaded (skipped %d so far); "
            "it gets what retention (%s) keeps",
            self.root.url,
            entry.step,
            self._skipped,
            self.policy,
        )

    def resume(self, run: Store) -> None:
        """Queue what the mirror lacks of the run's committed steps (those retention keeps), as
        after a crash that cut uploads short."""
        local = run.committed()
        there = set(self.root.committed()) if local else set()
        wanted = sorted(local)
        if self.policy is not None and wanted:
            kept = self.policy.keep(StepFacts(run).infos(self.policy, wanted))
            wanted = [step for step in wanted if step in kept]
        missing = [step for step in wanted if step not in there]
        for step in missing:
            self.upload(run, step, local[step])
        if missing:
            _log.info(
                "nbckpt: uploading %d committed step(s) the mirror %s lacks", len(missing), self.root.url
            )

    def moved(self, source: Store, locations: Mapping[int, str]) -> None:
        """Committed steps of ``source`` moved to ``locations`` (step: where it is now): the
        uploads waiting for them read them there."""
        with self._lock:
            for entry in [*self._waiting, self._uploading]:  # the one going up: tried again there
                if isinstance(entry, _Upload) and entry.source.url == source.url and entry.step in locations:
                    entry.location = locations[entry.step]

    def after_uploads(self, action: Callable[[Store], None], what: str) -> None:
        """Run ``action`` on the mirror's root, on its thread, once the uploads queued before
        are over; what it raises is a failure :meth:`wait` returns (``what`` names it), and it
        is tried again before each later upload until it is done."""
        with self._lock:
            self._waiting.append(_Job(action, what))
        self._submit()

    def _do(self, job: _Job, again: bool = False) -> bool:
        """Run ``job``; whether it is done (a failure is said once, and owed from then on)."""
        try:
            job.action(self.root)
        except Exception as exc:
            if not again:
                self._owed.append(job)
                self._failed(
                    f"the mirror {self.root.url} could not {job.what} (tried again before each later "
                    f"upload): {describe_error(exc)}"
                )
            return False
        return True

    def _settle_owed(self, entry: _Upload) -> bool:
        """Before ``entry``'s upload: the jobs owed, tried again; whether it may go up (none is
        left). A set-aside left undone let a step saved again since (its number reused after the
        rewind) go up under a name the mirror's intent still lists, and the next open (or the
        job done later) moved the run's newest step aside there as an old one. Not uploaded, it
        goes up when the run is opened again (:meth:`resume`), as after a crash."""
        self._owed = [job for job in self._owed if not self._do(job, again=True)]
        if self._owed:
            self._failed(
                f"step {entry.step} is committed locally but not on the mirror {self.root.url}: it "
                f"waits until the mirror can {self._owed[0].what}"
            )
        return not self._owed

    def wait(self) -> list[str]:
        """Block until every queued upload is over; return (and forget) the failures since last."""
        self._backlog.wait()
        with self._lock:
            failures, self.failures = self.failures, []
        return failures

    def stop(self, wait: bool) -> None:
        self._worker.stop(wait)

    def _submit(self) -> None:
        self._backlog.submit(self._next)

    def _next(self) -> None:
        """The worker's job: the oldest entry waiting, if one is left (skips shorten the queue)."""
        try:
            with self._lock:
                entry = self._waiting.popleft() if self._waiting else None
                self._uploading = entry if isinstance(entry, _Upload) else None
            if isinstance(entry, _Job):
                self._do(entry)
            elif entry is not None and self._settle_owed(entry):
                self._upload(entry)
        finally:
            with self._lock:
                self._uploading = None

    def _upload(self, entry: _Upload) -> None:
        began = now_ns()
        step, source, location = entry.step, entry.source, entry.location
        store: Store | None = None
        target: str | None = None
        committed = False
        try:
            store = self.root
            manifest, data = source.read_manifest(step, location)
            facts = self._facts_of(store)
            if self._would_delete(facts, step, manifest.tree(0), manifest.metrics):
                return  # retention on the mirror would delete it again at once
            with self._lock:
                self._count += 1
                nonce = f"{self._nonce}f{self._count:x}"  # hex: a leftover of it is recognised
            target = store.begin(step, nonce)
            copied = 0
            for name, meta in manifest.files.items():
                fault_point("mirror.upload", location, name)
                if self._shared(store, target, name, meta):
                    continue
                # closed after the copy: an open descriptor would keep the step's disk space once
                # a retention pass deletes it
                with (
                    damage_named(f"{step_name(step)}/{name}"),
                    closing(source.source(location, name, meta["size"])) as read,
                ):
                    copied += copy_file(read, store.sink(target, name), meta["blocks"], fsync=store.is_local)
            self._last[store.url] = (store.commit(target, step, data), manifest.files)
            committed = True
            facts.saved(step, manifest.tree(0), manifest.metrics)
            self.timeline.record("upload", began, step=step, nbytes=copied, mirror=store.url)
            self._retain(facts, step)
        except Exception as exc:
            if store is not None and target is not None and not committed:
                store.discard(target)
            with self._lock:
                moved = entry.location != location
            if moved and not committed:  # set aside as it went up (its files gone): from there
                self._upload(entry)
                return
            url = store.url if store is not None else self.root.url
            message = f"step {step} is committed locally but not on the mirror {url}: {describe_error(exc)}"
            self.timeline.record("error", began, step=step, message=message)
            self._failed(message)

    def _shared(self, store: Store, target: str, name: str, meta: Mapping[str, Any]) -> bool:
        """Whether file ``name`` (``meta``: its size and block checksums) was made the mirror's
        file of the last step uploaded to ``store`` too, unsent (a hard link, a server-side copy):
        only where that step's file of that name has the same size and checksums, every block."""
        last = self._last.get(store.url)
        if last is None or last[1].get(name) != meta:
            return False
        try:
            store.share(last[0], target, name)
        except OSError:  # gone (the mirror's retention), or the storage cannot share: sent
            return False
        return True

    def _failed(self, message: str) -> None:
        with self._lock:
            self.failures.append(message)
        _log.warning("nbckpt: %s", message)

    def _facts_of(self, store: Store) -> StepFacts:
        """What retention knows of the mirror's steps, kept across uploads (each adds its own)."""
        return self._facts.setdefault(store.url, StepFacts(store))

    def _would_delete(
        self, facts: StepFacts, step: int, tree: Mapping[str, Any], metrics: Mapping[str, float]
    ) -> bool:
        """Whether the mirror's retention, with ``step`` uploaded, would delete it at once (by
        the rule of :func:`doomed`: only newer steps of its names count)."""
        if self.policy is None:
            return False
        names = top_names(tree)
        newer = [s for s in facts.store.committed() if s > step and facts.names(s) == names]
        infos = [*facts.infos(self.policy, newer), StepInfo(step, metrics)]
        return bool(newer) and step in expired(self.policy, infos, newest=max(newer))

    def _retain(self, facts: StepFacts, newest: int) -> None:
        """The mirror keeps what the run's directory keeps (never the step just uploaded)."""
        store = facts.store
        for step in doomed(self.policy, facts, newest):
            try:
                store.delete(step)
            except Exception as exc:
                _log.warning(
                    "nbckpt: could not delete %s from the mirror: %s", step_name(step), describe_error(exc)
                )


def mirror_target(config: CheckpointConfig, run: Store) -> Store | None:
    """The mirror's store, checked before anything is created: not a file, and neither the run's
    directory nor inside it nor holding it (one's retention would delete the other's steps)."""
    if config.mirror is None:
        return None
    store = open_store(config.mirror, config.mirror_options, "mirror")
    here, there = run.url.rstrip("/"), store.url.rstrip("/")
    if store.is_local:
        if os.path.exists(there) and not os.path.isdir(there):
            raise ConfigError(f"mirror {there} is a file, not a directory")
        if run.is_local:
            here, there = os.path.realpath(here), os.path.realpath(there)
    if is_url(here) == is_url(there) and (
        here == there or there.startswith(here + "/") or here.startswith(there + "/")
    ):
        how = "is" if here == there else "is inside" if there.startswith(here + "/") else "holds"
        raise ConfigError(
            f"mirror {store.url} {how} the run's directory {run.url}; a mirror needs a "
            "place of its own (each one's retention and clean-up would delete the other's steps)"
        )
    return store


def open_mirror(
    store: Store | None, config: CheckpointConfig, run: Store, context: Context, nonce: str
) -> Mirror | None:
    """The mirror of ``run`` at ``store``, claimed for it (checked only, when read-only)."""
    if store is None:
        return None
    group = context.caller
    writes = group.rank == 0 and not config.read_only
    mirror = Mirror(store, policy=config.retention, context=context, nonce=nonce, writes=writes)
    # The run a mirror belongs to: its directory as the file system knows it (a symlink or a
    # relative path to the same run is the same run), or its URL.
    owner = os.path.realpath(run.url) if run.is_local else run.url
    try:
        if config.read_only:
            mirror.check(owner)
        else:

            def prepare() -> None:
                mirror.claim(owner)
                store.recover()  # uploads cut short never count; their remains go

            open_on_rank0(
                group, ("open mirror",), store, store.prepare, prepare, undo=_nothing, what="mirror"
            )
    except BaseException:
        mirror.stop(True)
        raise
    return mirror


def _nothing() -> None:
    """A mirror's claim holds nothing to give back (no lock): its marker names the right run."""
