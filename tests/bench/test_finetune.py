"""The fine-tuning workload (a frozen GPT, low-rank adapters trained) and ``nbckpt-incremental`` on it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from nbckpt import Checkpointer, ConfigError, bench
from nbckpt.bench._internal import add_bench_arguments, get_strategy, run_bench_from_args
from nbckpt.bench._workloads import GPTWorkload
from nbckpt.engine import Timeline
from tests.helpers.ranks import torchrun_two


def tiny_finetune() -> GPTWorkload:
    workload = bench.make_workload("tiny", finetune=True)
    assert isinstance(workload, GPTWorkload)
    workload.build()
    return workload


def test_finetune_trains_only_the_adapters_and_states_its_size() -> None:
    workload = tiny_finetune()
    model = workload.state()["model"]
    before = {key: value.clone() for key, value in model.state_dict().items()}
    workload.train_step()
    changed = {key for key, value in model.state_dict().items() if not torch.equal(value, before[key])}
    adapters = {key for key in before if key.endswith((".a", ".b"))}
    assert adapters and changed == adapters  # every adapter trained, nothing of the base
    assert sum(p.numel() for p in workload.trained()) == workload.trained_params
    optim = workload.state()["optim"].state_dict()["state"]
    saved = sum(t.nbytes for t in model.state_dict().values())
    saved += sum(t.nbytes for moments in optim.values() for t in moments.values())
    assert workload.nbytes == saved  # stated before anything was allocated
    assert workload.name == "tiny-finetune" and "rank-8 adapters" in workload.describe()


def test_finetune_needs_a_gpt() -> None:
    with pytest.raises(ConfigError, match="finetune adapts a GPT preset"):
        bench.make_workload(size_mb=4, finetune=True)
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    with pytest.raises(ConfigError, match="finetune adapts a GPT preset"):
        run_bench_from_args(parser.parse_args(["--finetune", "--size-mb", "4", "--quiet"]))


def _new_bytes(directory: Path) -> list[int]:
    """Bytes of each step's files that no earlier step shares (a hard link is one inode)."""
    seen: set[int] = set()
    sizes = []
    for step in sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step")):
        fresh = 0
        for path in step.rglob("*"):
            info = path.stat()
            if path.is_file() and info.st_ino not in seen:
                seen.add(info.st_ino)
                fresh += info.st_size
        sizes.append(fresh)
    return sizes


def test_compare_shows_incremental_writes_only_the_adapters(tmp_path: Path) -> None:
    workload = bench.make_workload("tiny", finetune=True)
    names = ["torch-save", "nbckpt-async", "nbckpt-incremental"]
    comparison = bench.compare(
        workload, names, str(tmp_path), steps=4, every=2, repeats=1, progress=None, keep=True
    )
    written = comparison.results.set_index("strategy")["written_mb"]
    assert written["nbckpt-incremental"] < 0.25 * written["nbckpt-async"]
    assert written["torch-save"] > 0.9 * workload.nbytes / 1e6  # torch.save writes it all
    persists = (
        comparison.timeline[comparison.timeline.kind == "persist"].groupby("strategy")["written"].mean()
    )
    assert persists["nbckpt-incremental"] / 1e6 == pytest.approx(written["nbckpt-incremental"])
    assert persists["torch-save"] / 1e6 == pytest.approx(written["torch-save"])
    shown = bench.format_results(comparison.results)
    assert "written MB" in shown.columns
    for name, files in (("nbckpt-async", False), ("nbckpt-incremental", True)):
        first, *later = _new_bytes(tmp_path / name)
        assert later and first > 0.9 * workload.nbytes
        if files:  # after the first save, only the adapters, their moments and metadata are new
            assert max(later) < 0.25 * workload.nbytes
        else:
            assert min(later) > 0.9 * workload.nbytes


def test_incremental_strategy_restores_its_last_step_bit_exactly(tmp_path: Path) -> None:
    workload = tiny_finetune()
    strategy = get_strategy("nbckpt-incremental")
    strategy.open(str(tmp_path), Timeline())
    for step in range(1, 4):
        workload.train_step()
        strategy.save(workload.state(), step)
    strategy.finish()
    strategy.close()
    persists = [e for e in strategy.timeline.events if e.kind == "persist"]
    assert [e.detail["skipped"] > 0 for e in persists] == [False, True, True]
    fresh = tiny_finetune()
    with Checkpointer(os.path.join(tmp_path, "nbckpt-incremental")) as ckpt:
        ckpt.delete(1)
        assert ckpt.restore(fresh.state(), step=3) == 3
    for theirs, ours in zip(
        workload.state()["model"].state_dict().values(),
        fresh.state()["model"].state_dict().values(),
        strict=True,
    ):
        assert torch.equal(theirs, ours)
    theirs_optim, ours_optim = workload.state()["optim"].state_dict(), fresh.state()["optim"].state_dict()
    for key, moments in theirs_optim["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, ours_optim["state"][key][name]), (key, name)


RESTORER = Path(__file__).parents[1] / "helpers" / "bench_restore_worker.py"


@pytest.mark.slow  # two torchrun launches: about a minute on 2 loaded cores
@pytest.mark.timeout(600)
def test_fsdp2_finetune_on_two_ranks_each_rank_shares_its_frozen_shard_and_restores(tmp_path: Path) -> None:
    """``nbckpt bench --finetune --fsdp`` under torchrun: FSDP2 over 2 gloo ranks, the base
    frozen; nbckpt-incremental writes each rank's frozen shard once, and its last step (its bytes
    spread over the first step's files) restores bit for bit on the same ranks."""
    out, folder = tmp_path / "job.json", tmp_path / "ckpt"
    names = ("nbckpt-async", "nbckpt-incremental")
    options = ["--preset", "tiny", "--finetune", "--fsdp", "--keep", "--strategies", ",".join(names)]
    options += ["--steps", "4", "--every", "2", "--repeats", "1", "--no-warmup", "--quiet"]
    torchrun_two("-m", "nbckpt", "bench", "--dir", str(folder), *options, "--json", str(out))
    for name, incremental in zip(names, (False, True), strict=True):
        for rank in (0, 1):
            steps = sorted(p for p in (folder / name).iterdir() if p.name.startswith("step-"))
            first, *later = [_new_rank_bytes(steps[: i + 1], rank) for i in range(len(steps))]
            assert later and first > 0.4 * _workload_bytes() / 2, (name, rank)
            if incremental:  # after the first save, each rank's adapters, moments and metadata
                assert max(later) < 0.25 * first, (name, rank, first, later)
            else:
                assert min(later) > 0.9 * first, (name, rank, first, later)
    lines = [
        json.loads(line)
        for line in torchrun_two(str(RESTORER), str(out), str(folder), "finetune").splitlines()
        if line.startswith("{")
    ]
    assert sorted(line["rank"] for line in lines) == [0, 1]
    for line in lines:
        for name in names:
            assert line["checked"][name] > 10 and line["differ"][name] == [], line


def _new_rank_bytes(steps: list[Path], rank: int) -> int:
    """Bytes of rank ``rank``'s data files in the last of ``steps`` that no earlier step holds
    (a hard link is one inode)."""
    *before, last = steps
    seen = {path.stat().st_ino for step in before for path in step.glob(f"__{rank}_*.distcp")}
    return sum(p.stat().st_size for p in last.glob(f"__{rank}_*.distcp") if p.stat().st_ino not in seen)


def _workload_bytes() -> int:
    return bench.make_workload("tiny", finetune=True).nbytes
