"""Whether a run's checkpoints fit where they go: checked before its lanes open.

A run keeps every checkpoint it saves until it ends (the comparison then removes its folder),
and lanes taking turns keep theirs at once. On a disk, a run that does not fit ends in ENOSPC
partway through; on a tmpfs (``/dev/shm``) its files are memory, and it ends with the kernel's
OOM killer taking a process, which under torchrun reads as a wall of text naming no cause.
It is checked once the lanes are open, so that what they hold (their buffers, their warm-up
saves) is no longer free. The estimate of what is still to come errs low, so that a run it
refuses cannot fit: the state's bytes (each process's share, times the processes on this host)
per save of each strategy that writes the whole state every time; nothing for one that writes
only what changed, no manifests, no metadata.
"""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Sequence
from typing import Any

import psutil
import torch.distributed as dist

from .._errors import ConfigError
from .._util import format_bytes, is_url
from ._strategy import Strategy

__all__ = ["check_room", "kept_bytes", "refusal"]

#: Filesystems whose files are memory: what they can take is what memory has free.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def processes_on_host() -> int:
    """How many processes of this job write from this host (torchrun's ``LOCAL_WORLD_SIZE``)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def kept_bytes(lanes: Sequence[tuple[Strategy, int]], saves: int) -> int:
    """The least that ``saves`` more saves of each of ``lanes`` (a strategy, and the bytes of
    its state on this process) add on this host."""
    per_process = sum(
        share for strategy, share in lanes if strategy.writes_checkpoints and strategy.whole_saves
    )
    return per_process * saves * processes_on_host()


def filesystem_type(path: str) -> str:
    """The type of the filesystem that holds ``path`` (its deepest mount point); '' if unknown."""
    real, deepest, kind = os.path.realpath(path), "", ""
    for partition in psutil.disk_partitions(all=True):
        mount = partition.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > len(deepest):
            deepest, kind = mount, partition.fstype
    return kind


def room(directory: str) -> tuple[int, str] | None:
    """The bytes ``directory`` can still take, and what says so; None where its filesystem does
    not tell (a size of 0, as some network and FUSE filesystems report)."""
    usage = shutil.disk_usage(directory)
    if usage.total == 0:
        return None
    free = usage.free
    kind = filesystem_type(directory)
    if kind in MEMORY_FILESYSTEMS:
        memory = psutil.virtual_memory().available + psutil.swap_memory().free
        if memory < free:
            return (
                memory,
                f"it is a {kind}, whose files are memory, and {format_bytes(memory)} of memory is free",
            )
    return free, f"it has {format_bytes(free)} free"


def refusal(directory: str, lanes: Sequence[tuple[Strategy, int]], saves: int) -> str | None:
    """Why ``saves`` more saves of each of ``lanes`` cannot fit in local ``directory``, in one
    line; None where they may (or it is an object store: its room is the bucket's)."""
    if is_url(directory) or not os.path.isdir(directory):
        return None
    kept, told = kept_bytes(lanes, saves), room(directory)
    if told is None or kept <= told[0]:
        return None
    whole = sum(1 for strategy, _ in lanes if strategy.writes_checkpoints and strategy.whole_saves)
    processes = processes_on_host()
    return (
        f"{directory} cannot hold this run: {whole} lane(s) saving {saves} more time(s)"
        f"{f' on each of {processes} processes of host {platform.node()}' if processes > 1 else ''} "
        f"keep at least {format_bytes(kept)} more there, and {told[1]}; save less often, train "
        "fewer steps, run fewer strategies at once or a smaller state, or write elsewhere"
    )


def check_room(directory: str, lanes: Sequence[tuple[Strategy, int]], saves: int, group: Any = None) -> None:
    """ConfigError with the :func:`refusal`; with ``group`` (a process group), on every rank of it
    where any rank refuses, so that none goes on alone."""
    found = refusal(directory, lanes, saves)
    if group is not None:
        every: list[str | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, found, group=group)  # this job's ranks pickled them
        found = next((text for text in every if text), None)
    if found:
        raise ConfigError(found)
