"""One rank restoring the checkpoints ``nbckpt bench --fsdp --keep`` kept, under torchrun.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/bench_restore_worker.py \
    BENCH_JSON CHECKPOINT_DIR [finetune] [bench --fsdp --keep --json BENCH_JSON ...]

With a command line after the two paths (and ``finetune``), the same ranks first run it
(``nbckpt``'s own, as a training script that calls the bench would: the group is the script's),
which saves a torchrun's start (about 20 s of the test on a loaded 2-core machine); the restore
reads only the files.

A fresh FSDP2-sharded GPT (the bench's preset, on the same ranks; with ``finetune`` the bench's
``--finetune`` workload: frozen, with adapters) is zeroed, then each kept checkpoint is
restored into it, nbckpt's with ``Checkpointer.restore``, DCP's with
``torch.distributed.checkpoint.load``, torch.save's file of this rank with ``torch.load``, and
every tensor this rank holds is hashed as the bench hashed it when it saved. Prints one JSON
line: per strategy the keys compared and those that differ.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from nbckpt import Checkpointer, cli
from nbckpt.bench import make_workload
from nbckpt.bench._internal import RankWorkload, state_digests
from nbckpt.engine._internal import step_name


def _zero(state: dict[str, Any]) -> None:
    """Every tensor of the model and the optimizer to zero: a restore that misses one shows."""
    with torch.no_grad():
        for value in [
            *state["model"].state_dict().values(),
            *(item for per in state["optim"].state.values() for item in per.values()),
        ]:
            if isinstance(value, (torch.Tensor, DTensor)):
                value.zero_()


def _restore(strategy: str, folder: str, step: int, state: dict[str, Any]) -> None:
    if strategy == "torch-save":  # under FSDP each rank torch.saved its shard into its own folder
        path = os.path.join(folder, f"rank-{dist.get_rank()}", step_name(step) + ".pt")
        saved = torch.load(path, weights_only=False)  # the bench of this test wrote it (DTensors)
        state["model"].load_state_dict(saved["model"])
        state["optim"].load_state_dict(saved["optim"])
        return
    if strategy.startswith("nbckpt"):
        with Checkpointer(folder) as checkpointer:
            checkpointer.restore(state, step=step)
        return
    plain = {"model": state["model"].state_dict(), "optim": state["optim"].state_dict()}
    dcp.load(plain, checkpoint_id=os.path.join(folder, step_name(step)))
    state["model"].load_state_dict(plain["model"])
    state["optim"].load_state_dict(plain["optim"])


def main(bench_json: str, directory: str, *rest: str) -> int:
    finetune = rest[:1] == ("finetune",)
    bench = rest[1:] if finetune else rest
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if bench:
        if cli.main(list(bench)) != 0:
            return 1
        dist.barrier()  # rank 0 has written the JSON
    inner = make_workload("tiny", None, "cpu", finetune=finetune)
    workload = RankWorkload(inner, rank, dist.get_world_size(), sharded=True)
    workload.build()
    kept = json.loads(Path(bench_json).read_text(encoding="utf-8"))["job"]["kept"]
    report: dict[str, Any] = {"rank": rank, "checked": {}, "differ": {}}
    for saved in sorted((row for row in kept if row["rank"] == rank), key=lambda row: row["strategy"]):
        state = {"model": workload.inner.model, "optim": workload.inner.optim}
        _zero(state)
        _restore(saved["strategy"], os.path.join(directory, saved["strategy"]), saved["step"], state)
        got = state_digests(state)
        expected = {key: digest for key, digest in saved["digests"].items() if key.split(".")[0] in state}
        report["checked"][saved["strategy"]] = len(expected)
        report["differ"][saved["strategy"]] = sorted(
            key for key in expected.keys() | got.keys() if expected.get(key) != got.get(key)
        )
    # one write: under PYTHONUNBUFFERED print() writes the text and its newline apart, and the two
    # ranks sharing torchrun's stdout ran their lines into one
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
