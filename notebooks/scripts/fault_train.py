"""A small training job with an async checkpoint after every step (notebook 04 runs it).

    python fault_train.py --dir DIR --steps 30 [--width 512] [--seed 0] [--final FINAL.pt]

When DIR holds a committed checkpoint the job resumes from the newest one, RNG
state included, so a restarted run continues exactly where the saved one was.
``--final`` writes the last model and optimizer state with ``torch.save`` for comparison.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

from nbckpt import Checkpointer


def build(width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer; dropout makes the run depend on the RNG state."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(width, 1),
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, width: int) -> float:
    x = torch.randn(64, width)  # batches come from the global RNG, like a shuffled loader
    loss = (model(x).squeeze(1) - x.mean(dim=1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--final", default=None, help="write the final state here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # the same arithmetic order in every run
    model, opt = build(args.width, args.seed)
    state = {"model": model, "optim": opt}
    with Checkpointer(args.dir, mode="async", keep=3, capture_rng=True) as ckpt:
        start = 0
        if ckpt.latest_step() is not None:
            start = ckpt.restore(state)
            print(f"resumed from step {start}", flush=True)
        for step in range(start + 1, args.steps + 1):
            loss = train_step(model, opt, args.width)
            handle = ckpt.save(state, step=step)
            print(f"step {step} loss {loss:.4f} checkpoint {handle.phase}", flush=True)
        ckpt.wait()
    if args.final:
        final = {"model": model.state_dict(), "optim": opt.state_dict()}
        torch.save(final, Path(args.final))
    print("done", flush=True)


if __name__ == "__main__":
    main()
