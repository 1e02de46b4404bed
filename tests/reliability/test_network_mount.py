"""Reliability v3, item 21: the engine on a network file system, a SeaweedFS FUSE mount over
loopback (the closest thing here to an NFS mount of a FlashBlade: no kernel NFS client exists on
these machines). One mount per session (``network_mount`` in conftest.py); skipped, with the
reason, where FUSE cannot be used. The SIGKILL trials on it are in test_crash.py.

What the mount does differently, found by the first test and handled by the engine:
``renameat2(RENAME_EXCHANGE)`` is not supported but not refused either: SeaweedFS ignores the
flag and renames, which onto a step directory (never empty) fails with ENOTEMPTY, which the
engine takes for "unsupported" and re-saves with two renames (before the fix every re-save
failed there). ``fsync`` of a directory succeeds; ``O_DIRECT`` reads and writes work (nbckpt
uses neither O_DIRECT nor anything else the mount lacks); ``flock`` excludes a second writer
through the same mount (the kernel's own locks; across two hosts it would need the server's,
``weed mount -dlm``, as NFS needs NFSv4 or lockd).
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.states import assert_holds, state_of

from nbckpt import Checkpointer, CheckpointError, bench
from nbckpt.engine import _store

pytestmark = [pytest.mark.s3, pytest.mark.xdist_group("s3")]


def test_item21_the_probe_reports_a_network_mount(on_mount: Path) -> None:
    info = bench.mount_info(on_mount)
    assert info.fstype == "fuse.seaweedfs" and info.kind == "network", info
    result = bench.probe(on_mount, size_mb=1, streams=[1], repeats=1)
    assert result.kind == "network" and result.fstype == "fuse.seaweedfs"


def test_item21_what_renameat2_directory_fsync_and_o_direct_do_there(on_mount: Path) -> None:
    a, b = on_mount / "a", on_mount / "b"
    for directory, name in ((a, "new"), (b, "old")):
        directory.mkdir()
        (directory / "data").write_text(name)
    # The flag is ignored (a rename onto a non-empty directory): taken for "unsupported", and
    # nothing moved. On a local disk the same call exchanges the two.
    assert _store.exchange_paths(str(a), str(b)) is False
    assert (a / "data").read_text() == "new" and (b / "data").read_text() == "old"
    _store.fsync_dir(str(a))  # a directory's fsync: supported
    fd = os.open(on_mount / "direct", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        buffer = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
        buffer.write(b"x" * (1 << 20))
        assert os.write(fd, buffer) == 1 << 20
        os.fsync(fd)
    finally:
        os.close(fd)
    assert (on_mount / "direct").stat().st_size == 1 << 20


def test_item21_save_resave_retention_and_restore_on_a_network_mount(on_mount: Path) -> None:
    run = on_mount / "run"
    with Checkpointer(run, keep=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(state_of(step), step=step)
        ckpt.wait()
        assert ckpt.steps() == [3, 4]  # retention on the mount
    with Checkpointer(run) as ckpt:
        again = state_of(40)
        ckpt.save(again, step=4, overwrite=True).wait()  # a re-save: two renames here
        restored = {"w": torch.zeros(1000), "step": -1}
        assert ckpt.restore(restored) == 4 and torch.equal(restored["w"], again["w"])
    assert sorted(n for n in os.listdir(run) if not n.startswith("step-")) == [".nbckpt.lock"]
    with Checkpointer(run, mode="sync") as ckpt:  # reopened: nothing to clean up, both verify
        for step in ckpt.steps():
            ckpt.verify(step)
        assert_holds(ckpt, 3)


HOLDS_THE_DIRECTORY = """
import sys
from nbckpt import Checkpointer
with Checkpointer(sys.argv[1]) as ckpt:
    print("holding", flush=True)
    sys.stdin.readline()
"""


def test_item21_the_lock_stops_a_second_writer_on_a_network_mount(on_mount: Path) -> None:
    run = on_mount / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THE_DIRECTORY, str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "holding\n"
        with pytest.raises(CheckpointError, match=rf"in use by another Checkpointer \(pid {child.pid}\)"):
            Checkpointer(run)
    finally:
        _, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 0, err
    Checkpointer(run).close()  # free again once the holder closed
