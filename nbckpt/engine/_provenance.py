"""Where a checkpoint came from: what a user needs to reproduce the step, recorded in its manifest.

Gathered once per Checkpointer (a git call is milliseconds, but not per save): the versions
of nbckpt, torch and Python, the host, the program (the notebook when Jupyter says which,
else the script), and the git commit of the working directory with whether it had changes.
"""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
from typing import Any

import torch

__all__ = ["provenance"]

_GIT_TIMEOUT_S = 2.0


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):  # no git, or a hung network mount
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _program() -> str:
    # Jupyter Server gives each kernel the notebook's path; in a plain interpreter the script.
    notebook = os.environ.get("JPY_SESSION_NAME")
    if notebook:
        return notebook
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None) or (sys.argv[0] if sys.argv and sys.argv[0] else "")
    return os.path.abspath(path) if path and path != "-c" else "<interactive>"


def provenance() -> dict[str, Any]:
    """The record written into every manifest of a Checkpointer."""
    from .._version import __version__

    record: dict[str, Any] = {
        "nbckpt": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "program": _program(),
        "cwd": os.getcwd(),
    }
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no")
        record["git"] = {"commit": commit, "dirty": bool(status) if status is not None else None}
    return record
