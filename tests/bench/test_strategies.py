"""Strategies: every adapter writes checkpoints that load back, and records its events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from nbckpt import Checkpointer, CheckpointError, ConfigError, Timeline, bench
from nbckpt.bench import _strategies
from nbckpt.bench._strategy import join
from nbckpt.bench._workloads import SyntheticWorkload, gpt

BUILT_IN = [
    "none",
    "torch-save",
    "dcp-sync",
    "dcp-async",
    "dcp-async-stager",
    "nbckpt-sync",
    "nbckpt-async",
    "nbckpt-async-overlap",
    "nbckpt-incremental",
]
THREAD_LOCAL = [
    "torch-save",
    "dcp-sync",
    "dcp-async",
    "nbckpt-sync",
    "nbckpt-async",
    "nbckpt-async-overlap",
    "nbckpt-incremental",
]


def load_model(name: str, path: str, step: int, like: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``model`` entry of a saved checkpoint, read back with each format's own reader."""
    if name == "torch-save":
        saved = torch.load(os.path.join(path, f"step-{step:06d}.pt"), weights_only=True)
        return dict(saved["model"])
    target = {key: torch.zeros_like(value) for key, value in like.items()}
    if name.startswith("dcp"):
        dcp_load({"model": target}, checkpoint_id=os.path.join(path, f"step-{step:06d}"), no_dist=True)
    else:
        with Checkpointer(path) as ckpt:
            assert ckpt.restore({"model": target}, step=step) == step
    return target


def save_twice(
    strategy: bench.Strategy, workload: SyntheticWorkload, directory: str, timeline: Timeline
) -> dict[str, torch.Tensor]:
    """Save steps 1 and 2 (training in between); return the tensors as they were at step 2."""
    strategy.open(directory, timeline)
    try:
        for step in (1, 2):
            strategy.before_step()
            workload.train_step()
            strategy.save(workload.state(), step)
            if step == 2:
                expected = {k: v.clone() for k, v in workload.state()["model"].items()}
        strategy.before_step()
        strategy.finish()
    finally:
        strategy.close()
    return expected


def test_registry_has_the_built_in_strategies() -> None:
    assert list(_strategies.STRATEGIES)[: len(BUILT_IN)] == BUILT_IN
    for name in BUILT_IN:
        strategy = _strategies.get_strategy(name)
        assert strategy.name == name
        assert strategy.description
    with pytest.raises(ConfigError, match="unknown strategy 'nope'; choose from none, torch-save"):
        _strategies.get_strategy("nope")


def test_register_strategy_adds_a_user_strategy(tmp_path: Any) -> None:
    @bench.register_strategy
    class Counting(bench.Strategy):
        name = "test-counting"
        saved: ClassVar[list[int]] = []

        def save(self, state: Mapping[str, Any], step: int) -> None:
            self.saved.append(step)

    try:
        strategy = _strategies.get_strategy("test-counting")
        assert isinstance(strategy, Counting)
        strategy.open(str(tmp_path), Timeline())
        strategy.save({}, 3)
        assert Counting.saved == [3]
        assert (tmp_path / "test-counting").is_dir()
    finally:
        _strategies.STRATEGIES.pop("test-counting")
    with pytest.raises(ConfigError, match="not a Strategy subclass"):
        bench.register_strategy(int)  # type: ignore[type-var]


@pytest.mark.parametrize("name", THREAD_LOCAL)
def test_strategy_saves_checkpoints_that_load_back(name: str, tmp_path: Any) -> None:
    workload = SyntheticWorkload(1 << 20, compute_ms=0)
    workload.build()
    timeline = Timeline(label=name)
    strategy = _strategies.get_strategy(name)
    expected = save_twice(strategy, workload, str(tmp_path), timeline)
    assert strategy.path == str(tmp_path / name)
    restored = load_model(name, strategy.path, 2, expected)
    assert set(restored) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(restored[key], tensor), key
    persisted = [e for e in timeline.events if e.kind == "persist"]
    assert [e.step for e in persisted] == [1, 2]
    assert all(e.bytes == workload.nbytes and e.end_ns >= e.start_ns for e in persisted)
    assert {e.label for e in timeline.events} == {name}
    assert not any(e.kind == "stall" for e in timeline.events)  # the runner times stalls


@pytest.mark.parametrize("name", ["torch-save", "dcp-async"])
def test_model_and_optimizer_state_round_trip(name: str, tmp_path: Any) -> None:
    workload = gpt("tiny")
    workload.build()
    workload.train_step()
    strategy = _strategies.get_strategy(name)
    strategy.open(str(tmp_path), Timeline())
    strategy.save(workload.state(), 1)
    strategy.finish()
    strategy.close()
    assert workload.model is not None and workload.optim is not None
    model = workload.model.state_dict()
    restored = load_model(name, strategy.path, 1, model)
    for key, tensor in model.items():
        assert torch.equal(restored[key], tensor), key
    if name == "torch-save":
        saved = torch.load(os.path.join(strategy.path, "step-000001.pt"), weights_only=True)
        moments = workload.optim.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(saved["optim"]["state"][0]["exp_avg"], moments)
        assert saved["step"] == 1


def test_dcp_async_records_staging_and_background_persistence(tmp_path: Any) -> None:
    workload = SyntheticWorkload(1 << 20, compute_ms=0)
    workload.build()
    timeline = Timeline()
    save_twice(_strategies.get_strategy("dcp-async"), workload, str(tmp_path), timeline)
    kinds = [(e.kind, e.step) for e in timeline.events if e.kind in ("stage", "persist")]
    assert sorted(kinds) == [("persist", 1), ("persist", 2), ("stage", 1), ("stage", 2)]
    stage = next(e for e in timeline.events if e.kind == "stage" and e.step == 2)
    persist = next(e for e in timeline.events if e.kind == "persist" and e.step == 2)
    assert persist.start_ns == stage.end_ns  # persistence starts when async_save returns


def test_nbckpt_strategies_forward_engine_events(tmp_path: Any) -> None:
    workload = SyntheticWorkload(1 << 20, compute_ms=0)
    workload.build()
    timeline = Timeline(label="nbckpt-async-overlap")
    strategy = _strategies.get_strategy("nbckpt-async-overlap")
    assert strategy.blocks_before_step
    save_twice(strategy, workload, str(tmp_path), timeline)
    kinds = {e.kind for e in timeline.events}
    assert {"stage", "persist", "fsync", "commit"} <= kinds
    assert "stall" not in kinds
    threads = {e.thread for e in timeline.events if e.kind == "persist"}
    assert threads == {"nbckpt-persist"}


def test_local_strategies_refuse_urls_and_nbckpt_accepts_them() -> None:
    with pytest.raises(ConfigError, match="torch-save writes local files only"):
        _strategies.get_strategy("torch-save").open("s3://bucket/run", Timeline())
    assert not _strategies.get_strategy("nbckpt-async").local_only
    assert join("s3://bucket/run/", "nbckpt-async") == "s3://bucket/run/nbckpt-async"


def test_a_failing_save_is_a_checkpoint_error(tmp_path: Any) -> None:
    strategy = _strategies.get_strategy("torch-save")
    strategy.open(str(tmp_path), Timeline())
    os.rmdir(strategy.path)
    (tmp_path / "torch-save").write_text("a file where the directory was")
    with pytest.raises(CheckpointError, match=r"torch.save of step 1 .* failed"):
        strategy.save({"x": torch.ones(3)}, 1)


def test_none_never_writes(tmp_path: Any) -> None:
    strategy = _strategies.get_strategy("none")
    assert not strategy.writes_checkpoints
    strategy.open(str(tmp_path), Timeline())
    assert list(tmp_path.iterdir()) == []


STAGER_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from nbckpt import Timeline
    from nbckpt.bench import _strategies as st
    from nbckpt.bench._workloads import SyntheticWorkload

    if __name__ == "__main__":  # DCP's checkpoint process is spawned: it re-imports this file
        workload = SyntheticWorkload(1 << 20, compute_ms=0)
        workload.build()
        timeline = Timeline(label="dcp-async-stager")
        strategy = st.get_strategy("dcp-async-stager")
        strategy.open(sys.argv[1], timeline)
        stager = strategy._stager
        same = []
        for step in (1, 2, 3, 4):
            strategy.before_step()
            workload.train_step()
            strategy.save(workload.state(), step)
            same.append(strategy._stager is stager)
        expected = {key: value.clone() for key, value in workload.state()["model"].items()}
        strategy.before_step()
        strategy.finish()
        strategy.close()
        target = {"model": {key: torch.zeros_like(value) for key, value in expected.items()}}
        dcp_load(target, checkpoint_id=strategy.path + "/step-000004", no_dist=True)
        print(json.dumps({
            "same_stager": same,
            "equal": all(torch.equal(target["model"][k], v) for k, v in expected.items()),
            "stage": [e.step for e in timeline.events if e.kind == "stage"],
            "persist": [e.step for e in timeline.events if e.kind == "persist"],
            "group_left": torch.distributed.is_initialized(),
        }))
""")


@pytest.mark.timeout(240)
def test_dcp_async_stager_reuses_one_stager_over_several_saves_quietly(tmp_path: Any) -> None:
    """pytorch#183413: a reused DefaultStager crashed on its second save in torch 2.11. In a
    process of its own (DCP's checkpoint process lives as long as the interpreter)."""
    script = tmp_path / "stager.py"
    script.write_text(STAGER_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == {
        "same_stager": [True] * 4,
        "equal": True,
        "stage": [1, 2, 3, 4],
        "persist": [1, 2, 3, 4],
        "group_left": False,
    }
    # DCP's checkpoint process logs every request at INFO; nbckpt starts it at WARNING
    assert " - INFO - " not in done.stderr, done.stderr
    assert sorted(os.listdir(tmp_path / "ckpt" / "dcp-async-stager")) == [
        f"step-{step:06d}" for step in (1, 2, 3, 4)
    ]


def test_dcp_async_stager_waits_for_its_copy_before_the_update() -> None:
    strategy = _strategies.get_strategy("dcp-async-stager")
    assert strategy.blocks_before_step  # the runner counts that wait as stall
    assert "DefaultStager" in strategy.description


@pytest.mark.parametrize("name", ["dcp-sync", "dcp-async"])
def test_dcp_without_a_process_group_saves_without_torchs_warning_and_only_then(
    name: str, tmp_path: Any
) -> None:
    """torch warns on every save without a process group that it assumes a single process:
    exactly that warning is left out while the strategy is open (dcp-async's comes from torch's
    writer thread), and a plain dcp.save after it warns as before."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    assert not dist.is_initialized()
    workload = SyntheticWorkload(1 << 16, compute_ms=0)
    workload.build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_twice(_strategies.get_strategy(name), workload, str(tmp_path), Timeline())
        during = [str(w.message) for w in caught]
        dcp_save({"x": torch.zeros(2)}, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    assert not [text for text in during if "torch.distributed is disabled" in text], during
    after = [str(w.message) for w in caught][len(during) :]
    assert any(text.startswith("torch.distributed is disabled") for text in after), after


def test_dcp_checkpoint_process_internals_quieted_are_those_of_the_installed_torch() -> None:
    """The DCP strategy quiets torch's checkpoint process through three of its private names,
    in _dcp_compat alone; a torch release that changes one fails here, naming it and torch's
    version (the strategy still runs then, its process logging at INFO)."""
    from nbckpt.bench._dcp_compat import missing

    assert not missing(), f"{missing()}: update nbckpt/bench/_dcp_compat.py"


def test_the_raw_write_beside_training_writes_each_ranks_share_to_files_of_its_own(tmp_path: Any) -> None:
    """Every rank's RawWriteBeside writes into the job's one folder: named by step and thread
    alone, two ranks wrote the same files, so a job of 2 ranks counted 2 shares written while the
    disk took one (the same pages, written over)."""
    from nbckpt.bench._measure import RawWriteBeside

    share = 256 * 1024
    ranks = [RawWriteBeside(share, rank=rank) for rank in range(2)]
    for rank, strategy in enumerate(ranks):
        strategy.open(str(tmp_path), Timeline(rank=rank))
    try:
        for strategy in ranks:
            strategy.save({}, 10)
        for strategy in ranks:
            strategy.finish()
    finally:
        for strategy in ranks:
            strategy.close()
    folder = tmp_path / ranks[0].name
    assert sum(path.stat().st_size for path in folder.iterdir()) == 2 * share


def test_the_raw_write_beside_training_leaves_only_its_newest_step_in_the_page_cache(tmp_path: Any) -> None:
    """As a save does (``Saver._uncache``): the step before's files leave the page cache once the
    next step's are written, so each write reuses their pages; kept, every write took fresh pages
    and on disk this floor wrote at a third of nbckpt's rate (docs/benchmarks.md)."""
    from nbckpt.bench._measure import RawWriteBeside
    from nbckpt.engine._internal import cached_fraction

    if bench.mount_info(tmp_path).kind != "local":  # tmpfs keeps its pages: they are the data
        pytest.skip(f"{tmp_path} is not on a local disk")
    floor = RawWriteBeside(1 << 20)
    floor.open(str(tmp_path), Timeline())
    try:
        for step in (1, 2):
            floor.save({}, step)
            floor.finish()
    finally:
        floor.close()
    files = sorted((tmp_path / floor.name).iterdir())
    cached = {path.name: cached_fraction(str(path)) for path in files}
    assert len(cached) == 2 * floor.threads, cached
    assert all(share == 0.0 for name, share in cached.items() if "-000001-" in name), cached
    assert all(share == 1.0 for name, share in cached.items() if "-000002-" in name), cached
