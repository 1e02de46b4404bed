"""Incremental saves (issue 32): an adapter fine-tune of a frozen GPT, bytes written and stall per save.

    .venv/bin/python benchmarks/incremental.py --json data/results/incremental-cpu.json
    .venv/bin/python benchmarks/incremental.py --full --json data/results/incremental-full-cpu.json
    .venv/bin/python benchmarks/incremental.py --quick     # the tiny preset, 2 repeats (checks the script)

Method. The bench's fine-tuning workload (``nbckpt bench --finetune``): its GPT (``--preset``,
default ``small``: 6 layers x 512, ~25M parameters) frozen, and each block's two feed-forward
layers given rank-``--rank`` adapters (LoRA's ``B @ A`` added to the frozen layer's output),
trained with AdamW. Every strategy runs ``--saves`` saves,
one after each training step, and the first is left out (it writes everything for every strategy):
the figures are the steady state. Strategies, interleaved in a new random order each repeat:

- ``torch.save``: the whole state (model and optimizer) to one file, fsynced;
- ``dcp.save``: the whole state with ``torch.distributed.checkpoint.save``;
- ``nbckpt``: ``Checkpointer(mode="async")``, the whole state each save;
- ``nbckpt incremental``: the same with ``incremental=True``;
- ``nbckpt adapters only``: the adapters and their optimizer state only (what a partial,
  PEFT-style save writes; the reference the issue sets for the stall).

With ``--full`` every parameter is trained (no adapters): what ``incremental=True`` costs where
nothing stays the same. "stall" is the time ``save`` blocks the training loop; "written" the
bytes each save puts in new files (nbckpt's ``SaveRecord.bytes_written``; for torch and DCP the
files' sizes); "restore" the time to restore the last step (nbckpt's strategies only; with
``incremental`` most of its bytes were written by the first save, into files the later steps
share). Intervals are 95 % t-intervals over the repeats (each repeat's mean per save). On a
shared machine the figures are under load: say so.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from _output import finish, parser

from nbckpt import Checkpointer
from nbckpt.bench._internal import PRESETS, plain_state, t_interval
from nbckpt.bench._workloads import gpt

STRATEGIES = ("torch.save", "dcp.save", "nbckpt", "nbckpt incremental", "nbckpt adapters only")


class FineTune:
    """The bench's fine-tuning workload (``gpt(preset, finetune=True)``: the GPT frozen, adapters
    on every feed-forward layer, trained with AdamW), or with ``full`` the GPT fully trained."""

    def __init__(self, preset: str, rank: int, full: bool = False) -> None:
        self.workload = gpt(preset, finetune=not full, adapter_rank=rank)
        self.workload.build()
        self.trained = self.workload.trained()

    def train_step(self) -> None:
        self.workload.train_step()

    def state(self) -> dict[str, Any]:
        return self.workload.state()

    def adapters(self) -> dict[str, Any]:
        named = {k: v for k, v in self.state()["model"].named_parameters() if v.requires_grad}
        return {**self.state(), "model": named}

    def plain(self) -> dict[str, Any]:
        return plain_state(self.state())


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_strategy(strategy: str, tune: FineTune, saves: int, directory: Path) -> dict[str, Any]:
    """``saves`` saves after a training step each: per-save stall and bytes (the first left out),
    and for nbckpt's strategies the restore time of the last step."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stalls, written = [], []
    ckpt = None
    if strategy.startswith("nbckpt"):
        ckpt = Checkpointer(directory, mode="async", incremental=strategy == "nbckpt incremental")
    for index in range(saves):
        tune.train_step()
        target = directory / f"step-{index}"
        began = time.perf_counter()
        if strategy == "torch.save":
            with open(target, "wb") as stream:
                torch.save(tune.plain(), stream)
                stream.flush()
                os.fsync(stream.fileno())
        elif strategy == "dcp.save":
            dcp.save(tune.plain(), checkpoint_id=str(target))
        else:
            assert ckpt is not None
            state = tune.adapters() if strategy == "nbckpt adapters only" else tune.state()
            handle = ckpt.save(state, step=index)
        stall = time.perf_counter() - began
        size = handle.wait().bytes_written if ckpt is not None else _size(target)
        if index:
            stalls.append(stall)
            written.append(size)
    restore_s = float("nan")
    if ckpt is not None:
        state = tune.adapters() if strategy == "nbckpt adapters only" else tune.state()
        began = time.perf_counter()
        ckpt.restore(state)  # into the live objects: the same copies as into fresh ones
        restore_s = time.perf_counter() - began
        ckpt.close()
    return {"stall_s": statistics.fmean(stalls), "written": statistics.fmean(written), "restore_s": restore_s}


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset, repeats, saves = ("tiny", 2, 3) if args.quick else (args.preset, args.repeats, args.saves)
    tune = FineTune(preset, args.rank, full=args.full)
    trained = sum(p.nbytes for p in tune.trained)
    strategies = STRATEGIES[:-1] if args.full else STRATEGIES  # all of it is trained: no adapters
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in strategies}
    order = list(strategies)
    for repeat in range(repeats):
        random.Random(repeat).shuffle(order)
        for strategy in order:
            runs[strategy].append(run_strategy(strategy, tune, saves, Path(args.dir) / "incremental"))
    shutil.rmtree(Path(args.dir) / "incremental", ignore_errors=True)
    table = {
        strategy: {key: t_interval([r[key] for r in results]) for key in ("stall_s", "written", "restore_s")}
        for strategy, results in runs.items()
    }
    total = sum(t.nbytes for t in tune.state()["model"].state_dict().values())
    sizes = f"model {total / 1e6:.1f} MB, trained {trained / 1e6:.2f} MB"
    what = "fully trained" if args.full else f"frozen, rank-{args.rank} adapters"
    print(f"gpt-{preset} {what}: {sizes}")
    print(f"{'strategy':24} {'stall ms':>22} {'written MB / save':>24} {'restore ms':>10}")
    for strategy, row in table.items():
        stall, wrote, restore = row["stall_s"], row["written"], row["restore_s"]
        print(
            f"{strategy:24} {stall[0] * 1e3:7.1f} [{stall[1] * 1e3:6.1f}, {stall[2] * 1e3:6.1f}]"
            f" {wrote[0] / 1e6:8.2f} [{wrote[1] / 1e6:6.2f}, {wrote[2] / 1e6:6.2f}] {restore[0] * 1e3:10.1f}"
        )
    return {
        "preset": preset,
        "rank": args.rank,
        "full": args.full,
        "repeats": repeats,
        "saves": saves,
        "model_bytes": total,
        "trained_bytes": trained,
        "results": table,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> None:
    options = parser(__doc__, repeats=5, directory="data/bench/incremental", quick="tiny preset, 2 repeats")
    options.add_argument("--preset", default="small", choices=sorted(PRESETS))
    options.add_argument("--rank", type=int, default=8, help="the adapters' rank")
    options.add_argument("--full", action="store_true", help="a full fine-tune: every parameter trained")
    options.add_argument(
        "--saves", type=int, default=6, help="saves per strategy and repeat (the first left out)"
    )
    finish(run, options.parse_args(argv))


if __name__ == "__main__":
    main()
