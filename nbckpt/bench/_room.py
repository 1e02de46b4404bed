"""Whether a run's next saves fit where they go: checked before each checkpoint cycle.

A run keeps every checkpoint it saves until it ends (the comparison then removes its folder),
and lanes taking turns keep theirs at once. On a disk, a run that outgrows it ends in ENOSPC
inside a save; on a tmpfs (``/dev/shm``) its files are memory, and it ended with the kernel's
OOM killer taking a process, which under torchrun reads as a wall of text naming no cause.
So before each cycle whose lanes save, the room left is set against what their saves add, and
the run ends with a one-line ConfigError when it cannot take them. Not before the run starts:
a run in the Lab or a notebook often sets more steps than it will train, and is stopped.

The estimate errs low, so that a cycle it refuses cannot fit: the state's bytes (each process's
share, times the processes on this host) for each lane that writes the whole state at every
save; nothing for one that writes only what changed, no manifests, no metadata. A tmpfs also
keeps the headroom a process needs beside its state free, since the kernel kills before memory
runs out. Lanes taking turns wait for their writes as each turn ends: the ranks of a host then
read the same numbers, so they refuse together (a rank of another host that did not is ended
by torchrun). A lane alone trains on as its save writes, and a save still writing is not
counted (what it has yet to write is not known): there the check can come one save late, and
the save that does not fit fails with ENOSPC, a CheckpointError naming the file, as before.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

import psutil

from .._errors import ConfigError
from .._util import format_bytes, is_url
from ._probe import MountInfo, mount_info
from ._strategy import Strategy
from ._workloads import HEADROOM_BYTES

__all__ = ["Room", "kept_bytes"]


def processes_on_host() -> int:
    """How many processes of this job write from this host (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def _whole(lanes: Sequence[tuple[Strategy, int]]) -> list[int]:
    """The state's bytes on this process of each of ``lanes`` that writes it whole at every save."""
    return [share for strategy, share in lanes if strategy.writes_checkpoints and strategy.whole_saves]


def kept_bytes(lanes: Sequence[tuple[Strategy, int]]) -> int:
    """The least one more save of each of ``lanes`` (a strategy, and the bytes of its state on
    this process) adds on this host."""
    return sum(_whole(lanes)) * processes_on_host()


@dataclass(frozen=True)
class Room:
    """The room a run's ``directory`` has left; ``mount`` None for an object store, where nothing
    is checked (its room is the bucket's)."""

    directory: str
    mount: MountInfo | None

    @classmethod
    def of(cls, directory: str) -> Room:
        # the mount holding it: the directory itself is made as the lanes open, if need be
        return cls(directory, None if is_url(directory) else mount_info(directory))

    @property
    def local(self) -> bool:
        return self.mount is not None

    @property
    def kind(self) -> str:
        """The filesystem's type (``tmpfs``, ``ext4``...); '' for an object store."""
        return self.mount.fstype if self.mount is not None else ""

    def left(self) -> tuple[int, str] | None:
        """The bytes it can still take, and what says so; None where its filesystem does not tell
        (a size of 0, as some network and FUSE filesystems report)."""
        usage = shutil.disk_usage(self.directory)
        if usage.total == 0:
            return None
        if self.mount is not None and self.mount.kind == "memory":
            memory = psutil.virtual_memory().available + psutil.swap_memory().free - HEADROOM_BYTES
            if memory < usage.free:
                return memory, (
                    f"it is a {self.kind}, whose files are memory, and {format_bytes(max(memory, 0))} "
                    f"of memory is free beyond the {format_bytes(HEADROOM_BYTES)} a process needs"
                )
        return usage.free, f"it has {format_bytes(usage.free)} free"

    def check(self, lanes: Sequence[tuple[Strategy, int]], done: int, cycles: int) -> None:
        """ConfigError, in one line, when the next save of each of ``lanes`` cannot fit (after
        ``done`` of the run's ``cycles`` checkpoint cycles; the first saves nothing)."""
        if not self.local or done == 0:
            return
        kept, left = kept_bytes(lanes), self.left()
        if left is None or kept <= left[0]:
            return
        whole = len(_whole(lanes))
        processes = processes_on_host()
        raise ConfigError(
            f"{self.directory} cannot hold the run's next saves (after {done} of {cycles} checkpoint "
            f"cycles): {whole} lane(s) saving once more"
            f"{f' on each of {processes} processes of host {platform.node()}' if processes > 1 else ''} "
            f"keep at least {format_bytes(kept)} more there, and {left[1]}; save less often, train "
            "fewer steps, run fewer strategies at once or a smaller state, or write elsewhere"
        )
