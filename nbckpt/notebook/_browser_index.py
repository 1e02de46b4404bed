"""A run's checkpoints as the Browser lists them: its steps read into rows, the rows of its
tables, and deleting a step. Every read goes through a read-only Checkpointer opened for it and
closed after it (no lock, nothing written): the browser never holds the run's directory."""

from __future__ import annotations

import argparse
import html
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pandas as pd
import torch

from .._errors import CheckpointError, ConfigError
from .._util import format_bytes
from ..engine import Checkpointer
from ..engine._internal import writer_of

__all__ = [
    "DIFF_ROWS",
    "HERE",
    "RowKey",
    "StepRow",
    "delete_step",
    "diff_rows",
    "diff_summary",
    "per_run",
    "read_run",
    "refusal",
    "restore_step",
    "saved_values",
    "step_row",
    "verdict",
]

RowKey = tuple[str, int]
#: Tensors the diff table lists (most changed first); the whole frame is ``browser.diff_frame``.
DIFF_ROWS = 50
#: The browsed run's own steps (a key's other runs: those set aside in it after a rewind, by name).
HERE = ""
#: Each run the browser lists: its ``path``, ``steps`` and the step it was set ``after`` aside.
Runs = dict[str, dict[str, Any]]
_T = TypeVar("_T")


@dataclass(frozen=True)
class StepRow:
    """One committed step of the run (``run`` is :data:`HERE`) or of a run set aside in it (its
    name), as its manifest describes it; ``problem`` says why the manifest could not be read (the
    other facts are then None), ``verdict`` what Verify found."""

    run: str
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
    verdict: str = "not checked"

    @property
    def key(self) -> RowKey:
        return (self.run, self.step)

    @property
    def id(self) -> str:
        """The row's id in the table: the step, or ``set-aside-1:30`` (a run's name holds no colon)."""
        return str(self.step) if self.run == HERE else f"{self.run}:{self.step}"

    @property
    def name(self) -> str:
        return f"step {self.step}" if self.run == HERE else f"{self.run} step {self.step}"


def _tensors_in(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    value = vars(value) if isinstance(value, argparse.Namespace) else value
    if isinstance(value, Mapping):
        return any(map(_tensors_in, value.values()))
    return isinstance(value, (list, tuple)) and any(map(_tensors_in, value))


def saved_values(state: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    """The values saved beside the tensors, by dotted key: the state's plain entries and those
    of its containers that hold no tensor (hyperparameters, counters). A module's or an
    optimizer's own settings stay out (``nbckpt show`` lists everything)."""
    found: dict[str, Any] = {}
    for key, value in state.items():
        # an optimizer that has not stepped holds no tensor, yet its param_groups are settings
        if _tensors_in(value) or (isinstance(value, Mapping) and set(value) == {"state", "param_groups"}):
            continue
        value = vars(value) if isinstance(value, argparse.Namespace) else value
        if isinstance(value, Mapping) and value:
            found.update(saved_values(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def path_of(directory: str, run: str) -> str:
    """Where ``run`` (:data:`HERE`, or a set-aside run's name) of the run at ``directory`` is."""
    return directory if run == HERE else f"{directory.rstrip('/')}/{run}"


def _reader(directory: str, storage_options: dict[str, Any], run: str) -> Checkpointer:
    # ranks="local": a browser in a torchrun'd kernel must never wait for the other ranks
    return Checkpointer(
        path_of(directory, run),
        read_only=True,
        ranks="local",
        writer_threads=1,
        storage_options=storage_options,
    )


def per_run(
    directory: str,
    storage_options: dict[str, Any],
    keys: Sequence[RowKey],
    read: Callable[[Checkpointer, str, int], _T],
) -> dict[RowKey, _T]:
    """``read(reader, run, step)`` for each of ``keys``, with one read-only Checkpointer a run."""
    found: dict[RowKey, _T] = {}
    for run in dict.fromkeys(run for run, _ in keys):
        with _reader(directory, storage_options, run) as reader:
            found.update({key: read(reader, *key) for key in keys if key[0] == run})
    return found


def _gone(reader: Checkpointer, step: int) -> bool:
    """The step was deleted since the listing (a run's retention)."""
    return step not in reader.steps()


def read_run(
    directory: str, storage_options: dict[str, Any], values: dict[str, dict[str, Any]]
) -> tuple[Runs, list[StepRow]]:
    """The run and the runs set aside in it, and a row for each of their committed steps;
    ``values`` caches the saved values by manifest checksum (read once per save)."""

    def row(reader: Checkpointer, run: str, step: int) -> StepRow | None:
        try:
            manifest = reader.manifest(step)
            checksum = str(manifest.get("checksum"))
            if checksum not in values:
                # map_location="meta": the values come from the manifest; no tensor byte is read
                values[checksum] = saved_values(reader.load(step, map_location="meta"))
        except CheckpointError as exc:
            return None if _gone(reader, step) else StepRow(run, step, problem=str(exc))
        timing = manifest.get("timing") or {}
        return StepRow(
            run,
            step,
            nbytes=int(manifest["bytes"]),
            unix_time=float(manifest["unix_time"]),
            stage_s=timing.get("stage_s"),
            write_s=timing.get("write_s"),
            tensors=len(manifest["items"]),
            checksum=checksum,
            values=values[checksum],
            provenance=dict(manifest.get("provenance") or {}),
        )

    with _reader(directory, storage_options, HERE) as here:  # the runs, and the run's own rows
        steps = here.steps()
        runs: Runs = {HERE: {"path": here.store.url, "steps": steps, "after": None}}
        runs.update({entry["name"]: entry for entry in here.set_aside_runs()})
        rows = [row(here, HERE, step) for step in steps]
    others = [(name, step) for name, run in runs.items() if name != HERE for step in run["steps"]]
    rows += per_run(directory, storage_options, others, row).values()
    return runs, [found for found in rows if found is not None]


def verdict(reader: Checkpointer, run: str, step: int) -> str:
    """``verified``, or ``damaged: <why>`` (damage is a result, not an error)."""
    try:
        reader.verify(step)
    except CheckpointError as exc:
        if _gone(reader, step):
            raise CheckpointError(f"{StepRow(run, step).name} is gone; refresh the browser") from exc
        return f"damaged: {exc}"
    return "verified"


def restore_step(directory: str, storage_options: dict[str, Any], key: RowKey, state: dict[str, Any]) -> int:
    """Restore step ``key`` into ``state`` from the run it is in (read-only)."""
    with _reader(directory, storage_options, key[0]) as reader:
        return reader.restore(state, step=key[1])


def refusal(directory: str, key: RowKey) -> str | None:
    """Why a step will not be deleted, or None: a save of it is in flight in this kernel."""
    run, step = key
    holder = writer_of(path_of(directory, run))
    if holder is not None and any(handle.step == step and not handle.done() for handle in holder.handles):
        return f"a save of step {step} is in flight in this kernel; delete it once it has committed"
    return None


def delete_step(directory: str, storage_options: dict[str, Any], key: RowKey) -> None:
    """Delete through the Checkpointer of this kernel that writes into the run (the magics',
    an autosave's), with its lock and rules; else through one opened for the delete (a
    directory's lock refuses it while another process saves there; an object store has none)."""
    run, step = key
    path = path_of(directory, run)
    if (holder := writer_of(path)) is not None:
        if holder.world_size > 1:  # its delete is collective: every rank must call it
            raise ConfigError(
                f"the run is open for writing on {holder.world_size} ranks of this "
                f"job; delete with its Checkpointer on every rank: ckpt.delete({step})"
            )
        holder.delete(step)
        return
    try:
        writer = Checkpointer(path, ranks="local", writer_threads=1, storage_options=storage_options)
    except CheckpointError as exc:
        raise CheckpointError(
            f"cannot open the run for writing: {exc} (the Checkpointer saving "
            f"into it can: ckpt.delete({step}))"
        ) from exc
    with writer:
        writer.delete(step)


def _number(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return f"{value:.{digits}g}"


def _provenance(origin: dict[str, Any]) -> str:
    """Versions, git commit, program and host of a step."""
    parts = [
        f"{name} {origin[key]}"
        for name, key in (("nbckpt", "nbckpt"), ("torch", "torch"), ("Python", "python"))
        if origin.get(key)
    ]
    git = origin.get("git")
    if isinstance(git, dict) and git.get("commit"):
        parts.append(f"git {str(git['commit'])[:10]}{' (dirty)' if git.get('dirty') else ''}")
    if origin.get("program"):
        parts.append(os.path.basename(str(origin["program"])) or str(origin["program"]))
    return " · ".join([*parts, *([str(origin["host"])] if origin.get("host") else [])])


def step_row(row: StepRow, run: dict[str, Any]) -> dict[str, Any]:
    """A step as a row of the steps table."""
    label = "this run" if row.run == HERE else row.run
    if run.get("after") is not None:
        label += f" (set aside after step {run['after']})"
    shown = f"damaged: {row.problem}" if row.problem is not None else row.verdict
    cells = [
        label,
        str(row.step),
        "—" if row.nbytes is None else format_bytes(row.nbytes),
        "—" if row.unix_time is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(row.unix_time)),
        *("—" if s is None else f"{s:.3f}" for s in (row.stage_s, row.write_s)),
        shown,
        ", ".join(f"{key}={value!r}" for key, value in row.values.items()),
        _provenance(row.provenance),
    ]
    return {"id": row.id, "cells": cells, "tone": "" if shown == "not checked" else shown.split(":")[0]}


def diff_rows(frame: pd.DataFrame, limit: int = DIFF_ROWS) -> list[dict[str, Any]]:
    """The first ``limit`` rows of a diff as table rows."""
    return [
        {
            "id": str(record["key"]),
            "tone": "quiet" if record["status"] == "unchanged" else "",
            "cells": [
                str(record[name]) for name in ("key", "status", "dtype", "shape", "numel", "changed_elements")
            ]
            + [_number(record[name]) for name in ("diff_norm", "max_abs_diff", "rel_change")]
            + [_number(record["cosine"], 6)],
        }
        for record in frame.head(limit).to_dict(orient="records")
    ]


def diff_summary(a: StepRow, b: StepRow, frame: pd.DataFrame, limit: int = DIFF_ROWS) -> str:
    """One line above the diff table: what was compared and what changed, as HTML."""
    parts = ", ".join(f"{int(n)} {status}" for status, n in frame["status"].value_counts().items())
    text = f"{a.name} → {b.name}: {len(frame)} tensors ({parts or 'none'})"
    if len(frame) > limit:
        text += f"; the table lists the {limit} that changed most"
    return f'<div class="nbckpt-diff-summary">{html.escape(text)}</div>'
