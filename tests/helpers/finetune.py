"""A tiny adapter fine-tune for the incremental-save tests (issue 32): a frozen base of two linear
layers, low-rank adapters trained beside it with AdamW, every step a pure function of its number."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

WIDTH, RANK = 256, 2


class Adapted(nn.Module):
    """A frozen base (two linear layers) with low-rank adapters trained beside it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
        self.base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(WIDTH, RANK) * 0.1)
        self.up = nn.Parameter(torch.randn(RANK, WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.down @ self.up


def tune(model: Adapted, optim: torch.optim.Optimizer, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    model(torch.randn(8, WIDTH, generator=generator)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def setup(seed: int = 0) -> tuple[Adapted, torch.optim.Optimizer, dict[str, Any]]:
    model = Adapted(seed)
    optim = torch.optim.AdamW([model.down, model.up], lr=1e-2)
    return model, optim, {"model": model, "optim": optim, "step": 0}


def snapshot(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state, cloned, by the key nbckpt and DCP give it."""
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    for index, values in state["optim"].state_dict()["state"].items():
        out.update({f"optim.state.{index}.{k}": v.clone() for k, v in values.items()})
    return out
