"""export and load: a step as one torch.load-able dict; DCP's own load of an optimizer."""

from __future__ import annotations

import argparse
import pathlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import state_dict_loader as dcp

from nbckpt import Checkpointer, ConfigError
from nbckpt.integrations import export, load


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.9))
    for _ in range(3):
        net(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, betas=(0.8, 0.9))
    net(torch.randn(5, 4)).square().mean().backward()
    opt.step()  # creates the state entries a state_dict template needs
    opt.zero_grad()
    return net, opt


def test_export_writes_one_nested_dict_with_values(tmp_path: Path) -> None:
    net, opt = _trained()
    config = argparse.Namespace(lr=0.01, data=pathlib.Path("/data/x"), dtype=torch.bfloat16)
    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        ckpt.save({"model": net, "optim": opt, "iter_num": 3, "config": config}, step=3)
    out = export(tmp_path / "run" / "step-000003", tmp_path / "out.pt")
    # nbckpt wrote this file a line above; Namespace and Path need the full unpickler
    got = torch.load(out, weights_only=False)
    assert got["iter_num"] == 3 and got["config"] == config
    assert all(torch.equal(got["model"][k], v) for k, v in net.state_dict().items())
    assert got["optim"]["param_groups"][0]["betas"] == (0.8, 0.9)
    net2, opt2 = _fresh()
    net2.load_state_dict(got["model"])
    opt2.load_state_dict(got["optim"])  # param_groups included: a plain optimizer load works
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert load(tmp_path / "run" / "step-000003", map_location="meta")["model"]["0.weight"].is_meta


def test_export_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "old.ckpt").write_text('{"format": "nbckpt-pointer/1", "root": "run", "step": 3}\n')
    for source, message in [
        (tmp_path, "not a checkpoint step"),
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "notes.txt", "neither"),
        (tmp_path / "old.ckpt", "pointer file of an earlier nbckpt"),
    ]:
        with pytest.raises(ConfigError, match=message):
            export(source, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_plain_dcp_load_of_an_optimizer(tmp_path: Path) -> None:
    net, opt = _trained()
    opt.param_groups[0]["lr"] = 0.003  # a value the fresh optimizer does not have
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save({"model": net, "optim": opt}, step=1)
    net2, opt2 = _fresh()
    state = {"model": net2.state_dict(), "optim": opt2.state_dict()}
    # param_groups (lr, betas, the parameter ids) are stored as DCP byte items too: DCP's default
    # planner finds every key of the template, no allow_partial_load needed.
    dcp.load(state, checkpoint_id=tmp_path / "step-000001")
    net2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    assert opt2.param_groups[0]["lr"] == 0.003 and opt2.param_groups[0]["betas"] == (0.8, 0.9)
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(opt2.state_dict()["state"][0][key], value)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), net2.parameters(), strict=True))


def test_importing_nbckpt_imports_no_framework() -> None:
    import subprocess
    import sys

    frameworks = ("lightning", "pytorch_lightning", "transformers", "accelerate")
    code = f"import sys, nbckpt, nbckpt.integrations; print([m for m in {frameworks} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
