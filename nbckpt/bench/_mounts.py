"""What holds a checkpoint directory: its mount, read from ``/proc/mounts``, and what kind it is.

The kind (``local``, ``network``, ``memory``) and the NFS options decide much of the probe's
advice: a tmpfs is lost at reboot, an NFS mount without ``nconnect`` is one TCP connection.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .._errors import ConfigError

__all__ = ["MEMORY_FS", "NETWORK_FS", "NFS_KEYS", "MountInfo", "mount_info", "parse_mount_line"]

MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
    "9p", "afs", "orangefs", "pvfs2", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone",
    "fuse.goofys", "fuse.juicefs", "fuse.blobfuse2", "fuse.mountpoint-s3", "fuse.glusterfs",
    "fuse.ceph-fuse", "fuse.weka", "fuse.cvmfs", "fuse.seaweedfs",
})
# NFS mount options that decide checkpoint throughput and failure behaviour.
NFS_KEYS = (
    "vers", "nconnect", "rsize", "wsize", "proto", "hard", "soft", "timeo", "retrans",
    "actimeo", "acregmin", "acregmax", "acdirmin", "acdirmax", "noac", "sec", "addr",
)


def _unescape(field_text: str) -> str:
    r"""Undo /proc/mounts octal escapes (``\040`` space, ``\011`` tab, ``\012`` newline, ``\134``)."""
    out, i = [], 0
    while i < len(field_text):
        octal = field_text[i + 1 : i + 4]
        if field_text[i] == "\\" and len(octal) == 3 and all(c in "01234567" for c in octal):
            out.append(chr(int(octal, 8)))
            i += 4
        else:
            out.append(field_text[i])
            i += 1
    return "".join(out)


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/mounts``: what is mounted where, how."""

    source: str
    mount_point: str
    fstype: str
    options: dict[str, str | None]

    @property
    def kind(self) -> str:
        """``memory`` (lost at reboot), ``network`` or ``local``."""
        if self.fstype in MEMORY_FS:
            return "memory"
        if self.fstype in NETWORK_FS or self.fstype.startswith("nfs"):
            return "network"
        if self.fstype.startswith("fuse.") and ":" in self.source:  # host:path, as sshfs
            return "network"
        return "local"

    @property
    def is_nfs(self) -> bool:
        return self.fstype.startswith("nfs")

    @property
    def nfs_options(self) -> dict[str, str | None]:
        """The NFS options that matter for checkpoints (empty for other filesystems)."""
        if not self.is_nfs:
            return {}
        return {key: self.options[key] for key in NFS_KEYS if key in self.options}

    def option_int(self, key: str) -> int | None:
        value = self.options.get(key)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None


def parse_mount_line(line: str) -> MountInfo:
    """Parse one ``/proc/mounts`` (fstab-format) line; ConfigError if it is not one."""
    fields = line.split()
    if len(fields) < 4:
        raise ConfigError(f"not a mount line (need source, mount point, type, options): {line!r}")
    options: dict[str, str | None] = {}
    for item in _unescape(fields[3]).split(","):
        if item:
            key, sep, value = item.partition("=")
            options[key] = value if sep else None
    return MountInfo(
        source=_unescape(fields[0]),
        mount_point=_unescape(fields[1]),
        fstype=fields[2],
        options=options,
    )


def mount_info(path: str | os.PathLike[str], mounts: str | None = None) -> MountInfo:
    """The mount holding ``path``: the longest mount point that contains it (the last one wins
    when several are stacked on the same point). ``mounts`` is /proc/mounts text (for tests)."""
    if mounts is None:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as stream:
            mounts = stream.read()
    # realpath resolves the links of the part that exists; a target need not exist yet.
    target = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    best: MountInfo | None = None
    for line in mounts.splitlines():
        if not line.strip():
            continue
        entry = parse_mount_line(line)
        point = entry.mount_point.rstrip("/") or "/"
        inside = target == point or target.startswith(point if point == "/" else point + "/")
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = entry
    if best is None:
        raise ConfigError(f"no mount found for {target} in /proc/mounts")
    return best
