"""A nanoGPT-style training loop that resumes exactly after SIGKILL, with nbckpt, in one process or
under torchrun.

Run it, kill it (Ctrl-C, ``kill -9``, a lost node) and run it again with ``--init_from resume``:
the losses after the resume are the ones an uninterrupted run prints, bit for bit, on every rank::

    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40
    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40 --kill_at 25
    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40 --init_from resume
    torchrun --standalone --nproc-per-node 2 examples/nanogpt_resume.py --out_dir out-ddp   # the same, DDP

The recipe, against nanoGPT's ``train.py`` (its ``torch.save``/``torch.load`` of ``ckpt.pt``
replaced by a ``Checkpointer``):

- **every rank saves** (not the master process alone): each rank's RNG states and its own
  batch ride along, and the model and optimizer are written once, spread over the ranks;
- **the RNG states** (``capture_rng=True``), per rank: dropout and the next batch draw from them;
- **the batch already drawn**, under a per-rank key (``f"batch.rank{rank}"``): like nanoGPT,
  this loop fetches the next batch right after the forward pass, so at the save point the next
  batch is already in ``X, Y``, drawn from the RNG state *before* the one saved. Without it a
  resumed run draws a different batch and every later loss differs; with it, they are all equal;
- **no second evaluation at the resumed iteration**: nanoGPT evaluates, then saves, at every
  ``eval_interval``; the evaluation draws batches, so running it again right after the resume
  would move the RNG past where the uninterrupted run was;
- the iteration counter (the learning-rate schedule is a function of it).

The model's shape is read back before the model exists with
``ckpt.load(map_location="meta")["model_args"]``: values only, no tensor data read.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from nbckpt import Checkpointer, SaveHandle

__all__ = ["GPT", "GPTConfig", "main"]


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, dropout=cfg.dropout, batch_first=True)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
            nn.GELU(),
            nn.Linear(4 * cfg.n_embd, cfg.n_embd),
            nn.Dropout(cfg.dropout),
        )
        mask = torch.triu(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    mask: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        h = self.ln_1(x)
        attended: torch.Tensor = self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in nanoGPT
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)  # nanoGPT's init: N(0, 1) logits start far off

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def corpus(vocab_size: int, length: int = 50_000) -> torch.Tensor:
    """A token stream with structure to learn (a noisy counter), the same on every run."""
    g = torch.Generator().manual_seed(1337)
    steps = torch.randint(1, 4, (length,), generator=g)
    return (torch.cumsum(steps, 0) % vocab_size).to(torch.long)


def get_lr(it: int, args: argparse.Namespace) -> float:
    """nanoGPT's schedule: linear warmup, then cosine decay; a function of the iteration alone."""
    warmup = max(args.max_iters // 10, 1)
    if it < warmup:
        return float(args.learning_rate * (it + 1) / (warmup + 1))
    ratio = min((it - warmup) / max(args.max_iters - warmup, 1), 1.0)
    return float(args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.learning_rate - args.min_lr))


def log(line: str) -> None:
    """Print ``line`` in one write: under torchrun the ranks share stdout, and two writes can mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="out-tiny")
    p.add_argument("--init_from", choices=["scratch", "resume"], default="scratch")
    p.add_argument("--max_iters", type=int, default=40)
    p.add_argument("--eval_interval", type=int, default=5, help="evaluate, then save, every N iterations")
    p.add_argument("--eval_iters", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--min_lr", type=float, default=3e-4)
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept on disk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kill_at",
        type=int,
        default=None,
        help="SIGKILL this process at that iteration, right after starting that iteration's "
        "save (its write may still be in flight): a crash to resume from",
    )
    return p.parse_args(argv)


def get_batch(data: torch.Tensor, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(data) - block_size - 1, (batch_size,))
    x = torch.stack([data[i : i + block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


@torch.no_grad()
def estimate_loss(model: GPT, data: torch.Tensor, args: argparse.Namespace) -> float:
    model.eval()  # the module itself: DDP's forward would wait for the other ranks
    block = model.cfg.block_size
    losses = [float(model(*get_batch(data, args.batch_size, block))) for _ in range(args.eval_iters)]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # under torchrun, as nanoGPT tells
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if ddp else 0
    torch.manual_seed(args.seed + rank)  # nanoGPT's seed_offset: each rank its own stream
    # keep: the disk holds `keep` checkpoints; capture_rng: dropout and batches draw from the RNGs.
    # Every rank opens it (under torchrun each saves its part, and its RNG states, itself).
    ckpt = Checkpointer(args.out_dir, mode="async", keep=args.keep, capture_rng=True)
    data = corpus(GPTConfig.vocab_size)
    batch_key = f"batch.rank{rank}"  # each rank's own batch: one key per rank

    iter_num, resumed_at = 0, None
    if args.init_from == "resume":
        # The model's shape comes from the checkpoint, before the model exists: values only.
        model_args = ckpt.load(map_location="meta")["model_args"]
        cfg = GPTConfig(**model_args)
    else:
        cfg = GPTConfig()
    raw_model = GPT(cfg)
    optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    if args.init_from == "resume":
        state: dict[str, Any] = {"model": raw_model, "optimizer": optimizer, "iter_num": 0, batch_key: {}}
        step = ckpt.restore(state)  # newest intact checkpoint; sets this rank's RNGs back too
        iter_num = resumed_at = state["iter_num"]
        X, Y = state[batch_key]["x"], state[batch_key]["y"]
        log(f"resumed from iter {iter_num} (step {step})")
    else:
        X, Y = get_batch(data, args.batch_size, cfg.block_size)  # fetch the very first batch
        ckpt.warmup(_state(raw_model, optimizer, cfg, iter_num, batch_key, X, Y, args))  # buffers now
    model: nn.Module = DDP(raw_model) if ddp else raw_model
    tag = f"rank {rank} " if ddp else ""

    pending: list[SaveHandle] = []
    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num, args)
        if iter_num % args.eval_interval == 0 and iter_num != resumed_at:
            # The resumed iteration was evaluated and saved before the interruption.
            if rank == 0:  # nanoGPT's master_process; its evaluation draws from rank 0's RNG
                log(f"step {iter_num}: val loss {estimate_loss(raw_model, data, args):.4f}")
            if iter_num > 0:  # every rank saves, the master's RNG states after its evaluation
                # X, Y already hold this iteration's batch: it is saved with everything else.
                state = _state(raw_model, optimizer, cfg, iter_num, batch_key, X, Y, args)
                pending.append(ckpt.save(state, step=iter_num))
                if iter_num == args.kill_at and rank == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
        loss = model(X, Y)
        X, Y = get_batch(data, args.batch_size, cfg.block_size)  # prefetch the next batch, as nanoGPT does
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log(f"{tag}iter {iter_num} loss {loss.item()!r}")
        pending = _report_commits(pending, tag)
        iter_num += 1
        if iter_num >= args.max_iters:
            break
    ckpt.close()  # waits for the last write; raises if any failed
    if ddp:
        dist.destroy_process_group()


def _report_commits(pending: list[SaveHandle], tag: str) -> list[SaveHandle]:
    """Log the saves that committed since the last iteration; the ones still in flight."""
    done = [handle for handle in pending if handle.done()]
    for handle in done:
        if handle.error is None:
            log(f"{tag}committed {handle.step}")
    return [handle for handle in pending if handle not in done]


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: GPTConfig,
    iter_num: int,
    batch_key: str,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "model": model,
        "optimizer": optimizer,
        "model_args": asdict(cfg),
        "iter_num": iter_num,
        batch_key: {"x": x, "y": y},
        "config": args,  # an argparse.Namespace is stored as its values
    }


if __name__ == "__main__":
    main()
