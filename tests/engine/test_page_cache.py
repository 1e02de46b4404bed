"""Which checkpoint files a save leaves in the page cache: the newest commit's, not older ones'
(``Saver._uncache``; why in ``_files.drop_cached``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nbckpt import Checkpointer
from nbckpt.bench import mount_info
from nbckpt.engine._files import cached_fraction
from nbckpt.engine._internal import step_name


def _cached(directory: Path, step: int) -> list[float]:
    """The share of each data file of ``step`` in the page cache."""
    names = sorted((directory / step_name(step)).glob("*.distcp"))
    assert names, f"no data files in {directory / step_name(step)}"
    return [cached_fraction(str(name)) or 0.0 for name in names]


@pytest.fixture
def local_disk(tmp_path: Path) -> Path:
    # tmpfs keeps its pages whatever it is told (they are the data): only a disk can show a drop.
    if mount_info(tmp_path).kind != "local":
        pytest.skip(f"{tmp_path} is not on a local disk")
    return tmp_path / "ckpt"


def test_a_commit_drops_the_step_before_from_the_page_cache_and_keeps_its_own(local_disk: Path) -> None:
    state = {"w": torch.rand(1 << 20), "b": torch.rand(1 << 18)}
    with Checkpointer(local_disk) as ckpt:
        ckpt.save(state, 1)
        ckpt.wait()
        assert min(_cached(local_disk, 1)) == 1.0  # the newest: cached, for a rewind to it
        state["w"].add_(1)
        ckpt.save(state, 2)
        ckpt.wait()
        assert max(_cached(local_disk, 1)) < 0.1
        assert min(_cached(local_disk, 2)) == 1.0


def test_a_file_the_new_step_shares_with_the_step_before_stays_cached(local_disk: Path) -> None:
    base = torch.nn.Linear(512, 512).requires_grad_(False)  # a frozen base: written once
    state = {"model": torch.nn.ModuleDict({"base": base, "head": torch.nn.Linear(512, 4)})}
    with Checkpointer(local_disk, incremental=True) as ckpt:
        ckpt.save(state, 1)
        ckpt.wait()
        ckpt.save(state, 2)
        ckpt.wait()
        files = sorted((local_disk / step_name(2)).glob("*.distcp"))
        shared = [name for name in files if os.stat(name).st_nlink == 2]  # step 1's inodes
        assert shared and len(shared) < len(files)
        assert all(cached_fraction(str(name)) == 1.0 for name in shared)
