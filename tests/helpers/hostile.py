"""Hostile checkpoints for the reliability tests: a run of two good steps, and edits to step 2 that
pass its own checksums again (a manifest re-signed, files re-hashed), so that what refuses them
is the reader's checks alone, as it is against anyone who can write the files."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine._files import hash_blocks
from nbckpt.engine._manifest import sign
from nbckpt.engine._unpickle import MetadataUnpickler

NUMEL = 4096


def state_of(step: int) -> dict[str, Any]:
    return {
        "w": torch.arange(NUMEL, dtype=torch.float32) * step,
        "b": torch.full((64,), float(step), dtype=torch.float64),
        "step": step,
    }


def blank() -> dict[str, Any]:
    return {"w": torch.zeros(NUMEL), "b": torch.zeros(64, dtype=torch.float64), "step": -1}


def assert_is_step(state: dict[str, Any], step: int) -> None:
    expected = state_of(step)
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
    assert state["step"] == step


def two_steps(directory: Path) -> Path:
    """Steps 1 and 2 of :func:`state_of` in ``directory`` (two data files each, and the values')."""
    with Checkpointer(directory, mode="sync", writer_threads=2) as ckpt:
        for step in (1, 2):
            ckpt.save(state_of(step), step=step)
    return directory


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter: a crash (SIGABRT, SIGSEGV) is its exit code, not ours."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=300
    )


def node(manifest: dict[str, Any], key: str) -> dict[str, Any]:
    """The tree node of top-level ``key`` in a manifest."""
    found: dict[str, Any] = next(n for k, n in manifest["tree"]["items"] if k == key)
    return found


def rewrite_manifest(step_dir: Path, edit: Callable[[dict[str, Any]], None] = lambda m: None) -> None:
    """Re-hash every listed file, apply ``edit`` and re-sign: a manifest that passes its own checksum."""
    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, meta in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        meta.update(size=len(data), blocks=hash_blocks(data))
    edit(manifest)
    path.write_bytes(sign(manifest))


def load_metadata(path: Path) -> Any:
    with open(path, "rb") as stream:
        return MetadataUnpickler(stream).load()


def rewrite_metadata(step_dir: Path, edit: Callable[[Any], None]) -> None:
    """Edit DCP's ``.metadata`` of ``step_dir`` and re-sign the manifest over it."""
    metadata = load_metadata(step_dir / ".metadata")
    edit(metadata)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)


def assert_falls_back(directory: Path, message: str) -> None:
    """restore() warns naming the problem and takes step 1; restore(step=2) refuses."""
    with Checkpointer(directory, mode="sync") as ckpt:
        state = blank()
        with pytest.warns(UserWarning, match=re.escape(message)):
            assert ckpt.restore(state) == 1
        assert_is_step(state, 1)
        with pytest.raises(CheckpointError, match=re.escape(message)) as raised:
            ckpt.restore(blank(), step=2)
        assert "\n" not in str(raised.value)


class RunsCode:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))
