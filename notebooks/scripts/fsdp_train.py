"""FSDP2 training with async nbckpt checkpoints of the sharded state (notebook 05 runs it).

    torchrun --nproc_per_node 2 fsdp_train.py --dir DIR --out OUT [--steps 12] [--every 4]
    torchrun --nproc_per_node 3 fsdp_train.py --dir DIR --out OUT --restore-only

gloo on CPU, NCCL on GPUs. Every block of the model, and the model, is ``fully_shard``-ed: each
rank holds a row range of every parameter and of its AdamW state, as DTensors, and
``get_state_dict`` hands them to nbckpt, which writes each rank's shards asynchronously. Rank 0
writes the whole state as one process would hold it (``full_state_dict=True``) to
OUT/full.pt, the reference every restore is compared with. With ``--restore-only`` the ranks
restore the newest step at their own world size instead. Each rank writes its timeline
(OUT/timeline-rank<R>.csv) and the rows of each tensor its shard holds (OUT/rows-rank<R>.json);
rank 0 writes OUT/summary.json (OUT/restore-summary.json with ``--restore-only``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nbckpt import Checkpointer

#: Rows of the embedding: odd, so that two ranks hold uneven shards (129 and 128 rows).
VOCAB = 257


def build(width: int, layers: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer as one process holds them (notebook 05 builds it too)."""
    model = layout(width, layers, seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def layout(width: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(layers)]
    return nn.Sequential(nn.Embedding(VOCAB, width), *blocks, nn.Linear(width, VOCAB))


def sharded(width: int, layers: int, seed: int, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model with every block, and itself, sharded over the ranks; the optimizer made after,
    over the sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = layout(width, layers, seed).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def rows_held(state: dict[str, Any]) -> dict[str, list[int]]:
    """Each sharded tensor of the model: the first row this rank holds, and how many."""
    held = {}
    for key, value in state.items():
        chunk = value.__create_chunk_list__()[0]
        held[key] = [int(chunk.offsets[0]), int(chunk.sizes[0])] if len(chunk.sizes) else [0, 1]
    return held


def full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by the ranks)")
    parser.add_argument("--out", required=True, help="folder for the reference, timelines and summary")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--restore-only", action="store_true", help="restore the newest step at this world size")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, opt = sharded(args.width, args.layers, 0 if not args.restore_only else 99, device)
    ckpt = Checkpointer(args.dir, mode="async", keep=2)
    summary: dict[str, Any] = {"world_size": world, "backend": dist.get_backend()}
    if not args.restore_only:
        torch.manual_seed(1 + rank)  # each rank trains on its own batches
        for step in range(1, args.steps + 1):
            begin = time.perf_counter_ns()  # the clock the timeline uses
            tokens = torch.randint(0, VOCAB, (8, 16), device=device)
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            ckpt.timeline.record("step", begin, step=step)
            if step % args.every == 0:
                msd, osd = get_state_dict(model, opt)  # DTensors: this rank's shard of each
                ckpt.save({"model": msd, "optim": osd, "step": step}, step=step)
        ckpt.wait()
        reference = full(model, opt)
        if rank == 0:
            torch.save(reference, out / "full.pt")
        summary.update(checkpoints=[r.step for r in ckpt.records], stall_ms=[round(r.stall_s * 1e3, 2) for r in ckpt.records])
        model, opt = sharded(args.width, args.layers, 99, device)  # a fresh model restores the newest step
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": 0}
    restored = ckpt.restore(state)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ckpt.close()
    dist.barrier()  # full.pt is written
    now = full(model, opt)
    equal = torch.tensor([int(rank != 0 or same(now, torch.load(out / "full.pt", weights_only=True)))], device=device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    ckpt.timeline.to_pandas().to_csv(out / f"timeline-rank{rank}{'-restore' if args.restore_only else ''}.csv", index=False)
    (out / f"rows-rank{rank}{'-restore' if args.restore_only else ''}.json").write_text(json.dumps(rows_held(msd)))
    if rank == 0:
        summary.update(restored_step=restored, step_value=state["step"], all_ranks_equal=bool(equal.item()))
        name = "restore-summary.json" if args.restore_only else "summary.json"
        (out / name).write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
