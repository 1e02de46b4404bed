"""The checkpoint interval measured when none is given (issue 29 defect 7): a comparison's
default checkpoints no faster than its saves persist, and a given one that queues says so."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from nbckpt import bench
from nbckpt.bench._auto_interval import (
    CHECKPOINTS_PER_RUN,
    SAVES_PER_INTERVAL,
    agree_largest,
    choose_interval,
)
from nbckpt.bench._compare import add_bench_arguments
from nbckpt.bench._workloads import SyntheticWorkload

MB = 1 << 20


def _workload(compute_ms: float, size_mb: int = 4) -> SyntheticWorkload:
    workload = SyntheticWorkload(size_mb * MB, compute_ms=compute_ms)
    workload.build()
    return workload


def test_the_interval_is_measured_saves_apart_and_leaves_nothing(tmp_path: Path) -> None:
    interval = choose_interval(_workload(1.0), str(tmp_path), steps=None)
    assert interval.step_s > 0 and interval.save_s > 0
    assert interval.every == max(1, math.ceil(SAVES_PER_INTERVAL * interval.save_s / interval.step_s))
    assert interval.every * interval.step_s >= SAVES_PER_INTERVAL * interval.save_s
    assert interval.steps == CHECKPOINTS_PER_RUN * interval.every and interval.fits
    assert list(tmp_path.iterdir()) == []  # the probe's saves are removed
    # given steps shorter than the interval: capped there, and the line says saves may queue
    short = choose_interval(_workload(0.0), str(tmp_path), steps=1)
    if short.needed > 1:
        assert (short.every, short.steps, short.fits) == (1, 1, False)
        assert "saves may queue" in short.describe()


def test_compare_without_every_checkpoints_at_the_measured_interval(tmp_path: Path) -> None:
    lines: list[str] = []
    comparison = bench.compare(
        _workload(1.0), ["nbckpt-async"], str(tmp_path / "bench"), repeats=1, progress=lines.append
    )
    said = [line for line in lines if line.startswith("checkpoint every ")]
    assert len(said) == 1, lines
    match = re.match(r"checkpoint every (\d+) steps, measured: .*; (\d+) steps a run", said[0])
    assert match is not None, said[0]
    assert (comparison.every, comparison.steps) == (int(match[1]), int(match[2]))
    assert comparison.steps == CHECKPOINTS_PER_RUN * comparison.every


def test_a_given_every_that_queues_still_says_so(tmp_path: Path) -> None:
    """Steps of no compute, a checkpoint every step: each save waits for the one before. The
    interval is the baseline's mean step, so one step of a few steps held up on a loaded machine
    (tens of ms) can make it longer than a 4 MiB save's write (the likely cause of one failure
    under load): 16 MiB write for longer."""
    lines: list[str] = []
    comparison = bench.compare(
        _workload(0.0, size_mb=16),
        ["nbckpt-async"],
        str(tmp_path / "bench"),
        steps=6,
        every=1,
        repeats=1,
        progress=lines.append,
    )
    assert not any(line.startswith("checkpoint every ") for line in lines)  # given: not measured
    assert (comparison.steps, comparison.every) == (6, 1)
    assert any(text.startswith("queueing regime: a checkpoint every 1 steps") for text in comparison.warnings)


def test_nbckpt_bench_and_ckpt_bench_measure_by_default() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args([])
    assert (args.steps, args.every) == (None, None)


def _agreed(rank: int, store_path: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from nbckpt.bench import _auto_interval

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        agree = _auto_interval.agree_largest(dist.group.WORLD)
        assert agree is not None
        Path(out, f"rank{rank}.json").write_text(json.dumps(agree([7, 31][rank])))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_on_many_ranks_every_rank_takes_the_largest_measured_interval(tmp_path: Path) -> None:
    """Ranks that measured different intervals must still save at the same steps (the saves of a
    bench on many ranks are collective): each takes the largest."""
    import json

    import torch.multiprocessing as mp

    assert agree_largest(None) is None  # one process: its own
    # forked: the ranks need torch imported once, not again in each (a spawn took 20 s here)
    mp.start_processes(_agreed, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [31, 31]
