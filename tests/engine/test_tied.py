"""Tied weights (issue 19, item 6): one tensor under two keys (nanoGPT's ``wte``/``lm_head``) is
staged and written once, read once, and restored still tied; a plain ``dcp.load`` sees both keys."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from nbckpt import Checkpointer


class Tied(nn.Module):
    """An embedding and an output head that share one weight, as GPT-2 and nanoGPT do."""

    def __init__(self, vocab: int = 5000, width: int = 256) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.block = nn.Linear(width, width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.block(self.wte(tokens)))


def data_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.name.endswith(".distcp"))


def test_a_tied_model_is_the_size_of_torch_save_and_restores_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 5000, (2, 8))).square().mean().backward()
    optim.step()
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "state.pt")
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        record = ckpt.save({"model": model, "optim": optim}, step=1).wait()
        manifest = ckpt.manifest(1)
    nbckpt_bytes = data_bytes(Path(record.path))
    torch_bytes = os.path.getsize(tmp_path / "state.pt")
    assert abs(nbckpt_bytes - torch_bytes) <= 0.01 * torch_bytes, (nbckpt_bytes, torch_bytes)
    assert manifest["items"]["model.lm_head.weight"] == manifest["items"]["model.wte.weight"]

    fresh = Tied()
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    with Checkpointer(tmp_path / "run", read_only=True) as ckpt:
        ckpt.restore({"model": fresh, "optim": fresh_optim})
        loaded = ckpt.load(1)
    assert fresh.lm_head.weight is fresh.wte.weight  # still one parameter
    assert torch.equal(fresh.wte.weight, model.wte.weight)
    assert loaded["model"]["lm_head.weight"] is loaded["model"]["wte.weight"]  # read once, shared

    plain = {"model": Tied().state_dict()}
    dcp.load(plain, checkpoint_id=record.path, no_dist=True)
    assert torch.equal(plain["model"]["lm_head.weight"], model.wte.weight)
    assert torch.equal(plain["model"]["wte.weight"], model.wte.weight)


def test_two_keys_for_one_tensor_under_torchrun_are_one_tensor_too(tmp_path: Path) -> None:
    """Tied under several ranks: every rank names the same tensor twice, it is written once."""
    from helpers.ranks import run_ranks

    results = run_ranks("tied", tmp_path / "run")
    for rank, (code, seen, err) in results.items():
        assert code == 0, err
        assert seen["same_items"] and seen["tied_after_restore"] and seen["exact"], (rank, seen)
