"""A small training state with known values per step, and the check that a checkpoint holds it."""

from __future__ import annotations

from typing import Any

import torch

from nbckpt import Checkpointer


def state_of(step: int, numel: int = 1000) -> dict[str, Any]:
    """``w`` is ``arange(numel) + step``: every step's tensor differs, and is known."""
    return {"w": torch.arange(numel, dtype=torch.float32) + step, "step": step}


def assert_holds(ckpt: Checkpointer, step: int, numel: int = 1000) -> None:
    """Restoring ``step`` gives back exactly ``state_of(step, numel)``."""
    state = {"w": torch.zeros(numel), "step": -1}
    assert ckpt.restore(state, step=step) == step
    assert torch.equal(state["w"], state_of(step, numel)["w"]) and state["step"] == step
