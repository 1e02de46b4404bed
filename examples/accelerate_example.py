"""An ``accelerate`` training loop with nbckpt: asynchronous saves, exact resume, any number of ranks.

    python examples/accelerate_example.py --dir ckpt-acc --steps 24 --stop_at 13   # saves at 6, 12
    python examples/accelerate_example.py --dir ckpt-acc --steps 24                # resumes at 12
    torchrun --standalone --nproc-per-node 2 examples/accelerate_example.py --dir ckpt-acc-ddp

The losses after the resume are those of an uninterrupted run, bit for bit, on every rank.
Against accelerate's own checkpointing, three lines change: ``AcceleratorCheckpointer(...)``
after ``prepare``, ``ckpt.restore()`` for ``accelerator.load_state(...)`` and ``ckpt.save(step)``
for ``accelerator.save_state(...)``. What exact resume takes besides (as with ``save_state``): a
sampler that shuffles by epoch (``use_seedable_sampler``), a DataLoader with a generator of its
own (otherwise each new iterator draws from the global RNG, and the resumed run's first one
comes at another moment), ``set_epoch`` and ``skip_first_batches`` on resume.
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.nn import functional as F

from nbckpt.integrations.accelerate import AcceleratorCheckpointer

__all__ = ["main"]


def log(line: str) -> None:
    """Print ``line`` in one write: under torchrun the ranks share stdout, and two writes can mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="ckpt-acc")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save_every", type=int, default=6)
    p.add_argument("--stop_at", type=int, default=None, help="stop after this step: an interruption")
    args = p.parse_args(argv)

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0, device_specific=True)  # each rank its own stream: dropout differs per rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    ckpt = AcceleratorCheckpointer(accelerator, args.dir, keep=2)
    step = ckpt.restore()  # every prepared object, the RNGs of this rank; 0 on a fresh start
    log(f"rank {accelerator.process_index} starting at step {step}")
    while step < args.steps:
        epoch, done = divmod(step, len(loader))
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done) if done else loader
        for inputs, targets in batches:
            loss = F.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            log(f"rank {accelerator.process_index} step {step} loss {loss.item()!r}")
            if step % args.save_every == 0:
                ckpt.save(step)  # returns once copied; the write runs in the background
            if step in (args.stop_at, args.steps):
                break
        if step == args.stop_at:
            break
    ckpt.close()  # every save committed, or the error raised


if __name__ == "__main__":
    main()
