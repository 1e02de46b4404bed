"""The IPython test shell with ``%load_ext nbckpt`` and a small model and optimizer in it; a real
kernel of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.kernel import RealKernel
from IPython.core.interactiveshell import InteractiveShell
from IPython.testing.globalipapp import get_ipython


@pytest.fixture(scope="session")
def test_shell() -> InteractiveShell:
    shell = get_ipython()  # starts IPython's test shell; returns None once it is running
    return shell if shell is not None else InteractiveShell.instance()


@pytest.fixture
def ip(
    test_shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[InteractiveShell]:
    monkeypatch.setenv("NBCKPT_DIR", str(tmp_path / "default"))
    shell = test_shell
    shell.run_line_magic("load_ext", "nbckpt")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    shell.user_ns.update(model=model, opt=opt, epoch=3, train=lambda: None)
    yield shell
    shell.run_line_magic("unload_ext", "nbckpt")
    for name in ("model", "opt", "epoch", "train", "h"):
        shell.user_ns.pop(name, None)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[RealKernel]:
    """A real python3 kernel in ``tmp_path``, one torch thread, ``NBCKPT_DIR`` there."""
    started = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1", "NBCKPT_DIR": str(tmp_path / "k")})
    try:
        yield started
    finally:
        started.close()
