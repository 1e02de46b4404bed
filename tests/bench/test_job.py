"""The job's figures from per-rank records (``nbckpt.bench._job``): pure, no processes."""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest
import torch

from nbckpt.bench._job import job_summary, job_text, straggler

S = 1_000_000_000  # ns per second


def _rank(
    rank: int,
    host: str,
    stall: float,
    overhead: float,
    spans: list[tuple[int, int, int]],
    floor: tuple[int, int, int],
) -> dict[str, Any]:
    return {
        "rank": rank,
        "host": host,
        "strategies": [
            {
                "strategy": "none",
                "stall_s": 0.0,
                "persist_s": math.nan,
                "bytes": 0,
                "write_gbs": math.nan,
                "mean_step_s": 0.1,
                "overhead_pct": math.nan,
                "checkpoints": 0,
            },
            {
                "strategy": "nbckpt-async",
                "stall_s": stall,
                "persist_s": 0.5,
                "bytes": 2_000,
                "write_gbs": 1.0,
                "mean_step_s": 0.11,
                "overhead_pct": overhead,
                "checkpoints": 2,
            },
        ],
        "checkpoints": [
            {
                "strategy": "nbckpt-async",
                "repeat": 0,
                "step": step,
                "start_ns": start,
                "end_ns": end,
                "bytes": 1_000,
            }
            for step, start, end in spans
        ],
        "floor_writes": [{"repeat": 0, "start_ns": floor[0], "end_ns": floor[1], "bytes": floor[2]}],
    }


def test_the_job_spans_every_rank_and_names_the_straggler_and_its_host() -> None:
    records = [
        # out of order on purpose: rank 0 is gathered first in practice, but not required
        _rank(2, "b", 0.9, 12.0, [(5, 1 * S, 3 * S), (10, 10 * S, 11 * S)], (0, 2 * S, 4_000)),
        _rank(0, "a", 0.1, 2.0, [(5, 2 * S, 4 * S), (10, 10 * S, 12 * S)], (0, 1 * S, 4_000)),
        _rank(1, "a", 0.2, 3.0, [(5, 2 * S, 5 * S), (10, 11 * S, 12 * S)], (1 * S, 2 * S, 4_000)),
    ]
    rows, job = job_summary(records)
    assert [(row["rank"], row["host"], row["strategy"]) for row in rows][:3] == [
        (0, "a", "none"),
        (0, "a", "nbckpt-async"),
        (1, "a", "none"),
    ]
    assert job["world_size"] == 3
    assert job["hosts"] == {"a": [0, 1], "b": [2]}
    # All three wrote 4000 bytes from 0 s to 2 s: 12000 bytes in 2 s.
    assert job["floors"]["concurrent_write_gbs"] == pytest.approx(12_000 / 2 / 1e9)
    none, ours = job["strategies"]
    assert none["straggler"] is None and math.isnan(none["overhead_pct"])
    assert ours["overhead_pct"] == 12.0 and ours["slowest_rank"] == 2
    assert ours["stall_s"]["median"] == pytest.approx(0.2)
    assert ours["stall_s"]["max"] == pytest.approx(0.9)
    assert 0.2 < ours["stall_s"]["p99"] <= 0.9
    assert ours["straggler"]["rank"] == 2 and ours["straggler"]["host"] == "b"
    assert ours["straggler"]["over_median_s"] == pytest.approx(0.7)
    assert ours["straggler"]["over_median_ratio"] == pytest.approx(4.5)
    first, second = ours["checkpoints"]
    # Step 5: rank 2 starts at 1 s, rank 1 ends at 5 s: 4 s to durable, 3000 bytes over it.
    assert (first["time_to_durable_s"], first["first_rank"], first["last_rank"]) == (4.0, 2, 1)
    assert first["bytes"] == 3_000 and first["ranks_writing"] == 3
    assert first["aggregate_write_gbs"] == pytest.approx(3_000 / 4 / 1e9)
    assert first["start_spread_s"] == 1.0
    assert second["time_to_durable_s"] == 2.0
    assert ours["time_to_durable_s"] == pytest.approx(3.0)


def test_a_rank_that_writes_nothing_adds_no_span_and_a_tie_names_no_straggler() -> None:
    # torch-save on many ranks: rank 0 alone writes the replicated state.
    records = [_rank(0, "a", 0.3, 5.0, [(5, 0, 2 * S)], (0, S, 10)), _rank(1, "a", 0.3, 5.0, [], (0, S, 10))]
    _, job = job_summary(records)
    (row,) = job["strategies"][1]["checkpoints"]
    assert row["ranks_writing"] == 1 and row["bytes"] == 1_000
    assert job["strategies"][1]["straggler"] is None  # every rank alike: nobody straggles
    assert straggler({}, {}) is None and straggler({0: 0.5}, {0: "h"}) is None
    assert straggler({0: 0.2, 1: 0.2, 2: 0.5, 3: 0.5}, {})["rank"] == 2  # a tie: the lowest rank


def test_the_aggregate_persist_rate_counts_from_the_first_write_not_the_first_copy() -> None:
    records = [_rank(rank, "a", 0.1, 2.0, [(5, 0, 3 * S)], (0, S, 10)) for rank in (0, 1)]
    # Rank 0 copied from 0 s and began writing at 1 s; rank 1 began writing at 2 s; both done by 3 s.
    for record, write_start in zip(records, (1 * S, 2 * S), strict=True):
        record["checkpoints"][0]["persist_start_ns"] = write_start
    _, job = job_summary(records)
    ours = job["strategies"][1]
    (row,) = ours["checkpoints"]
    assert row["aggregate_write_gbs"] == pytest.approx(2_000 / 3 / 1e9)  # copies included
    assert row["aggregate_persist_gbs"] == pytest.approx(2_000 / 2 / 1e9) == ours["aggregate_persist_gbs"]
    # A strategy that records no write of its own: no persist rate, the rest as before.
    _, without = job_summary([_rank(0, "a", 0.1, 2.0, [(5, 0, 3 * S)], (0, S, 10))])
    assert math.isnan(without["strategies"][1]["aggregate_persist_gbs"])


def test_the_jobs_time_to_durable_and_aggregate_rate_have_their_interval_over_repeats() -> None:
    # Two ranks, three repeats of two checkpoints: each repeat's checkpoints take 2, 4 and 3 s to
    # durable (1000 bytes from each rank), both checkpoints of a repeat alike.
    records = [_rank(rank, "a", 0.1, 2.0, [], (0, S, 10)) for rank in (0, 1)]
    for record in records:
        record["checkpoints"] = [
            {"strategy": "nbckpt-async", "repeat": repeat, "step": step, "bytes": 1_000}
            | {"start_ns": 100 * S * repeat, "end_ns": 100 * S * repeat + seconds * S}
            for repeat, seconds in enumerate((2, 4, 3))
            for step in (5, 10)
        ]
    _, job = job_summary(records)
    ours = job["strategies"][1]
    # In log space (times and rates are positive): t(0.975, 2 df) x the logs' deviation / sqrt(3).
    logs = [math.log(seconds) for seconds in (2, 4, 3)]
    centre, half = sum(logs) / 3, 4.303 * statistics.stdev(logs) / math.sqrt(3)
    lo, hi = ours["time_to_durable_ci_s"]
    assert (lo, hi) == pytest.approx((math.exp(centre - half), math.exp(centre + half)), rel=1e-3)
    # The rate is the same bytes over those times: its interval is the times' upside down.
    rate_lo, rate_hi = ours["aggregate_write_ci_gbs"]
    assert (rate_lo, rate_hi) == pytest.approx((2_000 / hi / 1e9, 2_000 / lo / 1e9), rel=1e-9)
    assert 0 < lo < 2 and hi > 4  # wide with three repeats, never below zero
    assert f"time to durable 3.000 s [{lo:.3f}, {hi:.3f}] s over repeats" in "\n".join(job_text(job))
    # One repeat: no interval, and the line says none.
    _, once = job_summary([_rank(0, "a", 0.1, 2.0, [(5, 0, 3 * S)], (0, S, 10))])
    assert all(math.isnan(value) for value in once["strategies"][1]["aggregate_write_ci_gbs"])
    assert "over repeats" not in "\n".join(job_text(once))


def test_the_floors_rate_intervals_are_in_log_space_and_never_below_zero() -> None:
    # Three raw writes of 1 GB beside training, in 5, 2 and 0.25 s (0.2, 0.5 and 4 GB/s); the
    # concurrent raw write between turns the same over three repeats. A t-interval of the rates
    # themselves reached below 0 ([-3.68, 6.82] GB/s here); the strategies' are taken in log space.
    record = _rank(0, "a", 0.1, 2.0, [], (0, 5 * S, 1_000_000_000))
    record["floor_writes"] += [
        {"repeat": repeat, "start_ns": 0, "end_ns": seconds, "bytes": 1_000_000_000}
        for repeat, seconds in ((1, 2 * S), (2, S // 4))
    ]
    record["floor_beside_writes"] = [
        {"repeat": 0, "step": step, "start_ns": 0, "persist_start_ns": 0, "end_ns": seconds}
        | {"strategy": "raw-write-beside-training", "bytes": 1_000_000_000}
        for step, seconds in ((2, 5 * S), (4, 2 * S), (6, S // 4))
    ]
    _, job = job_summary([record])
    logs = [math.log(rate) for rate in (0.2, 0.5, 4.0)]
    centre, half = statistics.mean(logs), 4.303 * statistics.stdev(logs) / math.sqrt(3)
    expected = [math.exp(centre), math.exp(centre - half), math.exp(centre + half)]
    floors = job["floors"]
    beside, between = floors["beside_training"]["write_gbs_interval"], floors["concurrent_write_gbs_interval"]
    for interval in (beside, between):
        assert interval == pytest.approx(expected, rel=1e-3)
        assert 0 < interval[1] < 0.2 and interval[2] > 4.0  # wide with three, never below zero
    # One write: its rate, no interval.
    _, once = job_summary([_rank(0, "a", 0.1, 2.0, [], (0, 2 * S, 1_000_000_000))])
    mean, lo, hi = once["floors"]["concurrent_write_gbs_interval"]
    assert mean == pytest.approx(0.5) and math.isnan(lo) and math.isnan(hi)


def _load(cpus: int, own_cpu_s: float, other: float, loadavg: float) -> dict[str, Any]:
    """One rank's load over a 10 s comparison, as ``Load.to_dict`` records it."""
    return {
        "cpus": cpus,
        "wall_s": 10.0,
        "own_cpu_s": own_cpu_s,
        "other_cpu_cores": other,
        "steal_pct": 0.0,
        "loadavg_1m_start": loadavg - 1,
        "loadavg_1m": loadavg,
        "high": False,
    }


def _measured(rank: int, host: str, copy_gbs: float, load: dict[str, Any]) -> dict[str, Any]:
    """A record with the copy floor and the load this rank measured (its raw write: 4000 bytes
    in 1 s, then in 2 s)."""
    record = _rank(rank, host, 0.1, 1.0, [], (0, S, 4_000))
    record["floor_writes"].append({"repeat": 1, "start_ns": 5 * S, "end_ns": 7 * S, "bytes": 4_000})
    copy = {"bytes": 8_000, "copy_s": 8_000 / copy_gbs / 1e9, "copy_gbs": copy_gbs}
    return {**record, "copy_floor": {**copy, "copy_gbs_by_repeat": [copy_gbs / 2, copy_gbs]}, "load": load}


def test_every_ranks_floors_and_every_hosts_load_measured_in_the_same_run() -> None:
    # Host a: ranks 0 and 1 on 8 cores, each using 1 core of its own; each sees the other's
    # core among "other processes'", beside 0.5 core of work that is not the job's.
    records = [
        _measured(1, "a", 2.0, _load(8, own_cpu_s=10.0, other=1.5, loadavg=3.0)),
        _measured(0, "a", 4.0, _load(8, own_cpu_s=10.0, other=1.5, loadavg=2.5)),
        _measured(2, "b", 3.0, _load(4, own_cpu_s=20.0, other=0.0, loadavg=9.0)),
    ]
    _, job = job_summary(records)
    by_rank = job["floors"]["by_rank"]
    assert [(row["rank"], row["host"]) for row in by_rank] == [(0, "a"), (1, "a"), (2, "b")]
    for row, copy in zip(by_rank, (4.0, 2.0, 3.0), strict=True):
        # Each rank's fastest copy and its fastest raw write while every rank wrote at once.
        assert row["copy_gbs"] == copy and row["copy_gbs_by_repeat"] == [copy / 2, copy]
        assert row["copy_s"] == pytest.approx(8_000 / copy / 1e9) and row["bytes"] == 8_000
        assert row["concurrent_write_gbs"] == pytest.approx(4_000 / 1e9)
    loads = job["load_by_host"]
    assert set(loads) == {"a", "b"} and loads["a"]["ranks"] == [0, 1] and loads["b"]["ranks"] == [2]
    a, b = loads["a"], loads["b"]
    assert (a["cpus"], a["loadavg_1m_start"], a["loadavg_1m"]) == (8, 2.0, 3.0)  # the busiest reading
    assert a["own_cpu_s"] == 20.0  # the host's ranks together
    # The machine was busy 2.5 cores (each rank: 1 own + 1.5 other); 2 of them the job's ranks.
    assert a["other_cpu_cores"] == pytest.approx(0.5) and a["high"] is False
    # 9 queued on 4 cores, 2 of them the rank's own: the load was high.
    assert (b["cpus"], b["loadavg_1m"], b["high"]) == (4, 9.0, True)
    text = "\n".join(job_text(job))
    assert "copy floor per rank 2.0-4.0 GB/s" in text
    assert "host a (ranks 0, 1): 1-minute load average 3.0 on 8 cores" in text
    # A record without them (an older rank, a run stopped before its floors): no row, no host.
    _, bare = job_summary([_rank(0, "a", 0.1, 2.0, [], (0, S, 10))])
    assert math.isnan(bare["floors"]["by_rank"][0]["copy_gbs"]) and bare["load_by_host"] == {}


def test_a_rank_holds_a_gpt_replicated_and_any_other_state_under_keys_of_its_own() -> None:
    from nbckpt.bench._rank_workload import RankWorkload
    from nbckpt.bench._workloads import gpt, synthetic

    replicated = RankWorkload(gpt("tiny"), rank=1, world_size=2)
    own = RankWorkload(synthetic(0.25, compute_ms=0), rank=1, world_size=2)
    assert replicated.replicated and not own.replicated
    assert replicated.share_bytes == -(-replicated.nbytes // 2) and own.share_bytes == own.nbytes
    own.build()
    own.step = 3  # the runner sets the step it trains next
    own.train_step()
    state = own.state()
    assert list(state["model"]) == ["rank1"] and state["step"] == own.inner.step == 4
    assert "own state on each of 2 ranks" in own.describe()
    assert "replicated (DDP-like) on 2 ranks" in replicated.describe()


def test_every_ranks_step_syncs_its_gradients_before_the_update_as_data_parallelism_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DDP all-reduces the replicated GPT's gradients (averaged) after backward; each rank's own
    state stands for a data-parallel job's with a small all-reduce: both before the update (where
    an overlapped save's copy is waited for), for every strategy alike. FSDP2 syncs in backward."""
    from nbckpt.bench._rank_workload import SYNC_ELEMENTS, RankWorkload
    from nbckpt.bench._workloads import GPTWorkload, gpt, synthetic

    seen: list[Any] = []

    def all_reduce(tensor: Any) -> None:
        seen.append(tensor.numel())
        tensor.mul_(2)  # as if the other rank held the same: the average is the rank's own

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)  # torch's, not nbckpt's
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    own = RankWorkload(synthetic(0.25, compute_ms=0), rank=1, world_size=2)
    own.build()
    own.train_step(lambda: seen.append("update"))
    assert seen == [SYNC_ELEMENTS, "update"]
    seen.clear()
    replicated = RankWorkload(gpt("tiny"), rank=1, world_size=2)
    replicated.build()
    inner = replicated.inner
    assert isinstance(inner, GPTWorkload)
    grads: list[Any] = []

    def update() -> None:
        seen.append("update")
        grads.extend(p.grad.clone() for p in inner.trained() if p.grad is not None)

    replicated.train_step(update)
    assert seen == [inner.params, "update"], seen  # every gradient, one bucket
    assert all(g.abs().sum() > 0 for g in grads[:2])  # averaged back into place, not zeroed


def test_coordination_is_what_the_last_rank_spent_and_the_rest_is_each_ranks_turn_wait() -> None:
    # Three collectives on each rank, in order; at each a different rank arrived last (the least
    # time in it), the others waited for it. Rank 0 also gathered the records (0.01 s).
    spent = {0: [0.010, 0.300, 0.002], 1: [0.001, 0.002, 0.500], 2: [0.004, 0.200, 0.003]}
    records = [
        {
            **_rank(rank, "a", 0.1, 2.0, [], (0, S, 10)),
            "collectives_s": own,
            "steps_trained": 40 if rank != 1 else 50,
            **({"gather_s": 0.01} if rank == 0 else {}),
        }
        for rank, own in spent.items()
    ]
    _, job = job_summary(records[::-1])  # any order
    least = 0.001 + 0.002 + 0.002
    # The bench's own: each collective's least time, plus the gather; per step of the fewest trained.
    assert job["coordination"] == {
        "seconds": pytest.approx(least + 0.01),
        "per_step_s": pytest.approx((least + 0.01) / 40),
        "collectives": 3,
        "gather_s": pytest.approx(0.01),
    }
    # The rest of each rank's time in them is waiting for the slowest rank at the turns.
    assert job["turn_wait"] == [
        {
            "rank": rank,
            "collectives_s": pytest.approx(sum(own)),
            "seconds": pytest.approx(sum(own) - least),
            "per_step_s": pytest.approx((sum(own) - least) / 40),
        }
        for rank, own in spent.items()
    ]
    # No collectives recorded (a record of one process): nothing counted, nothing per step.
    _, without = job_summary([_rank(0, "a", 0.1, 2.0, [], (0, S, 10))])
    assert without["coordination"]["seconds"] == 0 and without["coordination"]["collectives"] == 0
    assert math.isnan(without["coordination"]["per_step_s"])
    (wait,) = without["turn_wait"]
    assert (wait["rank"], wait["seconds"], wait["collectives_s"]) == (0, 0, 0)
