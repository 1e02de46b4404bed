"""Storage failures on real filesystems: a full disk, a read-only mount, lost permissions, a file.

Mounting needs root (a size-limited tmpfs, a read-only bind mount); lost permissions need a
process without CAP_DAC_OVERRIDE (``setpriv``). Each test says why when it has to skip.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.mounts import mount_or_skip, run_quiet, small_tmpfs

from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine import _store
from nbckpt.engine._faults import armed

MB = 1 << 20


def floats(megabytes: float, step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((int(megabytes * MB) // 4,), float(step))}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: two 4 MiB checkpoints fit, a 12 MiB one on top of them does not."""
    with small_tmpfs(tmp_path / "disk", "16m") as mountpoint:
        yield mountpoint


def assert_no_leftovers(directory: Path) -> None:
    assert [n for n in os.listdir(directory) if n.startswith((".tmp-", ".trash-"))] == []


def restore_w(ckpt: Checkpointer, megabytes: float) -> tuple[int, torch.Tensor]:
    state = floats(megabytes, -1)
    return ckpt.restore(state), state["w"]


@pytest.mark.parametrize("writer_threads", [1, 2])
def test_disk_full_is_reported_cleaned_up_and_survivable(
    small_disk: Path, writer_threads: int, capfd: pytest.CaptureFixture[str]
) -> None:
    directory = small_disk / "run"
    with Checkpointer(directory, mode="async", writer_threads=writer_threads) as ckpt:
        for step in (1, 2):
            ckpt.save(floats(4, step), step=step).wait()
        handle = ckpt.save(floats(12, 3), step=3)
        with pytest.raises(CheckpointError) as raised:
            handle.wait()
        message = str(raised.value)
        assert "ENOSPC" in message and str(directory) in message, message
        assert ".distcp" in message or ".metadata" in message, message  # names the file
        assert "\n" not in message
        assert_no_leftovers(directory)
        assert ckpt.steps() == [1, 2]
        step, w = restore_w(ckpt, 4)
        assert step == 2 and torch.equal(w, floats(4, 2)["w"])
        ckpt.save(floats(4, 3), step=3).wait()  # the failed save freed its space: training goes on
        assert ckpt.steps() == [1, 2, 3]
        assert ckpt.verify(3)["step"] == 3
    assert capfd.readouterr().err == ""  # 16: one line to the caller, nothing on stderr


def test_disk_full_surfaces_from_the_next_save(small_disk: Path) -> None:
    directory = small_disk / "run"
    with Checkpointer(directory, mode="async", keep=2) as ckpt:
        ckpt.save(floats(4, 1), step=1)
        ckpt.save(floats(13, 2), step=2)  # does not fit next to step 1
        with pytest.raises(CheckpointError, match=r"save of step 2 .*ENOSPC"):
            ckpt.save(floats(4, 3), step=3)
        assert_no_leftovers(directory)
        ckpt.save(floats(4, 3), step=3)
        assert [r.step for r in ckpt.wait()] == [3]
        assert ckpt.steps() == [1, 3]


def test_disk_full_surfaces_from_close(small_disk: Path) -> None:
    directory = small_disk / "run"
    ckpt = Checkpointer(directory, mode="async")
    ckpt.save(floats(20, 1), step=1)
    with pytest.raises(CheckpointError, match="ENOSPC"):
        ckpt.close()
    assert_no_leftovers(directory)
    with Checkpointer(directory) as again:  # close() released the lock all the same
        assert again.steps() == []


def test_disk_full_in_sync_mode_raises_from_save(small_disk: Path) -> None:
    directory = small_disk / "run"
    with Checkpointer(directory, mode="sync") as ckpt:
        ckpt.save(floats(4, 1), step=1)
        with pytest.raises(CheckpointError, match="ENOSPC"):
            ckpt.save(floats(14, 2), step=2)
        assert_no_leftovers(directory)
        assert ckpt.steps() == [1]


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only bind mount of a directory that holds one committed checkpoint (step 1)."""
    source, view = tmp_path / "source", tmp_path / "view"
    view.mkdir()
    with Checkpointer(source / "run", mode="sync") as ckpt:
        ckpt.save(floats(0.1, 1), step=1)
    mount_or_skip("--bind", str(source), str(view))
    try:
        mount_or_skip("-o", "remount,bind,ro", str(view))
        yield view
    finally:
        run_quiet("umount", "-l", str(view))


def test_read_only_filesystem_fails_at_construction(read_only_dir: Path) -> None:
    for target in (read_only_dir / "run", read_only_dir / "new-run"):
        with pytest.raises(CheckpointError) as raised:
            Checkpointer(target)
        assert str(raised.value) == f"{target} is not writable (Read-only file system)"
    assert not (read_only_dir / "new-run").exists()


def test_filesystem_turning_read_only_under_a_checkpointer(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory, mode="async") as ckpt:
        ckpt.save(floats(0.1, 1), step=1).wait()
        # a read-only filesystem now sits where the checkpoints are written
        mount_or_skip("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory))
        try:
            with pytest.raises(CheckpointError, match=r"Read-only file system \[EROFS\]"):
                ckpt.save(floats(0.1, 2), step=2).wait()
        finally:
            run_quiet("umount", "-l", str(directory))
        assert ckpt.steps() == [1]
        assert ckpt.verify(1)["step"] == 1
        ckpt.save(floats(0.1, 2), step=2).wait()
    assert sorted(os.listdir(directory)) == [".nbckpt.lock", "step-000001", "step-000002"]


LOSES_PERMISSION = """
import sys, torch
from nbckpt import Checkpointer, CheckpointError
from nbckpt.engine import _store
from nbckpt.engine._files import LocalSink
try:
    Checkpointer(sys.argv[1])
    print("constructed")
except CheckpointError as exc:
    print(f"construction: {exc}")
ckpt = Checkpointer(sys.argv[2], mode="async")
ckpt.save({"w": torch.ones(1000)}, step=1).wait()
print("saved", flush=True)
sys.stdin.readline()
try:
    ckpt.save({"w": torch.ones(1000)}, step=2).wait()
    print("committed")
except CheckpointError as exc:
    print(f"later: {exc}")
print(f"steps: {ckpt.steps()}")
ckpt.close()
"""


def test_permission_denied_at_construction_and_later(tmp_path: Path) -> None:
    """Run as root without CAP_DAC_OVERRIDE, so that mode bits apply as they do to a user."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to drop CAP_DAC_OVERRIDE")
    locked, losing = tmp_path / "locked", tmp_path / "losing"
    locked.mkdir(mode=0o555)
    drop = "-dac_override,-dac_read_search,-fowner"
    args = [setpriv, "--bounding-set", drop, "--inh-caps", drop, sys.executable, "-c", LOSES_PERMISSION]
    child = subprocess.Popen(
        [*args, str(locked / "run"), str(losing)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    lines = [child.stdout.readline().strip() for _ in range(2)]
    assert lines == [f"construction: {locked / 'run'} is not writable (Permission denied)", "saved"]
    losing.chmod(0o555)
    try:
        out, err = child.communicate("go\n", timeout=120)
    finally:
        losing.chmod(0o755)
    assert child.returncode == 0, err
    later, steps = out.splitlines()
    assert later.startswith(f"later: save of step 2 to {losing} failed: Permission denied [EACCES]")
    assert steps == "steps: [1]"
    with Checkpointer(losing) as ckpt:
        assert ckpt.verify(1)["step"] == 1


def test_target_that_is_a_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(target)
    assert str(raised.value) == f"{target} is not writable (it is a file, not a directory)"
    with pytest.raises(CheckpointError) as raised:
        Checkpointer(target / "run")
    assert str(raised.value) == f"{target / 'run'} is not writable (Not a directory)"
    assert target.read_text() == "not a directory"


def test_a_short_write_of_the_manifest_is_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write(2) may write less than asked (a nearly full disk); the manifest must still be whole."""
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, bytes(data)[: max(1, len(data) // 3)])

    with Checkpointer(tmp_path / "run", mode="sync") as ckpt:
        monkeypatch.setattr(os, "write", short_write)
        ckpt.save(floats(0.1, 1), step=1)
        monkeypatch.undo()
        assert ckpt.verify(1)["step"] == 1
        step, w = restore_w(ckpt, 0.1)
        assert step == 1 and torch.equal(w, floats(0.1, 1)["w"])


# -- 11 to 13 and 16: a failed re-save, a failed commit, new directories, error messages --------


def eio(path: str) -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO), path)


def test_11_a_failed_resave_without_exchange_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory, mode="sync") as ckpt:
        ckpt.save(floats(0.1, 1), step=1)
    exchanges: list[tuple[str, str]] = []

    def no_exchange(a: str, b: str) -> None:  # NFS: no renameat2
        exchanges.append((a, b))
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    real_rename = os.rename

    def rename(src: str, dst: str) -> None:
        if os.path.basename(src).startswith(".tmp-") and os.path.basename(dst) == "step-000001":
            raise eio(src)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with armed("file.exchange", no_exchange), Checkpointer(directory, mode="sync") as ckpt:
        with pytest.raises(CheckpointError, match=r"EIO"):
            ckpt.save(floats(0.1, 2), step=1, overwrite=True)
        assert ckpt.steps() == [1]
    monkeypatch.undo()
    assert len(exchanges) == 1  # the re-save tried the exchange first, then renamed
    with Checkpointer(directory) as ckpt:  # the next open must not take the old copy for a leftover
        step, w = restore_w(ckpt, 0.1)
        assert step == 1 and torch.equal(w, floats(0.1, 1)["w"])


def test_11_exchange_errors_are_not_taken_for_unsupported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _store.exchange_paths(str(tmp_path / "missing-a"), str(tmp_path / "missing-b"))


@pytest.mark.parametrize("resave", [False, True])
def test_12_a_save_reported_failed_is_not_committed(tmp_path: Path, resave: bool) -> None:
    directory = tmp_path / "run"
    failures = []

    def fsync_dir(path: str) -> None:
        if path == str(directory) and not failures:  # the parent, right after the rename
            failures.append(path)
            raise eio(path)

    with Checkpointer(directory, mode="sync") as ckpt:
        ckpt.save(floats(0.1, 1), step=1)
        step = 1 if resave else 2
        with (
            armed("dir.fsync", fsync_dir),
            pytest.raises(CheckpointError, match=rf"Input/output error \[EIO\] \({directory}\)"),
        ):
            ckpt.save(floats(0.1, 9), step=step, overwrite=True)
        assert failures == [str(directory)]
        assert ckpt.steps() == [1]  # what the caller was told is what is on disk
        got, w = restore_w(ckpt, 0.1)
        assert got == 1 and torch.equal(w, floats(0.1, 1)["w"])


def test_13_new_directories_are_fsynced_into_their_parents(tmp_path: Path) -> None:
    synced: list[str] = []
    with armed("dir.fsync", synced.append):
        Checkpointer(tmp_path / "a" / "b" / "run").close()
    assert synced[:3] == [str(tmp_path), str(tmp_path / "a"), str(tmp_path / "a" / "b")]


def test_16_a_failing_manifest_write_names_the_file(tmp_path: Path) -> None:
    def write(path: str) -> None:
        if os.path.basename(path) == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with Checkpointer(tmp_path / "run", mode="sync") as ckpt, armed("file.write", write):
        with pytest.raises(CheckpointError, match=r"No space left on device \[ENOSPC\] \(.*manifest\.json\)"):
            ckpt.save(floats(0.1, 1), step=1)
        assert ckpt.steps() == []
