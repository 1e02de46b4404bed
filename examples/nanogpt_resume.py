"""A nanoGPT-style training loop that resumes exactly after SIGKILL, with nbckpt.

Run it, kill it (Ctrl-C, ``kill -9``, a lost node) and run it again with ``--init_from resume``:
the losses after the resume are the ones an uninterrupted run prints, bit for bit::

    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40
    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40 --kill_at 25
    python examples/nanogpt_resume.py --out_dir out-tiny --max_iters 40 --init_from resume

What exact resume takes, beyond the model and optimizer:

- the RNG states (``capture_rng=True``): dropout and the next batch draw from them;
- the batch already drawn: like nanoGPT, this loop fetches the next batch right after the
  forward pass, so at the save point the next batch is already in ``X, Y``, drawn from the RNG
  state *before* the one saved. Without it a resumed run draws a different batch and every
  later loss differs; with it, they are all equal;
- the iteration counter (the learning-rate schedule is a function of it).

The model's shape is read back before the model exists with
``ckpt.load(map_location="meta")["model_args"]``: values only, no tensor data read.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

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


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out_dir", default="out-tiny")
    p.add_argument("--init_from", choices=["scratch", "resume"], default="scratch")
    p.add_argument("--max_iters", type=int, default=40)
    p.add_argument("--ckpt_every", type=int, default=5)
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


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    torch.manual_seed(args.seed)
    # keep: the disk holds `keep` checkpoints; capture_rng: dropout and batches draw from the RNGs
    ckpt = Checkpointer(args.out_dir, mode="async", keep=args.keep, capture_rng=True)
    data = corpus(GPTConfig.vocab_size)

    def get_batch(block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - block_size - 1, (args.batch_size,))
        x = torch.stack([data[i : i + block_size] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block_size] for i in ix])
        return x, y

    iter_num = resumed_at = 0
    if args.init_from == "resume":
        # The model's shape comes from the checkpoint, before the model exists: values only.
        model_args = ckpt.load(map_location="meta")["model_args"]
        cfg = GPTConfig(**model_args)
    else:
        cfg = GPTConfig()
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    if args.init_from == "resume":
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0, "batch": {}}
        step = ckpt.restore(state)  # newest intact checkpoint; sets the RNGs back too
        iter_num = resumed_at = state["iter_num"]
        X, Y = state["batch"]["x"], state["batch"]["y"]
        print(f"resumed from iter {iter_num} (step {step})", flush=True)
    else:
        X, Y = get_batch(cfg.block_size)  # fetch the very first batch
        ckpt.warmup(_state(model, optimizer, cfg, iter_num, X, Y, args))  # buffers before training
    pending: list[SaveHandle] = []

    while True:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num, args)
        if iter_num > resumed_at and iter_num % args.ckpt_every == 0:
            # X, Y already hold this iteration's batch: it is saved with everything else.
            pending.append(ckpt.save(_state(model, optimizer, cfg, iter_num, X, Y, args), step=iter_num))
            if iter_num == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        loss = model(X, Y)
        X, Y = get_batch(cfg.block_size)  # prefetch the next batch, as nanoGPT does
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"iter {iter_num} loss {loss.item()!r}", flush=True)
        for handle in [h for h in pending if h.done()]:
            pending.remove(handle)
            if handle.error is None:
                print(f"committed {handle.step}", flush=True)
        iter_num += 1
        if iter_num >= args.max_iters:
            break
    ckpt.close()  # waits for the last write; raises if any failed


def _state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: GPTConfig,
    iter_num: int,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    return {
        "model": model,
        "optimizer": optimizer,
        "model_args": asdict(cfg),
        "iter_num": iter_num,
        "batch": {"x": x, "y": y},
        "config": args,  # an argparse.Namespace is stored as its values
    }


if __name__ == "__main__":
    main()
