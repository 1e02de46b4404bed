"""Steps set aside after a rewind: a run has one sequence of steps, and the first save after
restoring an older step moves the steps newer than it into a run of their own, inside the run's
directory, where they stay restorable (``Checkpointer(run/set-aside-1)``) but "newest" never
picks them again. A step number is then the only identifier a user needs.

    run1/
      step-000010/ step-000020/ step-000025/   the run's steps (25 saved after restoring 20)
      set-aside-1/                             a run of its own: what was newer than 20 then
        set-aside.json                         {"run": ..., "after_step": 20, "steps": [...], ...}
        step-000030/
      .set-aside-intent.json                   only while a set-aside is under way
      .set-aside-tier.json                     only while the second tier's set-aside waits

Crash safety: the intent (which folders go where) is written atomically first, then each folder
is moved (a rename; an object store copies server-side, then deletes, the commit marker last in
and first out), then the intent goes. Opening a run for writing finishes a leftover intent
before anything else (:func:`finish`); a reader hides the steps it names, at each look
(:func:`visible`). So a step is restorable in exactly one place whatever the crash point.

A second tier (the mirror) sets its copies aside on its own thread, after the uploads queued
before: until then the run's directory notes which of its folders are hidden (:class:`TierNote`,
written before the run's steps move), so every rank's view of the tier, and any other reader's,
hides the same folders whether or not the tier could be told itself, and the next writable open
sets aside what a crash left noted.

An earlier release went on in ``branch-N/`` folders (``branch.json``: parent line, fork step)
instead: such a folder is listed here as a set-aside run too, and opened by its path like one
(its own steps; its parent's up to the fork are the run's). It is never converted.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .._errors import CheckpointError
from ._faults import fault_point
from ._files import Source
from ._format import MANIFEST, step_name
from ._manifest import Manifest
from ._store import Store, crash_point

__all__ = [
    "INTENT",
    "RECORD",
    "TIER_NOTE",
    "Hiding",
    "TierNote",
    "announce",
    "earlier_branch_note",
    "finish",
    "listing",
    "set_aside",
    "set_aside_into",
    "visible",
]

#: In a set-aside run: where it came from. In the run, while a set-aside is under way: its plan.
RECORD, INTENT = "set-aside.json", ".set-aside-intent.json"
#: In the run, while its second tier's set-asides wait: the tier's folders hidden meanwhile.
TIER_NOTE = ".set-aside-tier.json"
#: An earlier release's branch folder and its record.
_EARLIER_RECORD = "branch.json"
_FOLDER_RE = re.compile(r"(set-aside|branch)-([1-9][0-9]{0,8})", re.ASCII)
_INTO_RE = re.compile(r"set-aside-[1-9][0-9]{0,8}", re.ASCII)
_MOVABLE_RE = re.compile(r"step-[0-9]{1,19}", re.ASCII)  # nbckpt's step-NNNNNN, plain DCP's step-N
_LIMIT = 1 << 20


@dataclass(frozen=True)
class _Intent:
    into: str
    after_step: int
    folders: list[str]
    created: float

    def encode(self) -> bytes:
        return json.dumps(
            {
                "into": self.into,
                "after_step": self.after_step,
                "folders": self.folders,
                "created": self.created,
            }
        ).encode()


def _read_json(store: Store, name: str) -> dict[str, Any] | None:
    """The JSON object in file ``name`` of ``store``'s root; None when there is none."""
    try:
        data = store.read_small(store.url, name, _LIMIT)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise CheckpointError(f"{store.url}/{name} is not JSON nbckpt wrote") from exc
    if not isinstance(record, dict):
        raise CheckpointError(f"{store.url}/{name} is not JSON nbckpt wrote")
    return record


def _intent(root: Store) -> _Intent | None:
    """The set-aside under way in ``root`` (checked: names only folders of ``root``), or None."""
    record = _read_json(root, INTENT)
    if record is None:
        return None
    try:
        intent = _Intent(
            str(record["into"]),
            int(record["after_step"]),
            [str(f) for f in record["folders"]],
            float(record["created"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{root.url}/{INTENT} is not a set-aside record nbckpt wrote") from exc
    bad = [f for f in intent.folders if not _MOVABLE_RE.fullmatch(f)]
    if bad or not _INTO_RE.fullmatch(intent.into):
        raise CheckpointError(f"{root.url}/{INTENT} names folders nbckpt never moves: {bad or [intent.into]}")
    return intent


def _carry_out(root: Store, intent: _Intent) -> None:
    """Move the intent's folders into its set-aside run (those already there stay), then drop it.
    Each step of it moves whole: a rename, or every object copied before the source goes."""
    into = root.child(intent.into)
    if into is None:
        raise CheckpointError(f"cannot set steps aside into {root.url}/{intent.into}: it is not a folder")
    into.prepare()
    record = {
        "run": root.url,
        "after_step": intent.after_step,
        "steps": intent.folders,
        "created": intent.created,
    }
    into.write_small(RECORD, json.dumps(record).encode())
    for folder in intent.folders:
        root.move(folder, into)
        fault_point("set_aside.moved", root.url, folder)
        crash_point("set_aside_moving")
    crash_point("set_aside_moved")
    root.remove_small(INTENT)


def announce(root: Store, after_step: int, folders: list[str]) -> str | None:
    """Make durable the intent to move step ``folders`` of ``root`` (those newer than
    ``after_step``; any not there yet are moved once they are) into a new set-aside run in it,
    carried out by :func:`finish`, now or at the next writable open; until then a reader hides
    them. Its folder's name, or None where a set-aside is under way already (finish it first)."""
    if _intent(root) is not None:
        return None
    taken = [int(m.group(2)) for name in root.names() if (m := _FOLDER_RE.fullmatch(name))]
    intent = _Intent(f"set-aside-{max(taken, default=0) + 1}", after_step, folders, time.time())
    root.write_small(INTENT, intent.encode())
    return intent.into


def set_aside(root: Store, after_step: int, folders: list[str]) -> str:
    """Move step ``folders`` of ``root`` (those newer than ``after_step``) into a new set-aside
    run in it; return its folder's name. The intent is durable before anything moves. The caller
    has finished any set-aside under way (:func:`finish`: it also lists the folders after it)."""
    name = announce(root, after_step, folders)
    assert name is not None  # finished by the caller
    crash_point("set_aside_intent")
    finish(root)
    return name


def finish(root: Store) -> str | None:
    """Finish a set-aside a crash cut short in ``root`` (before anything else reads or writes
    it); the set-aside run's name, or None when none was under way."""
    intent = _intent(root)
    if intent is None:
        return None
    _carry_out(root, intent)
    return intent.into


class TierNote:
    """The run's durable note of the second tier's step folders hidden until the tier's thread
    has set them aside (one entry per set-aside, added before the run's steps move, dropped once
    the tier's are moved). Rank 0 writes it; every rank's view of the tier reads it at each look,
    so no rank reads a copy rank 0 hides, whether or not the tier itself could be told."""

    def __init__(self, run: Store) -> None:
        self._run, self._lock = run, threading.Lock()  # the caller's thread adds, the tier's drops

    def entries(self) -> dict[str, tuple[int, list[str]]]:
        """Each waiting set-aside's key, step it followed, and folders of the tier it hides."""
        record = _read_json(self._run, TIER_NOTE)
        if record is None:
            return {}
        try:
            entries = {
                str(key): (int(entry["after_step"]), [str(f) for f in entry["folders"]])
                for key, entry in record["hiding"].items()
            }
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self._run.url}/{TIER_NOTE} is not a record nbckpt wrote") from exc
        if any(not _MOVABLE_RE.fullmatch(f) for _, folders in entries.values() for f in folders):
            raise CheckpointError(f"{self._run.url}/{TIER_NOTE} names folders nbckpt never moves")
        return entries

    def hidden(self) -> set[str]:
        return {folder for _, folders in self.entries().values() for folder in folders}

    def add(self, after_step: int, folders: list[str]) -> str:
        """Note ``folders`` hidden, durably, until :meth:`drop` of the key returned."""
        key = uuid.uuid4().hex[:12]
        with self._lock:
            self._write({**self.entries(), key: (after_step, folders)})
        return key

    def drop(self, key: str) -> None:
        """The tier's folders newer than ``key``'s step are set aside: its entry goes, and so do
        those noted before it for the same step or a newer one (a set-aside that failed in the run
        after noting, tried again since: never queued, its entry stayed and hid the steps saved
        again under those names once they went up to the tier)."""
        with self._lock:
            entries = self.entries()
            if key not in entries:
                return
            after, order = entries[key][0], list(entries)
            earlier = set(order[: order.index(key)])
            self._write(
                {k: e for k, e in entries.items() if k != key and not (k in earlier and e[0] >= after)}
            )

    def _write(self, entries: dict[str, tuple[int, list[str]]]) -> None:
        if not entries:
            self._run.remove_small(TIER_NOTE)
            return
        hiding = {key: {"after_step": after, "folders": folders} for key, (after, folders) in entries.items()}
        self._run.write_small(TIER_NOTE, json.dumps({"hiding": hiding}).encode())

    def carry_out(self, tier: Store) -> None:
        """Set aside in ``tier`` what a crash left noted (those of its folders still there), then
        drop each entry: at a writable open, before anything reads the tier."""
        for key, (after, folders) in self.entries().items():
            there = set(tier.names())
            if present := [f for f in folders if f in there]:
                set_aside(tier, after, present)
            self.drop(key)


class Hiding:
    """A store as a restore sees it: without the step folders a set-aside under way moves (its
    intent read again at each look: a writer may begin one while this process reads the run)
    nor, for a second tier, those the run's :class:`TierNote` hides (its thread has not set them
    aside yet)."""

    def __init__(self, store: Store, note: TierNote | None = None) -> None:
        self._store, self._note = store, note
        self.url, self.is_local = store.url, store.is_local

    def _hidden(self) -> set[str]:
        try:
            intent = _intent(self._store)
        except (OSError, CheckpointError):  # unreadable: nothing can be said to be moving
            intent = None
        try:
            noted = self._note.hidden() if self._note is not None else set()
        except (OSError, CheckpointError):  # unreadable, as above
            noted = set()
        return noted | set(intent.folders) if intent is not None else noted

    def committed(self) -> dict[int, str]:
        hidden = self._hidden()  # before the listing: a step it names has not come back since
        return {s: path for s, path in self._store.committed().items() if step_name(s) not in hidden}

    def committed_at(self, step: int) -> str | None:
        return None if step_name(step) in self._hidden() else self._store.committed_at(step)

    def read_manifest(self, step: int, location: str) -> tuple[Manifest, bytes]:
        return self._store.read_manifest(step, location)

    def modified(self, location: str, name: str) -> float:
        return self._store.modified(location, name)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        return self._store.read_small(location, name, limit)

    def source(self, location: str, name: str, size: int | None) -> Source:
        return self._store.source(location, name, size)


def visible(root: Store, note: TierNote | None = None) -> Hiding:
    """``root`` as a restore sees it: the steps a set-aside under way (or one a crash cut short)
    moves are hidden (they are the set-aside run's; the writer, or the next writable open, moves
    them), and for a second tier those ``note`` (the run's) hides."""
    return Hiding(root, note)


def listing(root: Store) -> list[dict[str, Any]]:
    """Every set-aside run in ``root``, oldest first: its ``path``, ``name``, the step it was set
    aside ``after`` (None where an earlier release's branch record says none), its committed
    ``steps``, and ``earlier_release`` (a ``branch-N`` an earlier nbckpt wrote)."""
    found = []
    for name in sorted(root.names(), key=lambda n: (len(n), n)):
        match = _FOLDER_RE.fullmatch(name)
        store = root.child(name) if match else None
        if match is None or store is None:  # a symlink is never part of the run
            continue
        earlier = match.group(1) == "branch"
        try:
            record = _read_json(store, _EARLIER_RECORD if earlier else RECORD)
        except (OSError, CheckpointError):
            record = None
        if record is None:
            continue  # a folder whose record never got written holds nothing that counts
        after = record.get("from_step" if earlier else "after_step")
        found.append(
            {
                "name": name,
                "path": store.url,
                "after": after if isinstance(after, int) else None,
                "steps": list(store.committed()),
                "earlier_release": earlier,
            }
        )
    return found


def set_aside_into(root: Store, step: int) -> str | None:
    """Where ``step``, no longer one of ``root``'s, went: the set-aside run a set-aside under way
    moves it into, else the newest one holding it (None: it was never set aside)."""
    folders = {step_name(step), f"step-{step}"}  # nbckpt's and plain DCP's
    try:
        intent = _intent(root)
    except (OSError, CheckpointError):
        intent = None
    if intent is not None and folders & set(intent.folders):
        return f"{root.url.rstrip('/')}/{intent.into}"
    holding = [entry["path"] for entry in listing(root) if step in entry["steps"]]
    return holding[-1] if holding else None


def earlier_branch_note(root: Store) -> str | None:
    """A warning when an earlier release went on in a ``branch-N`` of ``root`` after the run's
    own newest step: this release continues from the run's steps, not from that branch."""
    if not any(name.startswith("branch-") for name in root.names()):
        return None  # the common case costs one listing
    own = root.committed()
    newest_own = root.modified(own[max(own)], MANIFEST) if own else -1.0
    later = []
    for entry in listing(root):
        store = root.child(entry["name"])
        if not (entry["earlier_release"] and entry["steps"] and store is not None):
            continue
        if store.modified(store.committed()[max(entry["steps"])], MANIFEST) > newest_own:
            later.append(entry["path"])
    if not later:
        return None
    return (
        f"nbckpt: {root.url} went on in {', '.join(later)} (a branch an earlier nbckpt started); "
        f"this run continues from its own steps: to go on from the branch, restore from "
        f"Checkpointer({later[-1]!r}) and save here"
    )
