"""Measured scaling on one node: ``nbckpt bench --ranks 1,2,4`` launches torchrun itself.

For each rank count the sweep runs ``python -m torch.distributed.run --standalone
--nproc-per-node N -m nbckpt bench ...`` as a child process (the bench's other options passed
through, each size's JSON kept beside the sweep's), one size after the other, and then makes one
table and one JSON of every size: per strategy and rank count the aggregate write GB/s, the
stall's median and p99 over ranks and the job's overhead, beside the concurrent raw-write floor
measured by the same ranks in the same run (:func:`scaling_rows`; schema in
:func:`scaling_document`). From Python (a notebook): :func:`sweep`, the same run, returning each
size's :class:`~._comparison.Comparison`.

No process is left behind: each size is a :class:`~._launch.RankLaunch`, ended whatever way
the sweep ends (a finished size, a rank that died, Ctrl-C, an error). A rank that dies is named
in one line, from torchrun's own account of the first failure and the rank's last line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .._errors import CheckpointError, ConfigError
from .._util import run_target
from ..engine._internal import deferred_interrupt, write_atomic
from ._compare import add_bench_arguments, checked_bench
from ._comparison import Comparison, _json_value
from ._job import _number
from ._launch import RankLaunch

__all__ = [
    "SCALING_SCHEMA",
    "arm_sweep_seam",
    "check_json_path",
    "parse_ranks",
    "passthrough",
    "run_sweep",
    "scaling_document",
    "scaling_rows",
    "scaling_table",
    "sweep",
    "write_document",
]

SCALING_SCHEMA = "nbckpt.bench.scaling/1"
# The sweep's own options, and argparse's bookkeeping: not passed to the children.
_NOT_PASSED = frozenset({"command", "run", "ranks", "json", "events"})

#: Called with every line a size's ranks print on stderr and torchrun's process: the test-only
#: seam that ends the sweep at a defined point (raise KeyboardInterrupt) or a rank.
_seam: Callable[[str, subprocess.Popen[str]], None] | None = None


def arm_sweep_seam(seam: Callable[[str, subprocess.Popen[str]], None] | None) -> None:
    """Arm (None: disarm) the test-only seam: ``seam(line, torchrun)`` for every stderr line."""
    global _seam
    _seam = seam


def parse_ranks(ranks: str | Iterable[int], name: str = "--ranks") -> list[int]:
    """``"1,2,4"`` (or ``[1, 2, 4]``: :func:`sweep`'s) -> ``[1, 2, 4]``; a one-line ConfigError
    naming ``name`` for anything else."""
    try:
        parts = ranks.split(",") if isinstance(ranks, str) else list(ranks)
        sizes = [int(str(part)) for part in parts if str(part).strip()]  # str: 1.5 and True are no counts
    except (TypeError, ValueError):  # TypeError: one number, not several (sweep(2, ...))
        sizes = []
    if not sizes or any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        form = "separated by commas (1,2,4)" if name.startswith("--") else "in a list ([1, 2, 4])"
        raise ConfigError(f"{name} wants distinct rank counts >= 1 {form}, not {ranks!r}")
    return sizes


def check_json_path(path: str) -> None:
    """A one-line ConfigError unless ``path`` names a file in an existing directory (checked
    before any rank starts, so that a sweep's results never go nowhere)."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or os.path.isdir(path):
        raise ConfigError(f"--json {path}: give a file name in an existing directory")


def write_document(document: Mapping[str, Any], path: str) -> None:
    """The sweep's JSON, written whole or not at all (NaN as null)."""
    write_atomic(path, json.dumps(_json_value(document), indent=1, allow_nan=False).encode())


def passthrough(args: argparse.Namespace, leave_out: Sequence[str] = ()) -> list[str]:
    """The bench's options as given, for each size's ``nbckpt bench`` (each option's flag is its
    name: ``size_mb`` -> ``--size-mb``); the sweep's own (``--ranks``, ``--json``) and those in
    ``leave_out`` (a face's own, as ``%ckpt_bench --static``) left out."""
    argv: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in _NOT_PASSED or name in leave_out or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv.extend([flag] if value is True else [flag, str(value)])
    return argv


def _size_json(json_path: str, size: int) -> str:
    stem, ext = os.path.splitext(json_path)
    return f"{stem}.ranks-{size}{ext or '.json'}"


def run_size(size: int, bench_argv: Sequence[str], json_path: str) -> dict[str, Any]:
    """``nbckpt bench`` on ``size`` local ranks under torchrun; its JSON document."""
    launch: RankLaunch | None = None

    def show(line: str) -> None:
        sys.stderr.write(line)
        if _seam is not None and launch is not None:
            _seam(line, launch.proc)

    try:
        with deferred_interrupt():  # a Ctrl-C raised once ``launch`` is set, and so ended below
            launch = RankLaunch(size, bench_argv, json_path)
        code = launch.stream(show)
        if code != 0:
            raise CheckpointError(launch.failure(code))
    finally:
        if launch is not None and launch.end():  # Ctrl-C again as the ranks ended: none is left
            raise KeyboardInterrupt
    with open(json_path, encoding="utf-8") as file:
        document: dict[str, Any] = json.load(file)
    return document


def scaling_rows(documents: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per size and strategy that writes: the job's figures beside the concurrent floor."""
    rows = []
    for document in documents:
        job = document.get("job", {})
        floor = _number(job.get("floors", {}).get("concurrent_write_gbs"))
        for summary in job.get("strategies", []):
            if not summary.get("checkpoints"):
                continue  # the baseline, or a strategy that wrote nothing
            rate = _number(summary.get("aggregate_write_gbs"))
            rows.append(
                {
                    "ranks": int(job.get("world_size", 0)),
                    "hosts": len(job.get("hosts", {})),
                    "strategy": summary["strategy"],
                    "aggregate_write_gbs": rate,
                    "concurrent_floor_gbs": floor,
                    "vs_floor": rate / floor if floor > 0 and not math.isnan(rate) else math.nan,
                    "stall_median_s": _number(summary["stall_s"].get("median")),
                    "stall_p99_s": _number(summary["stall_s"].get("p99")),
                    "overhead_pct": _number(summary.get("overhead_pct")),
                    "time_to_durable_s": _number(summary.get("time_to_durable_s")),
                }
            )
    return rows


def scaling_document(
    sizes: Sequence[int],
    bench_argv: Sequence[str],
    documents: Sequence[Mapping[str, Any]],
    files: Sequence[str],
) -> dict[str, Any]:
    """The sweep's JSON::

    {"schema": "nbckpt.bench.scaling/1", "sizes": [1, 2, 4],
     "options": ["--size-mb", "64", ...],          # passed to every size's nbckpt bench
     "scaling": [{"ranks": 2, "hosts": 1, "strategy": "nbckpt-async",
                  "aggregate_write_gbs": ..., "concurrent_floor_gbs": ..., "vs_floor": ...,
                  "stall_median_s": ..., "stall_p99_s": ...,  # over ranks
                  "overhead_pct": ...,                       # at the slowest rank
                  "time_to_durable_s": ...}, ...],          # per size and strategy
     "runs": [{"ranks": 1, "json": "out.ranks-1.json", "document": {<nbckpt.bench/3>}}, ...]}
    """
    return {
        "schema": SCALING_SCHEMA,
        "sizes": list(sizes),
        "options": list(bench_argv),
        "scaling": scaling_rows(documents),
        "runs": [
            {"ranks": size, "json": path, "document": document}
            for size, path, document in zip(sizes, files, documents, strict=True)
        ],
    }


def scaling_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per size and strategy, the floor beside each."""
    head = (
        f"{'ranks':>5} {'strategy':<20} {'aggregate GB/s':>14} {'floor GB/s':>10} {'x floor':>7} "
        f"{'stall median s':>14} {'stall p99 s':>11} {'overhead %':>10}"
    )
    lines = [head]
    for row in rows:
        lines.append(
            f"{row['ranks']:>5} {row['strategy']:<20} {row['aggregate_write_gbs']:>14.3f} "
            f"{row['concurrent_floor_gbs']:>10.3f} {row['vs_floor']:>7.2f} "
            f"{row['stall_median_s']:>14.4f} {row['stall_p99_s']:>11.4f} "
            f"{row['overhead_pct']:>10.1f}"
        )
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """``nbckpt bench --ranks ...``: every size in turn, then the scaling document (written to
    ``args.json`` if given, each size's beside it as ``OUT.ranks-N.json``; else in a folder
    removed after)."""
    sizes = parse_ranks(args.ranks)
    checked_bench(args)  # here, once: each size's ranks would refuse a bad option only after torchrun started
    bench_argv = passthrough(args)
    # The sweep's, not its ranks': each rank would make it, and remove it as it ends if it made it
    # itself, while the others may still write there.
    with run_target(args.dir, "--dir"), tempfile.TemporaryDirectory(prefix="nbckpt-sweep-") as scratch:
        base = args.json if args.json is not None else os.path.join(scratch, "bench.json")
        files = [_size_json(base, size) for size in sizes]
        documents = []
        for size, path in zip(sizes, files, strict=True):
            if say is not None:
                say(f"--- {size} rank(s): torchrun --nproc-per-node {size}")
            documents.append(run_size(size, bench_argv, path))
        document = scaling_document(
            sizes, bench_argv, documents, files if args.json is not None else [""] * len(sizes)
        )
    return document


def sweep(
    ranks: Sequence[int],
    directory: str,
    *,
    json_path: str | None = None,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> list[Comparison]:
    """``nbckpt bench --ranks`` from Python: the bench under torchrun on each of ``ranks`` local
    ranks in turn, checkpoints in ``directory``, and each size's comparison (with its ``job``:
    :func:`nbckpt.analysis.scaling_table` draws the curve of them). ``options`` are the bench's
    own (``size_mb=8``, ``strategies="dcp-sync,nbckpt-async"``, ``steps``, ``every``,
    ``repeats``, ``threads``, ``no_warmup``...; ``quiet`` by default); ``json_path`` keeps the
    sweep's JSON there, each size's beside it. Ctrl-C ends every rank it started."""
    parser = argparse.ArgumentParser(prog="nbckpt bench", add_help=False)
    add_bench_arguments(parser)
    args = parser.parse_args([])
    unknown = sorted(set(options) - set(vars(args)) | set(options) & (_NOT_PASSED | {"dir"}))
    if unknown:
        raise ConfigError(
            f"sweep() takes no option {', '.join(unknown)} (the bench's options: see nbckpt bench -h)"
        )
    values = {"quiet": True, **options}
    if isinstance(values.get("strategies"), (list, tuple)):
        values["strategies"] = ",".join(values["strategies"])
    sizes = parse_ranks(ranks, "ranks")  # named as sweep() names it, not as --ranks
    vars(args).update(values, dir=directory, json=json_path, ranks=",".join(str(size) for size in sizes))
    if json_path is not None:
        check_json_path(json_path)
    document = run_sweep(args, progress)
    if json_path is not None:
        write_document(document, json_path)
    return [Comparison.from_dict(run["document"]) for run in document["runs"]]
