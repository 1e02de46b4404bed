"""Several ranks (gloo on CPU): torchrun round trip, and every way ranks fall out of step (items 17, 18)
and the rank-0-only saving of frameworks. No scenario may hang: each runs under a deadline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import dist_worker
from helpers.ranks import run_ranks

pytestmark = pytest.mark.timeout(300)


def test_torchrun_two_ranks_async_save_and_restore(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc_per_node",
            "2",
            dist_worker.__file__,
            str(tmp_path / "ckpt"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    for result in results:
        assert result["ok"], result
        assert result["steps"] == [2, 3]
        assert result["world_size"] == 2
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(result["files"])
        assert {"stage", "persist", "commit", "restore"} <= set(result["kinds"])
        assert result["ranks_in_timeline"] == [result["rank"]]
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == [".nbckpt.lock", "step-000002", "step-000003"]


@pytest.fixture(scope="module")
def refusal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, tuple[int, Any, str]]]:
    """The refusal scenario, run once for the tests that read it (one launch of two ranks)."""
    directory = tmp_path_factory.mktemp("refusal") / "run"
    return directory, run_ranks("refusal", directory)


def test_17_a_refusal_on_one_rank_fails_that_save_on_every_rank(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    directory, results = refusal
    failed = f"CheckpointError: save of step {{}} to {directory} failed: "
    for rank, (code, seen, err) in results.items():
        assert code == 0, err
        outcomes = seen["outcomes"]
        assert outcomes["1"] == outcomes["3"] == outcomes["7"] == "ok", seen
        # The first save plans on the caller's thread; the others have the agreed structure and
        # stage at once, the ranks agreeing on the persist thread: a refusal there fails the
        # save on every rank alike (raised by wait). Rank 1 gives its own error, the others say
        # which rank it came from.
        assert seen["caller_collectives"] == ["save", "plan"], seen
        prefix = failed.format(2) + ("rank 1: " if rank == 0 else "")
        assert outcomes["2"].startswith(f"{prefix}hook holds a builtin_function"), seen
        assert outcomes["4"].startswith(failed.format(5 if rank else 4) + "ranks are out of step"), seen
        assert outcomes["6"] == failed.format(6) + (
            "'model.bias' is a plain tensor with different values on different ranks (rank 0 vs "
            "rank 1); a plain tensor under one key is replicated and written once. Give each "
            "rank's its own key (e.g. f'model.bias.rank{rank}'), or make it a DTensor"
        ), seen
        assert seen["steps"] == [1, 3, 7, 8, 9, 12] and seen["restored"] == 12 and seen["exact"], seen
        assert seen["manifest_steps"] == {"0": 12, "1": 12}  # no rank's step-12 tree is another step's
        assert seen["temporary"] == [], seen  # each refused save's location was discarded


def test_ranks_that_do_not_share_the_run_directory_or_its_mirror_are_refused_at_open(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """Rank 1 names another run directory (each host's own /tmp looks the same): before, the
    Checkpointer opened on both ranks and the first save failed with "file not found". Now both
    ranks refuse at open in one line naming rank 1 and the paths, within the open's one exchange
    (no check-in more), and rank 0 keeps nothing: its lock is given back (the next open of that
    directory succeeds in the same process), no probe is left, rank 1's directory never made.
    A mirror rank 1 names elsewhere is refused the same way, in the mirror's open exchange."""
    directory, results = refusal
    run = f"{directory}-unshared"
    advice = (
        ": every rank must open the same one, on storage they all share (a network file system "
        "or an object store, not each host's own disk)"
    )
    for rank, (code, seen, err) in results.items():
        assert code == 0, err
        unshared = seen["unshared"]
        assert unshared["run"] == (
            f"ConfigError: rank(s) 1 do not see the run directory rank 0 opened, {run} "
            f"(rank 1 opened {run}-rank1){advice}"
        ), unshared
        assert unshared["mirror"] == (
            f"ConfigError: rank(s) 1 do not see the mirror rank 0 opened, {run}-mirror "
            f"(rank 1 opened {run}-mirror-rank1){advice}"
        ), unshared
        assert unshared["check_ins"] == ["open"], unshared
        if rank == 0:
            assert unshared["left"][run] == [".nbckpt.lock"], unshared
            assert ".nbckpt-ranks" not in unshared["left"][f"{run}-mirror"], unshared
        else:
            assert unshared["left"] == {}, unshared


def test_a_checkpointer_closed_on_every_rank_gives_its_connections_back(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """Each Checkpointer on several ranks makes two gloo groups: torch kept them, with a gloo
    connection to every other rank and a listening socket each, until the default group was
    destroyed (4 sockets more a rank for each Checkpointer on 2 ranks, growing each time a cell
    ran again). Now the ranks check in to the close, and once every rank has, each gives them
    back: after six Checkpointers opened, each with two saves in flight (max_inflight=2), and
    closed on both ranks, each rank has the sockets it had before them, and every save
    committed. A Checkpointer closed on rank 0 alone is let go of on each rank, not destroyed (no
    rank knows the other is done with it): neither close hangs or fails, and the ranks' next
    Checkpointer saves (then dropped unclosed: let go of). A close after the script destroyed
    the default group fails nothing."""
    for code, seen, err in refusal[1].values():
        assert code == 0, err
        reopened = seen["reopened"]
        assert reopened["outcomes"] == ["ok"] * (3 * 6 + 3), reopened
        assert reopened["steps"][-14:] == list(range(13, 27)), reopened
        flat = reopened["sockets"][1]  # after the refused opens (let go of, not given back)
        assert reopened["sockets"][1:] == [flat] * (1 + 1 + 6), reopened
        assert reopened["kept"] > flat, reopened
        # rank 0's upload at the close outlasting the close's deadline: given back all the same
        assert reopened["mirrored"] == {"closed": "ok", "sockets": flat}, reopened
        assert seen["late"] == "ok", seen


def test_rank_0_writing_and_the_other_ranks_reading_the_run_open_on_every_rank(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """``read_only`` on the ranks but rank 0 (rank 0 writes, the others restore): the open's
    check that every rank sees rank 0's directory took each rank's own read_only for rank 0's,
    so rank 0 failed with a TypeError and rank 1 with a ValueError; now both open."""
    for code, seen, err in refusal[1].values():
        assert code == 0, err
        assert seen["unshared"]["readers"] == "ok", seen["unshared"]


def test_17_a_ranks_caller_and_persist_threads_checking_in_at_once_never_hold_each_other_up(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """An async save agreed on the persist thread, then a sync save (SIGTERM's final one) that
    checks in on the caller's thread, each rank's two threads checking in at once in opposite
    orders: both commit on every rank. When the two check-ins shared the rank's one connection to
    the store, a thread waiting there for the other ranks kept the other thread from checking in:
    the sync save failed after the 30 s deadline ('did not come to it') and the ranks fell out
    of step (the SIGTERM test's failure under load with the fast path on)."""
    for code, seen, err in refusal[1].values():
        assert code == 0, err
        assert seen["outcomes"]["8"] == seen["outcomes"]["9"] == "ok", seen
        assert {8, 9} <= set(seen["steps"]), seen


def test_17_a_ranks_stay_in_step_after_an_async_save_fails_on_every_rank(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """An async save's writes fail on every rank; rank 0 has recorded the failure when its next
    save starts, rank 1 records it only once its next save has begun. That save raises the
    failure on both ranks alike, and the save after it commits on both. Before, rank 0 raised it
    before counting the save and rank 1 after: every later save was "out of step"."""
    directory, results = refusal
    for code, seen, err in results.values():
        assert code == 0, err
        failed = f"CheckpointError: save of step 10 to {directory} failed: "
        assert seen["outcomes"]["11"].startswith(failed) and "No space left" in seen["outcomes"]["11"], seen
        assert seen["outcomes"]["12"] == "ok", seen


def test_17_a_rank_that_misses_a_save_never_mixes_steps_and_never_hangs(tmp_path: Path) -> None:
    results = run_ranks("skip", tmp_path / "run")
    for code, seen, err in results.values():
        assert code == 0, err
        assert seen["outcomes"]["1"] == "ok"
        later = [o for step, o in seen["outcomes"].items() if step != "1" and o != "skipped"]
        # out of step at once; the last save of the rank that ran ahead finds the other gone (or,
        # still there but done saving, never coming to it)
        assert later and "ranks are out of step" in later[0], seen
        endings = ("out of step", "lost contact", "did not come to it")
        assert all(any(e in o for e in endings) for o in later), seen
        assert seen["mixed"] == [] and seen["steps"] == [1], seen


def test_17_a_rank_killed_mid_save_fails_the_others_in_bounded_time(tmp_path: Path) -> None:
    results = run_ranks("kill", tmp_path / "run")
    code1, _, _ = results[1]
    assert code1 < 0  # SIGKILL
    code0, seen, err = results[0]
    assert code0 == 0, err
    assert seen["outcome"].startswith("CheckpointError: save of step 2"), seen
    assert seen["seconds"] < 120 and seen["steps"] == [1], seen


def test_18_rank0_chooses_the_step_every_rank_restores(tmp_path: Path) -> None:
    for rank, (code, seen, err) in run_ranks("stale_listing", tmp_path / "run").items():
        assert code == 0, err
        assert seen == {"rank": rank, "restored": 3, "exact": True}


def test_rank0_only_saving_works_with_ranks_local(tmp_path: Path) -> None:
    results = run_ranks("rank0_only", tmp_path / "run")
    assert all(code == 0 for code, _, _ in results.values()), results
    assert results[0][1] == {"rank": 0, "restored": 5, "exact": True}


def test_rank0_only_without_ranks_local_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    results = run_ranks("rank0_only_auto", tmp_path / "run")
    assert all(code == 0 for code, _, _ in results.values()), results
    seen = results[0][1]
    assert seen["outcome"].startswith("ConfigError: only rank(s) 0 of 2 created this Checkpointer"), seen
    assert "ranks='local'" in seen["outcome"] and seen["seconds"] < 60


def test_a_save_called_on_one_rank_of_a_group_is_an_error_in_seconds_not_a_hang(tmp_path: Path) -> None:
    """Issue 31, item 6: nanoGPT's natural adoption (every rank a Checkpointer, ``save`` inside
    ``if master_process:``) waited in the plan's collective until the group's 30-minute timeout,
    the other rank in DDP's all-reduce. Now the saving rank is told what to do within the
    arrival deadline (3 s here), and nothing is committed. After a save by both ranks (a layout
    agreed: a save stages at once and the ranks agree on the persist thread), a save on rank 0
    alone fails in its ``wait`` the same way, and a ``delete`` on rank 0 alone is refused before it
    deletes anything (it used to delete, then fail). Then a save by both ranks commits. With
    ``max_inflight=2``, rank 0's lone save is refused after its next save was numbered: that
    save and the next, made by both ranks, commit on both."""
    results = run_ranks("save_on_rank0_only", tmp_path / "run")
    assert all(code == 0 for code, _, _ in results.values()), results
    seen = results[0][1]
    assert seen["outcome"].startswith(
        "ConfigError: rank 0 is in save of step 1, rank(s) 1 did not come to it within 3 s"
    ), seen
    assert "ranks='local'" in seen["outcome"] and seen["seconds"] < 60, seen
    assert seen["steps"] == [] and results[1][1]["steps"] == []
    assert seen["delete"].startswith("ConfigError: rank 0 is in delete"), seen
    assert seen["after_delete"] == ["step-000001"], seen
    assert "rank(s) 1 did not come to it within 3 s" in seen["agreed_outcome"], seen
    assert "ranks='local'" in seen["agreed_outcome"] and seen["agreed_seconds"] < 60, seen
    assert seen["agreed_steps"] == [1] and results[1][1]["agreed_steps"] == [1]
    # Both ranks' next save commits: the refused calls left the ranks' check-ins in step (each
    # refusal counted one check-in on rank 0 alone, and every later call failed or hung).
    assert [results[r][1]["together"] for r in (0, 1)] == ["ok", "ok"], results
    assert seen["together_steps"] == [1, 3] == results[1][1]["together_steps"]
    # With max_inflight=2, rank 0's lone save of step 2 is refused after its save of step 3 was
    # numbered: every rank still gives step 3 (and 4) the same number, and both commit (before:
    # rank 0 a save number ahead, step 3 and every later save "out of step").
    assert "rank(s) 1 did not come to it within 3 s" in seen["alone"], seen
    for rank in (0, 1):
        assert results[rank][1]["third"] == results[rank][1]["fourth"] == "ok", results
        assert results[rank][1]["inflight_steps"] == [1, 3, 4], results


def test_every_rank_saves_when_rank0s_schedule_says_so(tmp_path: Path) -> None:
    """Issue 33: ``ckpt.due()`` under torchrun: rank 1's slower steps would time the interval
    otherwise, but every rank gets rank 0's answer, so the ranks save the same steps together."""
    results = run_ranks("scheduled", tmp_path / "run")
    assert all(code == 0 for code, _, _ in results.values()), results
    saved = [seen["saved"] for _, seen, _ in results.values()]
    assert saved[0] == saved[1] and len(saved[0]) >= 3 and saved[0][0] == 1, saved
    assert results[0][1]["steps"] == saved[0]


def test_rank0_only_saving_with_rng_never_gives_two_ranks_one_stream(tmp_path: Path) -> None:
    """Issue 19, item 1: the record says whose streams they are; another rank keeps its own."""
    results = run_ranks("rng_rank0_only", tmp_path / "run")
    for rank, (code, seen, err) in results.items():
        assert code == 0, err
        assert seen["same_stream"] is False, seen  # before: both ranks drew rank 0's numbers
        if rank == 1:
            assert seen["warned"] == [
                "nbckpt: step-000001 holds the RNG streams of rank 0; rank 1 keeps its own (to resume "
                "every rank's streams, every rank saves: ranks='all')"
            ], seen
        else:
            assert seen["warned"] == [], seen


def test_every_rank_saving_resumes_each_rank_stream_exactly(tmp_path: Path) -> None:
    for code, seen, err in run_ranks("rng_every_rank", tmp_path / "run").values():
        assert code == 0, err
        assert seen == {"rank": seen["rank"], "exact": True, "apart": True}, seen


def test_a_run_dropped_while_rank_0_uploads_opens_again_on_every_rank(
    refusal: tuple[Path, dict[int, tuple[int, Any, str]]],
) -> None:
    """Rank 0 waits for its dropped Checkpointer's upload before it claims the run again; the
    other ranks wait for it at the open as long as the group's timeout_s, not the check-in's
    deadline (before: rank 1 gave up after it, then rank 0 after rank 1: the run opened nowhere)."""
    for rank, (code, seen, err) in refusal[1].items():
        assert code == 0, err
        assert seen["dropped"]["opened"] == "ok", (rank, seen["dropped"])
