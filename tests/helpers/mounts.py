"""Real filesystems of a set size for tests (mounting needs root; a test skips, saying why, without)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def run_quiet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


def mount_or_skip(*args: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a test filesystem needs root")
    done = run_quiet("mount", *args)
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} failed: {done.stderr.strip()}")


@contextmanager
def small_tmpfs(mountpoint: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``: ``16m``) at ``mountpoint``, made if need be."""
    mountpoint.mkdir(exist_ok=True)
    mount_or_skip("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint))
    try:
        yield mountpoint
    finally:
        run_quiet("umount", "-l", str(mountpoint))
