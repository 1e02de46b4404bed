"""Measured scaling on one node: ``nbckpt bench --ranks 1,2,4`` launches torchrun itself.

For each rank count the sweep runs ``python -m torch.distributed.run --standalone
--nproc-per-node N -m nbckpt bench ...`` as a child process (the bench's other options passed
through, each size's JSON kept beside the sweep's), one size after the other, and then makes one
table and one JSON of every size: per strategy and rank count the aggregate write GB/s, the
stall's median and p99 over ranks and the job's overhead, beside the concurrent raw-write floor
measured by the same ranks in the same run (:func:`scaling_rows`; schema in
:func:`scaling_document`). From Python (a notebook): :func:`sweep`, the same run, returning each
size's :class:`~._comparison.Comparison`.

No process is left behind: torchrun starts in a session of its own (Ctrl-C reaches the sweep
alone), the sweep notes every process under it while it runs, and whatever way the sweep ends
(a finished size, a rank that died, Ctrl-C, an error) it ends torchrun (which ends its ranks)
and then kills any noted process still running. A rank that dies is named in one line, from
torchrun's own account of the first failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

import psutil

from .._errors import CheckpointError, ConfigError
from ..engine._internal import write_atomic
from ._compare import add_bench_arguments
from ._comparison import Comparison, _json_value
from ._job import _number

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
#: How long torchrun has to end its ranks after SIGTERM before every process left is killed.
TERMINATE_S = 20.0
# The sweep's own options, and argparse's bookkeeping: not passed to the children.
_NOT_PASSED = frozenset({"command", "run", "ranks", "json"})
# torchrun's account of the first failure: "rank : 1 (local_rank: 1)", "exitcode : -9 (pid: 42)".
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)

#: Called with every line a size's ranks print on stderr and torchrun's process: the test-only
#: seam that ends the sweep at a defined point (raise KeyboardInterrupt) or a rank.
_seam: Callable[[str, subprocess.Popen[str]], None] | None = None


def arm_sweep_seam(seam: Callable[[str, subprocess.Popen[str]], None] | None) -> None:
    """Arm (None: disarm) the test-only seam: ``seam(line, torchrun)`` for every stderr line."""
    global _seam
    _seam = seam


def parse_ranks(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``; a one-line ConfigError for anything else."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(size < 1 for size in sizes) or len(set(sizes)) != len(sizes):
        raise ConfigError(
            f"--ranks wants distinct rank counts >= 1 separated by commas (1,2,4), not {text!r}"
        )
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


def passthrough(args: argparse.Namespace) -> list[str]:
    """The bench's options as given, for each size's ``nbckpt bench`` (each option's flag is its
    name: ``size_mb`` -> ``--size-mb``); the sweep's own (``--ranks``, ``--json``) left out."""
    argv: list[str] = []
    for name, value in sorted(vars(args).items()):
        if name in _NOT_PASSED or value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        argv.extend([flag] if value is True else [flag, str(value)])
    return argv


def _size_json(json_path: str, size: int) -> str:
    stem, ext = os.path.splitext(json_path)
    return f"{stem}.ranks-{size}{ext or '.json'}"


def _failure(size: int, code: int, tail: str) -> str:
    """One line: which rank died and how, from torchrun's root cause (else its last line)."""
    root = tail[tail.rfind("Root Cause") :] if "Root Cause" in tail else ""
    rank, exit_code = _ROOT_RANK.search(root), _ROOT_EXIT.search(root)
    if rank is not None:
        how = "" if exit_code is None else f" (exit code {exit_code.group(1)}"
        number = int(exit_code.group(1)) if exit_code is not None else 0
        if number < 0:
            how += f": {signal.Signals(-number).name}" if -number in signal.valid_signals() else ""
        how += ")" if how else ""
        return f"rank {rank.group(1)} of {size} died{how}; torchrun ended the other ranks"
    last = [line for line in tail.splitlines() if line.strip()]
    return f"torchrun with {size} ranks exited with code {code}: {last[-1].strip() if last else 'no output'}"


class _Size:
    """One size's torchrun, its ranks' stderr streamed to ours, every process under it noted."""

    def __init__(self, command: list[str], out: IO[str]) -> None:
        self.proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ}
        )
        self.seen: dict[int, psutil.Process] = {}
        self.tail: deque[str] = deque(maxlen=200)

    def note(self) -> None:
        """Note every process under torchrun now (they are orphaned if torchrun dies first)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)

    def stream(self) -> int:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.note()
            self.tail.append(line)
            sys.stderr.write(line)
            if _seam is not None:
                _seam(line, self.proc)
        return self.proc.wait()

    def end(self) -> None:
        """End torchrun (SIGTERM: it ends its ranks), then kill whatever noted is still running."""
        self.note()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=TERMINATE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = [child for child in self.seen.values() if child.is_running()]
        for child in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()  # psutil checks it is still the same process (no reused pid)
        psutil.wait_procs(left, timeout=TERMINATE_S)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


def run_size(size: int, bench_argv: Sequence[str], json_path: str) -> dict[str, Any]:
    """``nbckpt bench`` on ``size`` local ranks under torchrun; its JSON document."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(size),
        "-m",
        "nbckpt",
        "bench",
        *bench_argv,
        "--json",
        json_path,
    ]
    with tempfile.TemporaryFile("w+") as out:  # rank 0's table: the sweep prints its own
        child = _Size(command, out)
        try:
            code = child.stream()
        finally:
            child.end()
        if code != 0:
            raise CheckpointError(_failure(size, code, "".join(child.tail)))
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
    bench_argv = passthrough(args)
    with tempfile.TemporaryDirectory(prefix="nbckpt-sweep-") as scratch:
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
    vars(args).update(values, dir=directory, json=json_path, ranks=",".join(str(size) for size in ranks))
    if json_path is not None:
        check_json_path(json_path)
    document = run_sweep(args, progress)
    if json_path is not None:
        write_document(document, json_path)
    return [Comparison.from_dict(run["document"]) for run in document["runs"]]
