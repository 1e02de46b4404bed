"""The numbers of ``nbckpt report --from`` (``nbckpt.analysis._job_report``), without processes.

The fixtures are what ``nbckpt bench`` wrote under real torchrun on CPU (tests/data/README.md
says how each was made): one rank, and two ranks with rank 1's saves made 0.2 s late.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from helpers import ROOT

from nbckpt import ConfigError
from nbckpt.analysis._job_report import (
    checkpoint_rates,
    job_conclusions,
    job_table,
    job_table_shown,
    rank_rows,
    rate_over_time,
    read_jobs,
    read_runs,
    scaling_conclusions,
    scaling_table,
    swimlanes,
)
from nbckpt.bench import Comparison

DATA = ROOT / "tests" / "data"
ONE, TWO = DATA / "bench_job_1rank.json", DATA / "bench_job_2ranks.json"
SLOW_RANK = 1


def _two_hosts() -> Comparison:
    """The 2-rank run as if rank 0 ran on host "b-node" and rank 1 on "a-node"."""
    document = json.loads(TWO.read_text())
    names = {0: "b-node", 1: "a-node"}
    for row in document["ranks"]:
        row["host"] = names[row["rank"]]
    document["job"]["hosts"] = {"a-node": [1], "b-node": [0]}
    return Comparison.from_dict(document)


def test_job_table_carries_the_json_figures_and_the_floor_ratio() -> None:
    (comparison,) = read_jobs([TWO])
    table = job_table(comparison).set_index("strategy")
    floor = comparison.job["floors"]["concurrent_write_gbs"]
    for summary in comparison.job["strategies"]:
        if not summary["checkpoints"]:
            assert summary["strategy"] not in table.index  # the baseline writes nothing
            continue
        row = table.loc[summary["strategy"]]
        assert row["aggregate_write_gbs"] == summary["aggregate_write_gbs"]
        assert row["vs_floor"] == pytest.approx(summary["aggregate_write_gbs"] / floor)
        assert row["stall_max_s"] == summary["stall_s"]["max"]
        assert row["straggler_rank"] == SLOW_RANK
        assert row["checkpoints"] == len(summary["checkpoints"])


def with_intervals(path: Path = TWO) -> Comparison:
    """``path``'s run as if measured over repeats: each strategy's intervals over them, as
    ``nbckpt bench`` writes them with 2 or more (the fixtures have one repeat: null)."""
    document = json.loads(path.read_text())
    for summary in document["job"]["strategies"]:
        if summary["checkpoints"]:
            durable, rate = summary["time_to_durable_s"], summary["aggregate_write_gbs"]
            summary["time_to_durable_ci_s"] = [0.5 * durable, 2.0 * durable]
            summary["aggregate_write_ci_gbs"] = [0.75 * rate, 1.25 * rate]
    return Comparison.from_dict(document)


def test_the_job_table_shows_the_intervals_over_repeats_where_there_are_some() -> None:
    comparison = with_intervals()
    table = job_table(comparison).set_index("strategy")
    shown = job_table_shown(table.reset_index()).set_index("strategy")
    lines = dict(zip(table.index, job_conclusions(table.reset_index()), strict=False))
    for summary in comparison.job["strategies"]:
        if not summary["checkpoints"]:
            continue
        row, name = table.loc[summary["strategy"]], summary["strategy"]
        assert [row["time_to_durable_lo_s"], row["time_to_durable_hi_s"]] == summary["time_to_durable_ci_s"]
        assert [row["aggregate_write_lo_gbs"], row["aggregate_write_hi_gbs"]] == summary[
            "aggregate_write_ci_gbs"
        ]
        lo, hi = summary["time_to_durable_ci_s"]
        assert shown.loc[name, "time_to_durable_s"] == f"{row['time_to_durable_s']:.3f} [{lo:.3f}, {hi:.3f}]"
        lo, hi = summary["aggregate_write_ci_gbs"]
        assert (
            shown.loc[name, "aggregate_write_gbs"] == f"{row['aggregate_write_gbs']:.2f} [{lo:.2f}, {hi:.2f}]"
        )
        assert f"(95 % over repeats {lo:.2f}-{hi:.2f} GB/s)" in lines[name]
        lo, hi = summary["time_to_durable_ci_s"]
        assert f"(median; 95 % over repeats {lo:.3f}-{hi:.3f} s)" in lines[name]
    assert not {"time_to_durable_lo_s", "aggregate_write_hi_gbs"} & set(shown.columns)
    # One repeat (the fixture as measured): no interval, the median alone, and no sentence of one.
    (single,) = read_jobs([TWO])
    table = job_table(single)
    assert table[["time_to_durable_lo_s", "aggregate_write_hi_gbs"]].isna().all().all()
    shown = job_table_shown(table)
    assert not shown["time_to_durable_s"].str.contains("[", regex=False).any()
    assert not any("over repeats" in line for line in job_conclusions(table))


def test_rank_rows_group_ranks_by_host_and_leave_out_the_baseline() -> None:
    rows = rank_rows(_two_hosts())
    assert list(zip(rows["host"], rows["rank"], strict=True))[::2] == [("a-node", 1), ("b-node", 0)]
    assert "none" not in set(rows["strategy"])


def test_swimlanes_give_one_lane_per_rank_grouped_by_host_on_one_clock() -> None:
    lanes = swimlanes(_two_hosts(), "nbckpt-async")
    assert list(dict.fromkeys(lanes["lane"])) == ["a-node · rank 1", "b-node · rank 0"]
    assert {"step", "stall", "stage", "persist", "commit"} <= set(lanes["kind"])
    assert lanes["start_s"].min() == 0.0 and (lanes["end_s"] >= lanes["start_s"]).all()
    # The slowed rank's stalls are at least its 0.2 s longer than the other's.
    stall = (
        lanes[lanes["kind"] == "stall"].groupby("rank")["end_s"].sum()
        - lanes[lanes["kind"] == "stall"].groupby("rank")["start_s"].sum()
    )
    assert stall[SLOW_RANK] > stall[0] + 0.2
    assert swimlanes(_two_hosts(), "no-such-strategy").empty


def test_swimlanes_are_empty_without_the_ranks_events() -> None:
    document = json.loads(TWO.read_text())
    del document["rank_timeline"]
    assert swimlanes(Comparison.from_dict(document), "nbckpt-async").empty


def test_rate_over_time_keeps_every_persisted_byte() -> None:
    lanes = swimlanes(read_jobs([TWO])[0], "nbckpt-async")
    rates = rate_over_time(lanes, bin_s=0.01)
    persisted = lanes.loc[lanes["kind"] == "persist", "bytes"].sum()
    assert persisted > 0
    assert (rates["write_gbs"] * 1e9 * 0.01).sum() == pytest.approx(persisted, rel=1e-6)
    assert rate_over_time(lanes[lanes["kind"] == "step"]).empty


def test_checkpoint_rates_list_every_checkpoint_of_every_strategy() -> None:
    (comparison,) = read_jobs([TWO])
    rates = checkpoint_rates(comparison)
    assert sorted(set(rates["strategy"])) == ["dcp-sync", "nbckpt-async"]
    assert (rates["ranks_writing"] == 2).all() and (rates["aggregate_write_gbs"] > 0).all()


def test_scaling_table_is_one_point_per_run_and_strategy_sorted_by_ranks() -> None:
    jobs = read_jobs([TWO, ONE])
    table = scaling_table(jobs, ["two", "one"])
    for _, rows in table.groupby("strategy"):
        assert rows["ranks"].tolist() == [1, 2] and rows["source"].tolist() == ["one", "two"]
    floors = {int(r): f for r, f in zip(table["ranks"], table["concurrent_floor_gbs"], strict=True)}
    assert floors == {job.job["world_size"]: job.job["floors"]["concurrent_write_gbs"] for job in jobs}


def beside_training(path: Path, write_gbs: float) -> Comparison:
    """``path``'s run as if its ranks trained on the host: the floor beside training measured
    too, at ``write_gbs`` (the fixtures predate it)."""
    document = json.loads(path.read_text())
    document["job"]["floors"]["beside_training"] = {"write_gbs": write_gbs, "checkpoints": []}
    return Comparison.from_dict(document)


def test_scaling_carries_the_floor_beside_training_where_the_runs_measured_it() -> None:
    table = scaling_table([beside_training(ONE, 0.25), beside_training(TWO, 0.5)])
    floors = table.drop_duplicates("ranks").set_index("ranks")
    assert floors["floor_beside_training_gbs"].to_dict() == {1: 0.25, 2: 0.5}
    line = scaling_conclusions(table)[0]
    idle = floors["concurrent_floor_gbs"]
    assert (
        f"{idle[1]:.2f} -> {idle[2]:.2f} GB/s with the ranks idle, 0.25 -> 0.50 GB/s beside training" in line
    )
    # Not measured (idle compute, CUDA, files from before it): NaN, and no word of it.
    table = scaling_table(read_jobs([ONE, TWO]))
    assert table["floor_beside_training_gbs"].isna().all()
    assert "beside training" not in " ".join(scaling_conclusions(table))


def test_conclusions_say_what_their_table_shows() -> None:
    table = job_table(read_jobs([TWO])[0])
    lines = job_conclusions(table)
    for row, line in zip(table.to_dict(orient="records"), lines, strict=False):
        assert line.startswith(row["strategy"])
        assert f"{row['aggregate_write_gbs']:.2f} GB/s" in line and f"{row['vs_floor']:.2f}x" in line
        assert f"straggler rank {SLOW_RANK}" in line
    best = table.loc[table["stall_max_s"].idxmin(), "strategy"]
    assert lines[-1].startswith(f"Lowest stall on the slowest rank: {best}")
    # One rank: its own stall is the median, no straggler is named.
    assert not any("straggler" in line for line in job_conclusions(job_table(read_jobs([ONE])[0])))
    # The sentence follows the numbers, not the other way round.
    doubled = table.assign(aggregate_write_gbs=table["aggregate_write_gbs"] * 2)
    assert f"{doubled['aggregate_write_gbs'].iloc[0]:.2f} GB/s" in job_conclusions(doubled)[0]
    first = table.iloc[0]
    overhead = f"overhead at the slowest rank ({first['slowest_rank']}) {first['overhead_pct']:+.1f} %"
    assert overhead in lines[0]
    unmeasured = table.assign(overhead_pct=math.nan)  # no baseline: no overhead sentence
    assert "overhead" not in job_conclusions(unmeasured)[0]


def test_scaling_conclusions_go_from_the_fewest_ranks_to_the_most() -> None:
    table = scaling_table(read_jobs([ONE, TWO]))
    lines = scaling_conclusions(table)
    assert len(lines) == table["strategy"].nunique()
    first = table[table["strategy"] == table["strategy"].iloc[0]].sort_values("ranks")
    low, high = first.iloc[0], first.iloc[-1]
    assert (
        f"measured on 1 to 2 ranks: aggregate write {low['aggregate_write_gbs']:.2f} -> "
        f"{high['aggregate_write_gbs']:.2f} GB/s" in lines[0]
    )
    assert scaling_conclusions(scaling_table(read_jobs([TWO]))) == []  # one size: no curve


def test_runs_that_are_not_one_curve_are_refused_naming_both() -> None:
    """Points of another workload, device or storage would make a curve of what was not
    measured together; a second run of one rank count would be dropped from it: refused."""
    one, two = read_jobs([ONE, TWO])
    gpt = replace(two, workload="gpt-tiny: 1.1M parameters; replicated (DDP-like) on 2 ranks")
    with pytest.raises(ConfigError) as refused:
        scaling_table([one, gpt], ["sweep.json (1 ranks)", "gpt.json"])
    assert str(refused.value) == (
        "sweep.json (1 ranks) and gpt.json are not one scaling curve: workload 'synthetic-1MiB: 1.0 MB "
        "of tensors, about 1 ms of compute per step on cpu; its own state on N ranks' against "
        "'gpt-tiny: 1.1M parameters; replicated (DDP-like) on N ranks'"
    )
    gpu = replace(two, device="cuda", environment={**two.environment, "device_name": "NVIDIA H100"})
    with pytest.raises(ConfigError, match=re.escape("device 'cpu AMD EPYC' against 'cuda NVIDIA H100'")):
        scaling_table([one, gpu])
    bucket = replace(two, directory="s3://bucket/run")
    with pytest.raises(
        ConfigError, match=re.escape("curve: storage 'a local filesystem' against 's3://bucket'")
    ):
        scaling_table([one, bucket])
    with pytest.raises(ConfigError) as refused:
        scaling_table([one, two, two], ["sweep.json (1 ranks)", "sweep.json (2 ranks)", "two.json"])
    assert str(refused.value) == (
        "sweep.json (2 ranks) and two.json both ran on 2 ranks: a scaling curve takes one run per "
        "rank count; give one of them"
    )
    # One curve: the fixtures' folders differ (/tmp/rpt/c1, /tmp/rpt/c2s) on one local filesystem.
    assert scaling_table([one, two]).attrs["measured_ranks"] == [1, 2]
    # One rank count makes no curve: each run is shown on its own, both kept.
    assert len(scaling_table([two, gpt, two])) == 3 * len(scaling_table([two]))


def test_a_sweeps_file_gives_each_of_its_sizes_and_the_curve_says_its_range(tmp_path: Path) -> None:
    sweep = tmp_path / "scaling.json"
    runs = [
        {"ranks": size, "json": "", "document": json.loads(path.read_text())}
        for size, path in ((1, ONE), (2, TWO))
    ]
    sweep.write_text(json.dumps({"schema": "nbckpt.bench.scaling/1", "sizes": [1, 2], "runs": runs}))
    found = read_runs([sweep])
    assert [source for source, _ in found] == [f"{sweep} (1 ranks)", f"{sweep} (2 ranks)"]
    assert [comparison.job["world_size"] for _, comparison in found] == [1, 2]
    table = scaling_table([comparison for _, comparison in found])
    assert table.attrs == {"measured_ranks": [1, 2], "label": "measured on 1 to 2 ranks"}
    assert scaling_table(read_jobs([TWO])).attrs["label"] == "measured on 2 ranks"
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema": "nbckpt.bench.scaling/1", "runs": []}))
    with pytest.raises(ConfigError, match=re.escape("empty.json: a sweep with no runs")):
        read_runs([empty])


def test_read_jobs_refuses_what_is_not_a_bench_on_many_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("missing.json: no such file")):
        read_jobs([TWO, tmp_path / "missing.json"])
    # A JSON that is no bench result (what nbckpt probe --json writes): named, and no advice to
    # measure again; a bench result of another version is measured again with this one.
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"target": "/tmp", "kind": "local", "runs": [{"streams": 1}]}))
    with pytest.raises(ConfigError) as refused:
        read_jobs([TWO, probe])
    assert str(refused.value) == f"--from {probe}: not a bench result (no schema, not nbckpt.bench/3): " + (
        "give what nbckpt bench --json wrote"
    )
    older = tmp_path / "older.json"
    older.write_text(json.dumps({**json.loads(TWO.read_text()), "schema": "nbckpt.bench/2"}))
    with pytest.raises(ConfigError) as refused:
        read_jobs([older])
    assert str(refused.value) == f"--from {older}: a nbckpt.bench/2 bench result, this nbckpt reads " + (
        "nbckpt.bench/3; measure again with this version of nbckpt"
    )
    single = copy.deepcopy(json.loads(TWO.read_text()))
    for key in ("ranks", "job", "rank_timeline"):
        del single[key]
    one_process = tmp_path / "one_process.json"
    one_process.write_text(json.dumps(single))
    with pytest.raises(ConfigError, match=re.escape("one_process.json: a one-process bench result")):
        read_jobs([ONE, one_process])
    with pytest.raises(ConfigError, match="names no bench result"):
        read_jobs([])


def test_fixtures_are_real_runs_small_enough_to_commit() -> None:
    for path in (ONE, TWO):
        assert path.stat().st_size < 50_000
        document = json.loads(path.read_text())
        ranks = document["job"]["world_size"]
        assert {row["rank"] for row in document["rank_timeline"]} == set(range(ranks))
        assert not math.isnan(pd.DataFrame(document["ranks"])["stall_s"].max())
