"""A network file system for tests: a SeaweedFS FUSE mount (``weed mount``) over loopback.

    with SeaweedS3(tmp) as server, SeaweedMount(server, tmp / "mnt") as mount:
        Checkpointer(mount.path / "run1")

``weed mount`` talks to the filer of a running ``weed mini`` (the S3 test server) over gRPC,
as an NFS client talks to its server: every file operation is a round trip, metadata is
cached for a while, and the kernel sees ``fuse.seaweedfs``. It is the closest thing on these
machines to an NFS mount of a FlashBlade (there is no kernel NFS client). :func:`unavailable`
says why a mount cannot be made here (no ``/dev/fuse``, not root and no ``fusermount``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from helpers.s3server import SeaweedS3, _die_with_parent

__all__ = ["SeaweedMount", "is_mounted", "unavailable"]

FSTYPE = "fuse.seaweedfs"


def unavailable() -> str | None:
    """Why a FUSE mount cannot be made on this machine, or None when it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available in this kernel or container)"
    if os.geteuid() != 0 and shutil.which("fusermount") is None and shutil.which("fusermount3") is None:
        return "not root and no fusermount: FUSE mounts need one or the other"
    return None


def is_mounted(path: str | os.PathLike[str]) -> bool:
    """Whether a SeaweedFS FUSE file system is mounted exactly at ``path``."""
    point = os.path.realpath(path)
    with open("/proc/mounts", encoding="utf-8") as mounts:
        return any(
            fields[1] == point and fields[2] == FSTYPE
            for fields in (line.split() for line in mounts)
            if len(fields) > 2
        )


class SeaweedMount:
    """``weed mount`` of ``filer_path`` on ``server``'s filer at ``mount_point``."""

    def __init__(
        self, server: SeaweedS3, mount_point: str | os.PathLike[str], filer_path: str = "/ckpt"
    ) -> None:
        self.server, self.path, self.filer_path = server, Path(mount_point), filer_path
        self.process: subprocess.Popen[bytes] | None = None
        self.log = Path(server.directory) / f"mount-{self.path.name}.log"

    def start(self, timeout: float = 30.0) -> None:
        """Mount, and wait until the kernel lists the mount (about 1 s)."""
        self.path.mkdir(parents=True, exist_ok=True)
        ports = self.server.ports
        # host:port.grpcport: the filer's gRPC port is not the default port + 10000 here
        filer = f"127.0.0.1:{ports['filer.port']}.{ports['filer.port.grpc']}"
        command = [
            str(self.server.weed),
            "mount",
            f"-filer={filer}",
            f"-dir={self.path}",
            f"-filer.path={self.filer_path}",
            f"-cacheDir={self.server.directory / 'mount-cache'}",
            f"-localSocket={self.server.directory / f'mount-{self.path.name}.sock'}",
        ]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # a crashed test run leaves no mount daemon behind
            )
        deadline = time.monotonic() + timeout
        while not is_mounted(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed mount did not mount {self.path}; log tail:\n{tail}")
            time.sleep(0.05)  # poll interval while the mount comes up

    def stop(self) -> None:
        """Unmount (fusermount -u, or umount as root), then end ``weed mount``."""
        if is_mounted(self.path):
            unmount = shutil.which("fusermount3") or shutil.which("fusermount")
            command = [unmount, "-u", str(self.path)] if unmount else ["umount", str(self.path)]
            if subprocess.run(command, capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True)  # busy: detach it
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(timeout=10)
            self.process = None

    def __enter__(self) -> SeaweedMount:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
