"""The private torch names nbckpt reads, in ``engine/_torch_compat.py`` alone, are those of the
installed torch: a release that renames or reshapes one fails here, naming it and torch's
version, instead of as a refused step or an unnoticed rank far from the cause."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import distributed_c10d

from nbckpt.engine._torch_compat import missing


def test_torch_internals_read_are_those_of_the_installed_torch() -> None:
    assert not missing(), f"{missing()}: update nbckpt/engine/_torch_compat.py"


def test_a_torch_without_one_of_them_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(distributed_c10d, "_get_default_store")  # as a release that renamed it
    assert missing() == [f"torch {torch.__version__}: torch.distributed.distributed_c10d._get_default_store"]
