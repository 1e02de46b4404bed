"""A run whose next saves cannot fit where they go ends before them, in one line (``bench._room``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers.mounts import small_tmpfs

from nbckpt import cli
from nbckpt._util import MIB, format_bytes
from nbckpt.bench._ranks import RankStrategy
from nbckpt.bench._room import Room, kept_bytes
from nbckpt.bench._strategies import NbckptAsync, NbckptIncremental, NoCheckpoint, TorchSave

#: 8 checkpoint cycles of one step each, and the final checkpoint's: 9 cycles.
SCHEDULE = ["--steps", "8", "--every", "1", "--repeats", "1", "--compute-ms", "1", "--quiet"]


def test_a_run_that_outgrows_its_disk_ends_before_the_saves_that_would_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 20 MiB filesystem, torch.save and nbckpt saving a 4 MiB state: the warm-up's saves and
    the first cycle's fit (16 MiB), the next cycle's would not. It ends in one line (before, in
    ENOSPC inside a save, or on /dev/shm the OOM killer), and leaves the filesystem empty."""
    with small_tmpfs(tmp_path / "disk", "20m") as disk:
        directory = disk / "ckpt"
        code = cli.main(
            [
                "bench",
                "--dir",
                str(directory),
                "--strategies",
                "torch-save,nbckpt-async",
                "--size-mb",
                "4",
                *SCHEDULE,
            ]
        )
        assert code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("nbckpt bench: error: "), err
        assert (
            f"{directory} cannot hold the run's next saves (after 2 of 9 checkpoint cycles): 2 lane(s) "
            f"saving once more keep at least {format_bytes(8 * MIB)} more there, and it has " in err
        )
        assert err.rstrip().endswith("or write elsewhere")
        assert list(disk.iterdir()) == []


@pytest.mark.timeout(200)
def test_every_rank_of_a_host_ends_its_run_together_counting_the_hosts_ranks(tmp_path: Path) -> None:
    """2 ranks under torchrun on one 20 MiB filesystem, 3 MiB each: the warm-up and two cycles
    fit (18 MiB), the third cycle's saves would not; each rank says so, counting both ranks."""
    with small_tmpfs(tmp_path / "disk", "20m") as disk:
        directory = disk / "ckpt"
        bench = ["--dir", str(directory), "--strategies", "nbckpt-async", "--size-mb", "3", "--idle-compute"]
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        done = subprocess.run(
            [*torchrun, "-m", "nbckpt", "bench", *bench, *SCHEDULE],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode != 0
        line = (
            f"nbckpt bench: error: {directory} cannot hold the run's next saves (after 3 of 9 checkpoint "
            "cycles): 1 lane(s) saving once more on each of 2 processes of host "
        )
        assert done.stderr.count(line) == 2, done.stderr[-4000:]
        assert f"keep at least {format_bytes(2 * 3 * MIB)} more there" in done.stderr
        assert list(disk.iterdir()) == []


def test_a_tmpfs_has_the_room_memory_has_once_that_is_less_than_its_free_space(tmp_path: Path) -> None:
    memory = psutil.virtual_memory().total + psutil.swap_memory().total
    with small_tmpfs(tmp_path / "big", f"{2 * memory // 1024}k") as big:  # larger than memory
        left = Room.of(str(big)).left()
        assert left is not None
        assert 0 < left[0] < memory
        assert left[1].startswith("it is a tmpfs, whose files are memory, and ")
    with small_tmpfs(tmp_path / "small", "20m") as small:  # memory has more
        room = Room.of(str(small / "run"))  # a directory the lanes make as they open
        assert room.local and room.kind == "tmpfs"
        (small / "run").mkdir()
        left = room.left()
        assert left is not None
        assert left[0] <= 20 * MIB and left[1] == f"it has {format_bytes(left[0])} free"


def test_a_save_adds_the_whole_state_of_every_lane_that_writes_it_on_every_process_of_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lanes = [(NoCheckpoint(), 10), (TorchSave(), 100), (NbckptAsync(), 1000), (NbckptIncremental(), 5)]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert kept_bytes(lanes) == 1100  # the baseline writes nothing; an increment may write nothing
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: the ranks on this host
    assert kept_bytes(lanes) == 4 * 1100
    job = type("Job", (), {"rank": 1, "replicated": False, "dcp_group": None})()
    assert not RankStrategy(NbckptIncremental(), job).whole_saves  # type: ignore[arg-type]
    assert Room.of("s3://bucket/run").local is False  # a bucket's room is not this host's
