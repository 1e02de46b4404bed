"""The files nbckpt writes take their mode from the umask, as every other program's do: a
checkpoint's files, and a result or report written whole (``write_atomic``: its temporary file
was ``mkstemp``'s, 0o600 whatever the umask, so other users could not read results and reports)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from nbckpt import Checkpointer
from nbckpt.engine._internal import write_atomic


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_save_and_a_result_have_the_mode_the_umask_gives(tmp_path: Path, umask: int) -> None:
    before = os.umask(umask)
    try:
        with Checkpointer(tmp_path / "ckpt", mode="sync") as ckpt:
            ckpt.save({"x": torch.ones(4), "step": 1}, step=1).wait()
        write_atomic(tmp_path / "result.json", b"{}")
    finally:
        os.umask(before)
    files = {
        str(path.relative_to(tmp_path)): stat.S_IMODE(path.stat().st_mode)
        for path in tmp_path.rglob("*")
        if path.is_file()
    }
    assert "result.json" in files and len(files) >= 4, files
    assert set(files.values()) == {0o644 & ~umask}, files
