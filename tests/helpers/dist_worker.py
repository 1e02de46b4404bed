"""One rank of the torchrun test: async saves on every rank, then restore and compare.

torchrun --standalone --nproc_per_node 2 tests/helpers/dist_worker.py DIR RESULTS

Each rank writes its findings to RESULTS/rank<N>.json: the ranks share one stdout pipe, where
their lines can interleave.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from nbckpt import Checkpointer


def main(directory: str, results: str) -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # replicated parameters, as after DDP's broadcast
    model = torch.nn.Linear(64, 32)
    optim = torch.optim.AdamW(model.parameters())
    shard = torch.full((1000,), float(rank))  # per-rank state under a per-rank key
    with Checkpointer(directory, keep=2) as ckpt:
        for step in range(1, 4):
            model(torch.randn(4, 64)).sum().backward()
            optim.step()
            optim.zero_grad()
            shard.add_(1)
            ckpt.save({"model": model, "optim": optim, f"rank{rank}": shard, "step": step}, step=step)
        ckpt.wait()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        expected_shard = shard.clone()
        fresh = torch.nn.Linear(64, 32)
        fresh_optim = torch.optim.AdamW(fresh.parameters())
        restored_shard = torch.zeros(1000)
        state = {"model": fresh, "optim": fresh_optim, f"rank{rank}": restored_shard, "step": 0}
        step = ckpt.restore(state)
        ok = (
            step == 3
            and state["step"] == 3
            and all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
            and torch.equal(restored_shard, expected_shard)
            and fresh_optim.state_dict()["state"][0]["exp_avg"].shape == (32, 64)
        )
        events = ckpt.timeline.to_pandas()
        manifest = ckpt.manifest(3)
    (Path(results) / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "ok": ok,
                "steps": ckpt.steps(),
                "world_size": manifest["world_size"],
                "files": sorted(manifest["files"]),
                "kinds": sorted(set(events["kind"])),
                "ranks_in_timeline": sorted(set(events["rank"])),
            }
        )
    )
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
