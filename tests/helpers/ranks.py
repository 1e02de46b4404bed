"""Start the ranks of a scenario as plain processes on loopback and collect what each printed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

WORKER = Path(__file__).with_name("rank_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RankProcess:
    """A rank's process, its output going to anonymous files: a pipe nobody reads while the test
    waits for another rank fills up and blocks its writer, maybe inside a collective (a hang)."""

    proc: subprocess.Popen[str]
    out: IO[str]
    err: IO[str]

    @classmethod
    def start(cls, command: list[str], env: dict[str, str]) -> RankProcess:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by kill)
        return cls(subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True), out, err)

    def finish(self, timeout: float) -> tuple[int, str, str]:
        """Wait for the exit (a safety net against a hang, not a limit): code, stdout, stderr."""
        code = self.proc.wait(timeout=timeout)
        self.out.seek(0)
        self.err.seek(0)
        return code, self.out.read(), self.err.read()

    def stacks(self, within: float = 10.0) -> str:
        """Its threads' stacks (each worker has faulthandler dump them on SIGUSR1) and the end of
        its stderr, for the message of a hang; waits until the dump is written."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR1)
            deadline = time.monotonic() + within
            while "most recent call first" not in self._err_text() and time.monotonic() < deadline:
                time.sleep(0.1)  # polling the file the dump goes to, up to a deadline
        return self._err_text()[-6000:]

    def _err_text(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


def finish_all(procs: list[RankProcess], timeout: float) -> list[tuple[int, str, str]]:
    """Each rank's (code, stdout, stderr), in order; a rank that does not end in ``timeout``
    fails the test with every rank's stacks."""
    try:
        return [proc.finish(timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        dumps = "\n".join(f"--- rank {rank}:\n{proc.stacks()}" for rank, proc in enumerate(procs))
        raise AssertionError(f"a rank did not finish in {timeout:g} s; where each was:\n{dumps}") from None


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
        rank: RankProcess.start(
            [sys.executable, str(worker), scenario, str(directory)],
            {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world_size)
    }
    results = {}
    try:
        for rank, (code, out, err) in enumerate(finish_all(list(procs.values()), timeout)):
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results[rank] = (code, json.loads(lines[-1]) if lines else {}, err[-3000:])
    finally:
        for proc in procs.values():
            proc.kill()
    return results


def torchrun_two(*command: str, timeout: float = 250) -> str:
    """``command`` on 2 local gloo ranks under torchrun; its stdout (a failure shows stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *command],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout
