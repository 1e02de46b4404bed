"""A run whose saves cannot fit where they go is refused before its first chunk (``bench._room``)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from helpers.ranks import torchrun_two

from nbckpt import cli
from nbckpt._util import MIB, format_bytes
from nbckpt.bench._ranks import RankStrategy
from nbckpt.bench._room import filesystem_type, kept_bytes
from nbckpt.bench._strategies import NbckptAsync, NbckptIncremental, NoCheckpoint, TorchSave

HELPER = Path(__file__).parents[1] / "helpers" / "bench_rank_worker.py"
SHM = "/dev/shm"


@pytest.fixture(params=["disk", "tmpfs"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """An empty directory on the disk the tests write to, or in ``/dev/shm`` (memory)."""
    if request.param == "disk":
        yield tmp_path
        return
    if not os.path.isdir(SHM) or filesystem_type(SHM) != "tmpfs":
        pytest.skip(f"{SHM} is not a tmpfs here")
    folder = Path(tempfile.mkdtemp(prefix="nbckpt-room-", dir=SHM))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_run_whose_saves_cannot_fit_is_one_line_exit_2_and_leaves_nothing(
    target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """100,000 saves of a 4 MiB state by torch.save and nbckpt (800 GB): refused once their
    warm-up saves are made, which go with the rest; on a tmpfs, against the memory free."""
    directory = target / "ckpt"
    run = [
        "--size-mb",
        "4",
        "--compute-ms",
        "1",
        "--steps",
        "100000",
        "--every",
        "1",
        "--repeats",
        "1",
        "--quiet",
    ]
    code = cli.main(["bench", "--dir", str(directory), "--strategies", "torch-save,nbckpt-async", *run])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("nbckpt bench: error: ")
    kept = format_bytes(2 * 100_000 * 4 * MIB)
    assert (
        f"{directory} cannot hold this run: 2 lane(s) saving 100000 more time(s) keep at least {kept}" in err
    )
    memory = psutil.virtual_memory().available + psutil.swap_memory().free
    on_memory = filesystem_type(str(target)) == "tmpfs" and memory < shutil.disk_usage(target).free
    assert ("whose files are memory" in err) == on_memory, err
    assert err.rstrip().endswith("or write elsewhere")
    assert list(target.iterdir()) == []


def test_what_a_run_keeps_counts_every_whole_save_of_every_process_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lanes = [(NoCheckpoint(), 10), (TorchSave(), 100), (NbckptAsync(), 1000), (NbckptIncremental(), 5)]
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert kept_bytes(lanes, 3) == 3 * 1100  # the baseline writes nothing, increments may not
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's: the ranks on this host
    assert kept_bytes(lanes, 3) == 4 * 3 * 1100
    job = type("Job", (), {"rank": 1, "replicated": False, "dcp_group": None})()
    assert not RankStrategy(NbckptIncremental(), job).whole_saves  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_on_many_ranks_every_rank_refuses_where_one_cannot_fit(tmp_path: Path) -> None:
    """Rank 1 alone cannot fit (its ranks' hosts may differ): rank 0 refuses with its line too,
    instead of going on into the run's first collective alone."""
    stdout = torchrun_two(str(HELPER), "-1", "0", "room", str(tmp_path), timeout=100)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    errors = {line["rank"]: line["error"] for line in lines}
    assert sorted(errors) == [0, 1]
    assert errors[0] == errors[1]
    kept = format_bytes(2 * 4096 * 2**50)  # both ranks of this host, each 4096 saves of 2**50 bytes
    assert (
        f"{tmp_path} cannot hold this run: 1 lane(s) saving 4096 more time(s) on each of 2 processes"
        in errors[0]
    )
    assert f"keep at least {kept} more there" in errors[0]
