"""Sharded training state (FSDP2, tensor parallel, both on a 2-D mesh, HSDP) on real gloo ranks,
compared with what ``torch.distributed.checkpoint`` does on the same state.

Five launches share one directory, in order: 4 ranks save (FSDP2, HSDP, FSDP2+TP) and restore at
4; 2 ranks restore those (reshard 4 -> 2), then save their own (FSDP2, TP on a 1-D mesh); one
process restores everything into a plain model (4 -> 1, 2 -> 1); 4 ranks restore what 2 saved
(2 -> 4); 2 ranks, one killed mid-save. Every restore is checked bit for bit against the full
state dict the saving run wrote, done three ways: nbckpt from its own checkpoint, a plain
``dcp.load`` of nbckpt's checkpoint, nbckpt from the checkpoint ``dcp.save`` wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.ranks import run_ranks

pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("sharded")]

WORKER = Path(__file__).parents[1] / "helpers" / "shard_worker.py"


def launch(scenarios: str, directory: Path, world: int) -> dict[int, dict[str, Any]]:
    results = run_ranks(scenarios, directory, world, timeout=400, worker=WORKER)
    for rank, (code, _, err) in results.items():
        assert code == 0, f"rank {rank}: {err}"
    return {rank: seen for rank, (_, seen, _) in results.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    directory = tmp_path_factory.mktemp("sharded")
    return {
        "at 4": launch("save,modules,divergent", directory, 4),
        "at 2": launch(
            "restore,modules,save,replicas,ranked,retained,incremental,incremental_reshard", directory, 2
        ),
        "at 1": launch("restore,incremental_reshard", directory, 1),
        "at 4 again": launch("restore,incremental_reshard", directory, 4),
    }


@pytest.mark.parametrize("kind", ["fsdp", "hsdp", "fsdp+tp"])
def test_4_ranks_save_asynchronously_and_restore_bit_exact(runs: Any, kind: str) -> None:
    for seen in runs["at 4"].values():
        assert seen["save"][kind]["exact"] and seen["save"][kind]["restored"] == 2, seen["save"][kind]
        assert seen["save"][kind]["step"] == 2


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_2_ranks_save_and_restore_bit_exact(runs: Any, kind: str) -> None:
    for seen in runs["at 2"].values():
        assert seen["save"][kind]["exact"], seen["save"][kind]


@pytest.mark.parametrize(
    ("run", "case"),
    [
        ("at 2", "fsdp@4->fsdp@2"),
        ("at 2", "hsdp@4->fsdp@2"),
        ("at 2", "fsdp+tp@4->fsdp@2"),
        ("at 1", "fsdp@4->plain@1"),
        ("at 1", "hsdp@4->plain@1"),
        ("at 1", "fsdp+tp@4->plain@1"),
        ("at 1", "fsdp@2->plain@1"),
        ("at 1", "tp@2->plain@1"),
        ("at 4 again", "fsdp@2->fsdp@4"),
        ("at 4 again", "tp@2->fsdp@4"),
    ],
)
def test_reshard_by_nbckpt_by_plain_dcp_load_and_from_a_dcp_checkpoint(
    runs: Any, run: str, case: str
) -> None:
    for rank, seen in runs[run].items():
        assert seen["restore"][case] == {"nbckpt": True, "dcp.load": True, "from dcp": True}, (
            rank,
            seen["restore"],
        )


def test_hsdp_replicas_are_written_once(runs: Any) -> None:
    hsdp = runs["at 4"][0]["save"]["hsdp"]
    # every tensor byte of the state once (the replicas of each shard are written by one of them)
    assert hsdp["tensor_bytes"] == hsdp["state_bytes"], hsdp
    assert abs(hsdp["nbckpt_disk"] - hsdp["dcp_disk"]) <= 0.01 * hsdp["dcp_disk"], hsdp


def test_a_sharded_module_and_optimizer_passed_directly_reshard(runs: Any) -> None:
    assert all(seen["modules"] == {"saved": True} for seen in runs["at 4"].values())
    assert all(seen["modules"] == {"exact": True} for seen in runs["at 2"].values())


def test_a_plain_tensor_with_other_values_on_other_ranks_is_refused_on_every_rank(runs: Any) -> None:
    for rank, seen in runs["at 4"].items():
        found = seen["divergent"]
        # warmed up, the saves are agreed on the persist thread: refused there, on every rank
        for key, name in (("outcome", "batch"), ("unsigned", "seed")):
            assert found[key].startswith("CheckpointError: save of step 1 to "), found
            assert f"/divergent failed: '{name}' is a plain tensor with different values" in found[key], found
        assert "rank 0 vs rank 1 vs rank 2 vs rank 3" in found["outcome"], found
        assert found["warmed"] == "ok", found
        assert found["then"] == "ok" and found["steps"] == [2], (rank, found)


def test_a_replicated_dtensor_with_other_values_on_other_ranks_is_refused_on_every_rank(runs: Any) -> None:
    for rank, seen in runs["at 2"].items():
        found = seen["replicas"]
        differ = "ConfigError: 'r' is a DTensor whose replicas differ (rank 0 vs rank 1)"
        assert found["differ"].startswith(differ), (rank, found)
        assert found["refused_steps"] == [], found  # nothing committed
        assert found["agreed"] == "ok" and found["restored"] == 2, found
        assert found["values"] == [[5.0, 5.0]] * 4, found


def test_a_key_only_one_rank_asks_for_is_named_with_its_rank_on_every_rank(runs: Any) -> None:
    for rank, seen in runs["at 2"].items():
        lacking = seen["replicas"]["lacking"]
        assert lacking.startswith("ConfigError: no step in "), (rank, lacking)
        assert "(missing on rank 1: 'extra')" in lacking, (rank, lacking)
        assert "holds 'r', 'w'" in lacking, (rank, lacking)
        named = seen["replicas"]["named"]  # restore(step=2): that step, refused on every rank
        assert "cannot restore step-000002 into rank 1's state: " in named, (rank, named)
        assert "'extra'" in named, (rank, named)


def test_plain_dcp_load_reads_every_ranks_own_plain_values(runs: Any) -> None:
    """Issue 31 item 11: each rank writes its own plain values' DCP byte items (before: rank 0's
    alone, so ``dcp.load`` on rank 1 stopped at ``Missing key ... loader.rank1.pos`` and
    ``dcp_to_torch_save`` dropped them)."""
    for rank, seen in runs["at 2"].items():
        assert seen["ranked"]["loaded"] == "ok" and seen["ranked"]["same"], (rank, seen["ranked"])
    assert runs["at 2"][0]["ranked"]["kept"] == {
        "rank0": {"pos": "10", "tag": "b'r0'"},
        "rank1": {"pos": "11", "tag": "b'r1'"},
    }


def test_a_rank_killed_mid_save_of_sharded_state_leaves_nothing_committed(tmp_path: Path) -> None:
    results = run_ranks("killed", tmp_path, 2, timeout=300, worker=WORKER)
    code1, _, _ = results[1]
    assert code1 < 0  # SIGKILL
    code0, seen, err = results[0]
    assert code0 == 0, err
    assert seen["killed"]["outcome"].startswith("CheckpointError: save of step 2"), seen
    assert seen["killed"]["steps"] == ["step-000001"], seen


def test_2_fsdp2_ranks_with_a_frozen_embedding_each_share_their_own_files(runs: Any) -> None:
    """Incremental saves (issue 32): each rank decides for its own shards; its file of the frozen
    embedding's shard is its first step's in every later step, the rest is written; with the
    steps before deleted, the last restores bit for bit. A rewind on both ranks sets the newer
    step aside (rank 0 moves it, rank 1 waits) and it restores from there bit for bit."""
    for rank, seen in runs["at 2"].items():
        result = seen["incremental"]
        assert result["exact"], result
        assert result["rewound"] == {"steps": [3, 5], "after": 3, "aside": [4], "exact": True}, rank
        mirrored = {"restored": 6, "exact": True, "steps": [3, 5, 6, 7], "aside": [[4], [8, 9]]}
        assert {k: v for k, v in result["mirrored"].items() if k != "set_aside"} == mirrored, rank
        # step 8, set aside while the mirror could not be told: no rank reads the mirror's copy
        assert result["mirrored"]["set_aside"].startswith(
            "CheckpointError: no committed checkpoint for step 8 in "
        ), (rank, result["mirrored"])
        records, shared = result["records"], result["shared"]
        assert records[0][1] == 0 and all(skipped > 0 for _, skipped in records[1:]), records
        mine = [name for name in result["embedding"] if name.startswith(f"__{rank}_")]
        assert mine and set(mine) <= set(shared), (mine, shared)


def test_a_step_rank_0s_retention_deleted_is_shared_from_by_no_rank(runs: Any) -> None:
    """Retention deletes on rank 0 alone (BestN, ``retain()`` after steps saved out of order, so
    the step every rank would share from goes): the next save shares on no rank and commits (rank 1
    shared the deleted step's files, and the save failed), the one after shares again."""
    for rank, seen in runs["at 2"].items():
        result = seen["incremental"]["after_retention"]
        skipped = result["skipped"]
        assert all(isinstance(count, int) for count in skipped), (rank, skipped)
        assert skipped[0] == 0 and skipped[1] > 0 and skipped[2] == 0 and skipped[3] > 0, (rank, skipped)
        assert result["steps"][-1] == 7, (rank, result)  # verified: whole
    assert runs["at 2"][0]["incremental"]["after_retention"]["steps"] == [7]  # BestN kept 7 alone


@pytest.mark.parametrize("run", ["at 1", "at 4 again"])
def test_an_incremental_step_sharing_files_reshards_as_plain_dcp_load_reads_it(runs: Any, run: str) -> None:
    """Issue 32: a step whose files are the step before's (an FSDP2 save on 2 ranks with a frozen
    embedding, the first step deleted) restores on 1 rank and on 4 bit for bit, by nbckpt and by
    a plain ``dcp.load`` of the same step, and the two agree."""
    for rank, seen in runs["at 2"].items():
        assert seen["incremental_reshard"]["shared"], (rank, seen["incremental_reshard"])
    for rank, seen in runs[run].items():
        assert seen["incremental_reshard"] == {"nbckpt": True, "dcp.load": True, "same": True}, rank


def test_a_step_rank_0s_retention_deleted_is_gone_on_every_rank(runs: Any) -> None:
    """Every rank said has_step True for a step rank 0's keep=1 had deleted (rank 0 until its
    saver heard, rank 1 for ever), and warned that a save of it again replaced it."""
    for rank, seen in runs["at 2"].items():
        assert seen["retained"] == {"has_step": [False, False, True], "warned": []}, (rank, seen["retained"])
