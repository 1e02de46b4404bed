"""What the checkpoint browser knows of a run, without a widget: every step of every line with
its manifest's facts, verification results, and the actions (verify, diff, restore, delete).

Everything reads through read-only Checkpointers (``read_only=True``: no lock, nothing
written), opened for each action and closed after it. So a browser never holds the run's
directory, never blocks the Checkpointer training into it, and is never left holding a
Checkpointer that ``nbckpt.close_all()`` closed. Only a delete writes: through the Checkpointer
of this kernel that writes into the run (the magics', an autosave's, the user's), else through
one opened for it; see :meth:`RunIndex.delete`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from .._errors import CheckpointError, ConfigError
from .._util import is_url
from ..analysis._internal import diff_states
from ..engine import Checkpointer
from ..engine._internal import writer_of

__all__ = ["NOT_CHECKED", "Check", "RowKey", "RunIndex", "StepRow", "saved_values"]

RowKey = tuple[str, int]
#: The verification state of a step nobody has verified in this browser.
NOT_CHECKED = "not checked"
_MAIN = "main"


@dataclass(frozen=True)
class StepRow:
    """One committed step of one line, as its manifest describes it.

    ``problem`` says why the manifest could not be read (the other facts are then None)."""

    line: str
    step: int
    nbytes: int | None = None
    unix_time: float | None = None
    stage_s: float | None = None
    write_s: float | None = None
    tensors: int | None = None
    checksum: str | None = None
    values: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def key(self) -> RowKey:
        return (self.line, self.step)

    @property
    def id(self) -> str:
        """The row's id in the table (a line's name never holds a colon)."""
        return f"{self.line}:{self.step}"

    @property
    def name(self) -> str:
        return f"{self.line} step {self.step}"


@dataclass(frozen=True)
class Check:
    """What verifying a step found: ``verified`` or ``damaged`` (with why), for the manifest
    whose checksum it read (a step saved again since is not checked any more)."""

    checksum: str | None
    state: str
    detail: str = ""


def saved_values(state: Mapping[Any, Any]) -> dict[str, Any]:
    """The values saved beside the tensors, by dotted key: the state's plain entries and those
    of its containers that hold no tensor (hyperparameters, counters). A module's or an
    optimizer's own settings stay out (``nbckpt show`` lists everything)."""
    found: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [(str(key), value) for key, value in reversed(list(state.items()))]
    while stack:
        path, value = stack.pop()
        if isinstance(value, torch.Tensor) or _holds_tensor(value) or _is_optimizer_state(value):
            continue
        if isinstance(value, argparse.Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            stack.extend((f"{path}.{key}", item) for key, item in reversed(list(value.items())))
        else:
            found[path] = value
    return found


def _is_optimizer_state(value: Any) -> bool:
    # An optimizer that has not stepped (or SGD without momentum) holds no tensor, yet its
    # param_groups are its settings, not values the user saved.
    return isinstance(value, Mapping) and set(value) == {"state", "param_groups"}


def _holds_tensor(value: Any) -> bool:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, torch.Tensor):
            return True
        if isinstance(current, argparse.Namespace):
            current = vars(current)
        if isinstance(current, Mapping):
            stack.extend(current.values())
        elif isinstance(current, (list, tuple)):
            stack.extend(current)
    return False


def _by_line(keys: Iterable[RowKey]) -> dict[str, list[int]]:
    """The steps of ``keys`` by line, lines in the order they first come (one reader each)."""
    lines: dict[str, list[int]] = {}
    for line, step in keys:
        lines.setdefault(line, []).append(step)
    return lines


class RunIndex:
    """The steps of the run at ``directory`` (local, NFS or an fsspec URL such as ``s3://``)."""

    def __init__(
        self, directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ) -> None:
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory).strip():
            raise ConfigError(f"directory must be a non-empty path or URL, not {directory!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise ConfigError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self.directory = os.fspath(directory)
        self.url = self.directory.rstrip("/") if is_url(self.directory) else os.path.abspath(
            os.path.expanduser(self.directory)
        )
        self.storage_options = dict(storage_options or {})
        self.rows: list[StepRow] = []
        self.lines: dict[str, dict[str, Any]] = {}
        self.checks: dict[RowKey, Check] = {}  # of the rows shown: refresh drops one whose manifest changed
        self.restored: RowKey | None = None  # what the live objects were last restored from here
        self._values: dict[str, dict[str, Any]] = {}  # by manifest checksum: read once per save

    @contextmanager
    def _reader(self, line: str) -> Iterator[Checkpointer]:
        # ranks="local": a browser in a torchrun'd kernel must never wait for the other ranks
        reader = Checkpointer(self.directory, read_only=True, line=line, ranks="local",
                              writer_threads=1, storage_options=self.storage_options)
        try:
            yield reader
        finally:
            reader.close()

    def row(self, key: RowKey) -> StepRow:
        for row in self.rows:
            if row.key == key:
                return row
        raise ConfigError(f"the browser shows no step {key[1]} in line {key[0]}; refresh it")

    def refresh(self) -> list[StepRow]:
        """Read every line's committed steps and their manifests again."""
        with self._reader(_MAIN) as reader:
            lines = reader.lines()
            found = [self._read_row(reader, _MAIN, step) for step in lines[_MAIN]["steps"]]
        for name, line in lines.items():
            if name == _MAIN or not line["steps"]:
                continue
            with self._reader(name) as reader:
                found.extend(self._read_row(reader, name, step) for step in line["steps"])
        rows = [row for row in found if row is not None]
        self.lines, self.rows = lines, rows
        live = {row.key: row.checksum for row in rows}
        self.checks = {key: c for key, c in self.checks.items() if key in live and c.checksum == live[key]}
        return rows

    def _read_row(self, reader: Checkpointer, line: str, step: int) -> StepRow | None:
        try:
            manifest = reader.manifest(step)
            checksum = str(manifest.get("checksum"))
            values = self._values.get(checksum)
            if values is None:
                # map_location="meta": the values come from the manifest; no tensor byte is read
                values = self._values[checksum] = saved_values(reader.load(step, map_location="meta"))
        except CheckpointError as exc:
            if step not in reader.lines().get(line, {}).get("steps", ()):
                return None  # deleted since the listing (a run's retention): not damage
            return StepRow(line, step, problem=str(exc))
        timing = manifest.get("timing") or {}
        return StepRow(
            line, step, nbytes=int(manifest["bytes"]), unix_time=float(manifest["unix_time"]),
            stage_s=timing.get("stage_s"), write_s=timing.get("write_s"), tensors=len(manifest["items"]),
            checksum=checksum, values=values, provenance=dict(manifest.get("provenance") or {}),
        )

    def verify(self, keys: Sequence[RowKey]) -> list[Check]:
        """Check every block of every file of each step, one reader per line; damage is a
        result, not an error."""
        results: dict[RowKey, Check] = {}
        for line, steps in _by_line(keys).items():
            with self._reader(line) as reader:
                for step in steps:
                    checksum = self.row((line, step)).checksum
                    try:
                        reader.verify(step)
                    except CheckpointError as exc:
                        if step not in reader.lines().get(line, {}).get("steps", ()):
                            raise CheckpointError(f"{line} step {step} is gone; refresh the browser") from exc
                        result = Check(checksum, "damaged", str(exc))
                    else:
                        result = Check(checksum, "verified")
                    self.checks[(line, step)] = results[(line, step)] = result
        return [results[key] for key in keys]

    def load(self, *keys: RowKey) -> list[dict[str, Any]]:
        """Steps' whole states on the CPU, weights only (nothing is unpickled), one reader per line."""
        states: dict[RowKey, dict[str, Any]] = {}
        for line, steps in _by_line(keys).items():
            with self._reader(line) as reader:
                for step in steps:
                    states[(line, step)] = reader.load(step, map_location="cpu")
        return [states[key] for key in keys]

    def ordered(self, first: RowKey, second: RowKey) -> tuple[StepRow, StepRow]:
        """The two steps, the one committed first first."""
        a, b = self.row(first), self.row(second)
        return (a, b) if (a.unix_time or 0.0, a.step) <= (b.unix_time or 0.0, b.step) else (b, a)

    def diff(self, first: RowKey, second: RowKey) -> tuple[StepRow, StepRow, pd.DataFrame]:
        """Every tensor of the earlier step against the later one (see ``diff_states``)."""
        a, b = self.ordered(first, second)
        return a, b, diff_states(*self.load(a.key, b.key))

    def restore(self, key: RowKey, target: dict[str, Any]) -> int:
        """Load a step into ``target``'s live objects in place (``Checkpointer.restore``'s rules)."""
        line, step = key
        with self._reader(line) as reader:
            restored = reader.restore(target, step=step)
        self.restored = key
        return restored

    def refusal(self, key: RowKey) -> str | None:
        """Why the browser will not delete a step, or None."""
        line, step = key
        if key == self.restored:
            return (f"the live objects were restored from it by this browser; restore another step "
                    f"first (or delete it with the run's Checkpointer: ckpt.delete({step}))")
        for name, other in self.lines.items():
            if other.get("parent") == line and other.get("from_step") == step:
                return f"{name} goes on from it, and would lose the step it starts from"
        holder = writer_of(self.directory)
        if holder is not None and line == holder.line_name and any(
            handle.step == step and not handle.done() for handle in holder.handles
        ):
            return f"a save of step {step} is in flight in this kernel; delete it once it has committed"
        return None

    def delete(self, key: RowKey) -> None:
        """Delete a committed step of a line.

        When a Checkpointer of this kernel writes into the run (the magics' or an autosave's,
        even after ``%ckpt_autosave --off``: the session keeps the directory open), the delete
        goes through it, with its lock, its bookkeeping and its rules (it waits for the saves in
        flight; the step being saved is refused). Else it opens the run for writing for the
        length of the delete: on a directory that takes the run's lock, and when another process
        saves into it the engine refuses, with the reason. An object store has no lock, and
        opening it for writing discards the uncommitted remains of any save going on there: the
        widget asks for a confirmation that says so.
        """
        reason = self.refusal(key)
        if reason is not None:
            raise ConfigError(reason)
        line, step = key
        holder = writer_of(self.directory)
        if holder is not None:
            if holder.world_size > 1:  # its delete is collective: every rank must call it
                raise ConfigError(f"the run is open for writing on {holder.world_size} ranks of this "
                                  f"job; delete with its Checkpointer on every rank: ckpt.delete({step})")
            holder.delete(step, line=line)
            self.checks.pop(key, None)
            return
        try:
            writer = Checkpointer(self.directory, line=line, ranks="local", writer_threads=1,
                                  storage_options=self.storage_options)
        except CheckpointError as exc:
            raise CheckpointError(
                f"cannot open the run for writing: {exc} (the Checkpointer saving into it can: "
                f"ckpt.delete({step}))"
            ) from exc
        with writer:
            writer.delete(step)
        self.checks.pop(key, None)
