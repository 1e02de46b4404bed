"""Start the ranks of a scenario as plain processes on loopback and collect what each printed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("rank_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    scenario: str,
    directory: Path,
    world_size: int = 2,
    timeout: float = 240,
    env: dict[str, str] | None = None,
    worker: Path = WORKER,
) -> dict[int, tuple[int, dict[str, Any], str]]:
    """rank -> (exit code, its JSON line or {}, the end of its stderr)."""
    base = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = {
        rank: subprocess.Popen(
            [sys.executable, str(worker), scenario, str(directory)],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    }
    results = {}
    try:
        for rank, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results[rank] = (proc.returncode, json.loads(lines[-1]) if lines else {}, err[-3000:])
    finally:
        for proc in procs.values():
            proc.kill()
    return results
