"""Incremental saves (issue 32): an adapter fine-tune of a frozen GPT; bytes written, stall, restore.

    .venv/bin/python benchmarks/incremental.py --json data/results/incremental-cpu.json
    .venv/bin/python benchmarks/incremental.py --full --json data/results/incremental-full-cpu.json
    .venv/bin/python benchmarks/incremental.py --quick     # the tiny preset, 2 repeats (checks the script)
    .venv/bin/python benchmarks/incremental.py --ranks 2   # 2 ranks only (default: one process, then 2)
    .venv/bin/python benchmarks/incremental.py --device cuda --ranks 1   # on a GPU (device_check.sh)

Method. The bench's fine-tuning workload (``nbckpt bench --finetune``): its GPT (``--preset``,
default ``small``: 6 layers x 512, ~25M parameters) frozen, and each block's two feed-forward
layers given rank-``--rank`` adapters (LoRA's ``B @ A`` added to the frozen layer's output),
trained with AdamW. It runs in one process, then on 2 ranks (``--ranks 1,2``: torchrun, gloo,
each rank its own fine-tune under keys of its own, so each rank writes its own shards). Every
strategy runs ``--saves`` saves, one after each training step, and the first is left out (it
writes everything for every strategy): the figures are the steady state. Strategies,
interleaved in a new random order each repeat (the same order on every rank):

- ``torch.save``: the whole state (model and optimizer) to one file (a file per rank), fsynced;
- ``dcp.save``: the whole state with ``torch.distributed.checkpoint.save``;
- ``nbckpt``: ``Checkpointer(mode="async")``, the whole state each save;
- ``nbckpt incremental``: the same with ``incremental=True``;
- ``nbckpt adapters only``: the adapters and their optimizer state only (what a partial,
  PEFT-style save writes; the reference the issue sets for the stall and the bytes).

With ``--full`` every parameter is trained (no adapters): what ``incremental=True`` costs where
nothing stays the same (its reference is then ``nbckpt``). "stall" is the time ``save`` blocks
the training loop (on 2 ranks the slower rank's, save by save); "written" the bytes each save
puts in new files (nbckpt's ``SaveRecord.bytes_written``; for torch and DCP the files' sizes;
on 2 ranks both ranks' together); "restore" the time to restore the last step (nbckpt's
strategies; the slower rank's): with ``incremental`` most of its bytes were written by the
first save, into files the later steps share, against ``nbckpt``'s step written whole. The
checks are ratios taken repeat by repeat (each repeat's mean per save), with 95 % t-intervals
over the repeats. The defaults (4 repeats of 5 saves, one process then 2 ranks) are sized to
take a few minutes on a quiet 2-core machine (the quick run: 62 s under load 12); the script
prints its time. On a shared machine the figures are under load: say so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _output import finish, parser
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nbckpt import Checkpointer
from nbckpt.bench._internal import PRESETS, plain_state, t_interval
from nbckpt.bench._launch import torchrun_local
from nbckpt.bench._workloads import gpt

STRATEGIES = ("torch.save", "dcp.save", "nbckpt", "nbckpt incremental", "nbckpt adapters only")
#: (metric, strategy, reference, target): the issue's checks of an adapter fine-tune, each a
#: ratio of the strategy's figure to the reference's, at most the target.
CHECKS = (
    ("stall_s", "nbckpt incremental", "nbckpt adapters only", 1.2),
    ("written", "nbckpt incremental", "nbckpt adapters only", 1.10),
    ("restore_s", "nbckpt incremental", "nbckpt", 1.1),
)
#: Where nothing is frozen (``--full``): bytes within 1 % of today's, the stall and restore too.
FULL_CHECKS = (
    ("stall_s", "nbckpt incremental", "nbckpt", 1.0),
    ("written", "nbckpt incremental", "nbckpt", 1.01),
    ("restore_s", "nbckpt incremental", "nbckpt", 1.1),
)


class FineTune:
    """The bench's fine-tuning workload (``gpt(preset, finetune=True)``: the GPT frozen, adapters
    on every feed-forward layer, trained with AdamW), or with ``full`` the GPT fully trained; on
    several ranks each rank's under a key of its own (``rank<r>``)."""

    def __init__(
        self, preset: str, rank: int, full: bool = False, owner: int | None = None, device: str = "cpu"
    ) -> None:
        self.workload = gpt(preset, device, finetune=not full, adapter_rank=rank, seed=owner or 0)
        self.workload.build()
        self.trained = self.workload.trained()
        self.owner = owner

    def train_step(self) -> None:
        self.workload.train_step()

    def _own(self, state: dict[str, Any]) -> dict[str, Any]:
        return state if self.owner is None else {f"rank{self.owner}": state}

    def state(self) -> dict[str, Any]:
        return self._own(self.workload.state())

    def adapters(self) -> dict[str, Any]:
        state = self.workload.state()
        named = {k: v for k, v in state["model"].named_parameters() if v.requires_grad}
        return self._own({**state, "model": named})

    def plain(self) -> dict[str, Any]:
        return plain_state(self.state())


class Group:
    """This process's part of the run: rank 0 of 1, or one of the ranks of torchrun."""

    def __init__(self) -> None:
        self.several = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.several else 0

    def barrier(self) -> None:
        if self.several:
            dist.barrier()


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _save(strategy: str, tune: FineTune, target: Path, ckpt: Checkpointer | None, index: int) -> Any:
    """One save of ``strategy``; its handle (nbckpt's) or None."""
    if strategy == "torch.save":
        with open(target, "wb") as stream:
            torch.save(tune.plain(), stream)
            stream.flush()
            os.fsync(stream.fileno())
        return None
    if strategy == "dcp.save":
        dcp_save(tune.plain(), checkpoint_id=str(target))
        return None
    assert ckpt is not None
    state = tune.adapters() if strategy == "nbckpt adapters only" else tune.state()
    return ckpt.save(state, step=index)


def run_strategy(strategy: str, tune: FineTune, saves: int, directory: Path, group: Group) -> dict[str, Any]:
    """``saves`` saves after a training step each: this rank's stall and bytes of each save (the
    first left out), and for nbckpt's strategies the restore time of the last step."""
    if group.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    group.barrier()
    stalls, written = [], []
    ckpt = None
    if strategy.startswith("nbckpt"):
        ckpt = Checkpointer(directory, mode="async", incremental=strategy == "nbckpt incremental")
    for index in range(saves):
        tune.train_step()
        own = f"-rank{group.rank}" if strategy == "torch.save" and group.several else ""
        target = directory / f"step-{index}{own}"
        began = time.perf_counter()
        handle = _save(strategy, tune, target, ckpt, index)
        stall = time.perf_counter() - began
        size = handle.wait().bytes_written if handle is not None else _size(target)
        if index:
            stalls.append(stall)
            written.append(size if strategy != "dcp.save" or group.rank == 0 else 0)  # DCP's: a folder
    restore_s = float("nan")
    if ckpt is not None:
        state = tune.adapters() if strategy == "nbckpt adapters only" else tune.state()
        began = time.perf_counter()
        ckpt.restore(state)  # into the live objects: the same copies as into fresh ones
        restore_s = time.perf_counter() - began
        ckpt.close()
    group.barrier()  # no rank removes the folder while another still reads it
    return {"stalls": stalls, "written": written, "restore_s": restore_s}


def measure(args: argparse.Namespace, group: Group) -> dict[str, list[dict[str, Any]]]:
    """This rank's figures: each strategy's, every repeat, the strategies interleaved."""
    owner = group.rank if group.several else None
    tune = FineTune(args.preset, args.rank, full=args.full, owner=owner, device=args.device)
    strategies = STRATEGIES[:-1] if args.full else STRATEGIES  # all of it is trained: no adapters
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    order = list(strategies)
    directory = Path(args.dir) / "incremental"
    for repeat in range(args.repeats):
        random.Random(repeat).shuffle(order)
        for strategy in order:
            runs[strategy].append(run_strategy(strategy, tune, args.saves, directory, group))
    if group.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return runs


def merge(per_rank: Sequence[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, float]]]:
    """Each repeat's figures over the ranks: save by save the slower rank's stall and both
    ranks' bytes (then their mean per save), and the slower rank's restore."""
    merged: dict[str, list[dict[str, float]]] = {}
    for strategy in per_rank[0]:
        merged[strategy] = []
        for repeat in zip(*(runs[strategy] for runs in per_rank), strict=True):
            stalls = [max(each) for each in zip(*(r["stalls"] for r in repeat), strict=True)]
            written = [sum(each) for each in zip(*(r["written"] for r in repeat), strict=True)]
            restore = max(r["restore_s"] for r in repeat)
            merged[strategy].append(
                {
                    "stall_s": statistics.fmean(stalls),
                    "written": statistics.fmean(written),
                    "restore_s": restore,
                }
            )
    return merged


def checks(runs: dict[str, list[dict[str, float]]], full: bool) -> dict[str, dict[str, Any]]:
    """The issue's ratios, repeat by repeat, with their interval and whether the mean meets the target."""
    out = {}
    for metric, strategy, reference, target in FULL_CHECKS if full else CHECKS:
        ratios = [a[metric] / b[metric] for a, b in zip(runs[strategy], runs[reference], strict=True)]
        mean, lo, hi = t_interval(ratios)
        out[f"{strategy} / {reference}: {metric}"] = {
            "ratio": [mean, lo, hi],
            "target": target,
            "met": mean <= target,
        }
    return out


def report(label: str, runs: dict[str, list[dict[str, float]]], full: bool) -> dict[str, Any]:
    """Print the table and checks of one world size; the JSON part for it."""
    table = {
        strategy: {key: t_interval([r[key] for r in results]) for key in ("stall_s", "written", "restore_s")}
        for strategy, results in runs.items()
    }
    print(f"{label}:")
    print(f"  {'strategy':24} {'stall ms':>22} {'written MB / save':>24} {'restore ms':>10}")
    for strategy, row in table.items():
        stall, wrote, restore = row["stall_s"], row["written"], row["restore_s"]
        print(
            f"  {strategy:24} {stall[0] * 1e3:7.1f} [{stall[1] * 1e3:6.1f}, {stall[2] * 1e3:6.1f}]"
            f" {wrote[0] / 1e6:8.2f} [{wrote[1] / 1e6:6.2f}, {wrote[2] / 1e6:6.2f}] {restore[0] * 1e3:10.1f}"
        )
    found = checks(runs, full)
    for name, check in found.items():
        mean, lo, hi = check["ratio"]
        verdict = "met" if check["met"] else "NOT met"
        print(f"  {name:56} {mean:5.2f} [{lo:5.2f}, {hi:5.2f}]  target <= {check['target']}: {verdict}")
    return {"results": table, "checks": found, "runs": runs}


def on_ranks(world: int, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """This script's ``--worker`` on ``world`` ranks under torchrun; their figures merged."""
    with tempfile.TemporaryDirectory(prefix="nbckpt-incr-") as out:
        command = [*torchrun_local(world), __file__, "--worker", out, *_passed(args)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0:
            raise SystemExit(f"{world} ranks failed:\n{done.stderr[-4000:]}")
        per_rank = [json.loads(Path(out, f"rank{rank}.json").read_text()) for rank in range(world)]
    return merge(per_rank)


def _passed(args: argparse.Namespace) -> list[str]:
    """The options a worker needs, as given (``--quick`` already applied)."""
    passed = ["--preset", args.preset, "--rank", str(args.rank), "--repeats", str(args.repeats)]
    passed += ["--saves", str(args.saves), "--dir", args.dir, "--device", args.device]
    return passed + (["--full"] if args.full else [])


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.preset, args.repeats, args.saves = "tiny", 2, 3
    began = time.perf_counter()
    worlds = [int(w) for w in args.ranks.split(",")]
    tune = FineTune(args.preset, args.rank, full=args.full, device=args.device)
    trained = sum(p.nbytes for p in tune.trained)
    total = sum(t.nbytes for t in tune.state()["model"].state_dict().values())
    del tune
    what = "fully trained" if args.full else f"frozen, rank-{args.rank} adapters"
    print(f"gpt-{args.preset} {what}: model {total / 1e6:.1f} MB, trained {trained / 1e6:.2f} MB (per rank)")
    measured: dict[str, Any] = {}
    for world in worlds:
        runs = merge([measure(args, Group())]) if world == 1 else on_ranks(world, args)
        label = "one process" if world == 1 else f"{world} ranks"
        measured[label] = report(label, runs, args.full)
    elapsed = time.perf_counter() - began
    print(f"{elapsed:.0f} s in all")
    return {
        "preset": args.preset,
        "device": args.device,
        "rank": args.rank,
        "full": args.full,
        "repeats": args.repeats,
        "saves": args.saves,
        "model_bytes": total,
        "trained_bytes": trained,
        "elapsed_s": elapsed,
        **measured,
    }


def worker(args: argparse.Namespace) -> None:
    """One rank under torchrun: its own fine-tune, every strategy; its figures to ``--worker``'s folder."""
    dist.init_process_group("gloo")
    try:
        group = Group()
        runs = measure(args, group)
        Path(args.worker, f"rank{group.rank}.json").write_text(json.dumps(runs))
    finally:
        dist.destroy_process_group()


def options() -> argparse.ArgumentParser:
    """The benchmark's options (scripts/device_check.py parses them too)."""
    options = parser(__doc__, repeats=4, directory="data/bench/incremental", quick="tiny preset, 2 repeats")
    options.add_argument("--preset", default="small", choices=sorted(PRESETS))
    options.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    options.add_argument("--full", action="store_true", help="a full fine-tune: every parameter trained")
    options.add_argument(
        "--saves", type=int, default=5, help="saves per strategy and repeat (the first left out)"
    )
    options.add_argument("--ranks", default="1,2", help="world sizes, in order (default: %(default)s)")
    options.add_argument("--timeout", type=float, default=900.0, help="per torchrun, seconds")
    options.add_argument(
        "--device", default="cpu", choices=("cpu", "cuda"), help="where the model and its state live"
    )
    options.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return options


def main(argv: list[str] | None = None) -> None:
    args = options().parse_args(argv)
    if args.worker is not None:
        worker(args)
        return
    finish(run, args)


if __name__ == "__main__":
    main()
