"""Data-parallel training with async nbckpt checkpoints on every rank (notebook 05 runs it).

    torchrun --nproc_per_node 2 ddp_train.py --dir DIR --out OUT [--steps 12] [--every 3]

Uses gloo on CPU and NCCL on GPUs. Every rank creates the Checkpointer, saves its
shards asynchronously and restores them at the end into a fresh model, checking every
tensor. Each rank writes its timeline to OUT/timeline-rank<R>.csv; rank 0 writes
OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nbckpt import Checkpointer


def build(width: int, device: torch.device, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def tensors(state: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict, by dotted key."""
    found: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            found[name] = value.detach().clone()
        elif isinstance(value, dict):
            found.update(tensors(value, f"{name}."))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory (shared by the ranks)")
    parser.add_argument("--out", required=True, help="folder for timelines and the summary")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    model, opt = build(args.width, device, seed=0)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    state = {"model": model, "optim": opt}

    ckpt = Checkpointer(args.dir, mode="async", keep=2)
    torch.manual_seed(1 + rank)  # each rank sees its own batches
    for step in range(1, args.steps + 1):
        begin = time.perf_counter_ns()  # the clock the timeline uses
        x = torch.randn(32, args.width, device=device)
        loss = (ddp(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        ckpt.timeline.record("step", begin, step=step)
        if step % args.every == 0:
            ckpt.save(state, step=step)
    ckpt.wait()
    expected = tensors({"model": model.state_dict(), "optim": opt.state_dict()})

    fresh_model, fresh_opt = build(args.width, device, seed=123)
    restored = ckpt.restore({"model": fresh_model, "optim": fresh_opt})
    got = tensors({"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()})
    equal = sorted(expected) == sorted(got) and all(
        torch.equal(expected[k], got[k]) for k in expected
    )
    ok = torch.tensor([int(equal)], device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    ckpt.close()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt.timeline.to_pandas().to_csv(out / f"timeline-rank{rank}.csv", index=False)
    if rank == 0:
        summary = {
            "world_size": world,
            "backend": dist.get_backend(),
            "device": str(device.type),
            "steps": args.steps,
            "checkpoints": [r.step for r in ckpt.records],
            "restored_step": restored,
            "tensors_checked": len(expected),
            "all_ranks_equal": bool(ok.item()),
            "stall_ms": [round(r.stall_s * 1e3, 3) for r in ckpt.records],
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
