"""nbckpt.analysis (the advisor): interval formulas against values worked out by hand, and the costs
it takes from a bench run on many ranks (the fixtures of tests/data: real torchrun runs)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from helpers import ROOT

from nbckpt import ConfigError, SaveSchedule
from nbckpt.analysis import (
    DEFAULTS,
    advise,
    checkpoint_gb,
    compare_modes,
    expected_waste,
    read_jobs,
    young_daly_interval,
)
from nbckpt.analysis._costs import measurements
from nbckpt.analysis._interval import ADVICE_COLUMNS, MTBF_SOURCE, job_mtbf_s, waste_curve
from nbckpt.bench import Comparison

DATA = ROOT / "tests" / "data"
ONE, TWO = DATA / "bench_job_1rank.json", DATA / "bench_job_2ranks.json"


def test_young_interval_is_sqrt_2cm() -> None:
    # C = 50 s, M = 10000 s: sqrt(2 * 50 * 10000) = sqrt(1e6) = 1000 s
    assert young_daly_interval(50.0, 10_000.0, method="young") == pytest.approx(1000.0)


def test_daly_interval_higher_order() -> None:
    # sqrt(C/2M) = sqrt(50/20000) = 0.05; C/18M = 50/180000 = 0.000277...
    # 1000 * (1 + 0.05/3 + 0.000277...) - 50 = 1016.9444... - 50 = 966.9444...
    assert young_daly_interval(50.0, 10_000.0) == pytest.approx(966.94444, rel=1e-6)


def test_daly_interval_is_mtbf_when_cost_exceeds_twice_mtbf() -> None:
    assert young_daly_interval(300.0, 100.0) == 100.0
    assert young_daly_interval(0.0, 100.0) == 0.0


@pytest.mark.parametrize(
    ("cost", "mtbf", "method", "match"),
    [
        (-1.0, 100.0, "daly", "cost"),
        (math.nan, 100.0, "daly", "cost"),
        (1.0, 0.0, "daly", "MTBF"),
        (1.0, 100.0, "weibull", "method"),
    ],
)
def test_interval_rejects_bad_input(cost: float, mtbf: float, method: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        young_daly_interval(cost, mtbf, method)


def test_expected_waste_terms() -> None:
    # C/tau + (tau/2 + lag + R)/M = 50/1000 + (500 + 20 + 30)/10000 = 0.05 + 0.055
    assert expected_waste(1000.0, 50.0, 10_000.0, lag_s=20.0, restore_s=30.0) == pytest.approx(0.105)


def test_expected_waste_is_capped_at_everything_lost() -> None:
    assert expected_waste(10.0, 50.0, 10.0) == 1.0


def test_young_interval_minimises_waste() -> None:
    best = young_daly_interval(50.0, 10_000.0, method="young")
    at_best = expected_waste(best, 50.0, 10_000.0)
    assert at_best < expected_waste(best * 0.9, 50.0, 10_000.0)
    assert at_best < expected_waste(best * 1.1, 50.0, 10_000.0)


def test_advise_takes_the_job_mtbf_from_the_engine_unless_given() -> None:
    """One failure model: the engine's fit (7.9 h at 1,024 GPUs), the schedule's too."""
    fitted = advise({"sync": (50.0, 0.0)}, gpus=1024)
    assert fitted["job_mtbf_h"].iloc[0] == pytest.approx(7.9) == job_mtbf_s(1024) / 3600
    assert fitted.attrs["mtbf_source"] == MTBF_SOURCE and fitted.attrs["job_mtbf_hours"] == pytest.approx(7.9)
    assert SaveSchedule(gpus=1024).mtbf_s == job_mtbf_s(1024)
    given = advise({"sync": (50.0, 0.0)}, gpus=1024, job_mtbf_hours=3.0)
    assert given["job_mtbf_h"].iloc[0] == 3.0 and given.attrs["mtbf_source"] == "given"
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ConfigError, match="job_mtbf_hours"):
            advise({"sync": (50.0, 0.0)}, job_mtbf_hours=bad)


def test_advise_young_by_hand() -> None:
    # job MTBF 10 h = 36000 s
    advice = advise(
        {"sync": (50.0, 40.0), "async": (2.0, 600.0)}, job_mtbf_hours=10.0, gpus=32, method="young"
    ).set_index("strategy")
    assert list(advice.reset_index().columns) == ADVICE_COLUMNS
    sync, asynchronous = advice.loc["sync"], advice.loc["async"]
    # sync: persists inside its stall, so nothing lags; tau = sqrt(2 * 50 * 36000) = 1897.367 s
    assert sync["mode"] == "sync" and sync["lag_s"] == 0.0
    assert sync["interval_s"] == pytest.approx(1897.3666)
    # at Young's optimum both terms equal sqrt(C / 2M) = sqrt(50 / 72000) = 0.0263523
    assert sync["checkpoint_pct"] == pytest.approx(2.63523, rel=1e-5)
    assert sync["waste_pct"] == pytest.approx(5.27046, rel=1e-5)
    # 0.0527046 * 32 GPUs * 24 h = 40.4771 GPU-hours per day
    assert sync["gpu_hours_lost_per_day"] == pytest.approx(40.4771, rel=1e-5)
    # 86400 / (1897.367 + 50) = 44.368 checkpoints per day
    assert sync["checkpoints_per_day"] == pytest.approx(44.3679, rel=1e-5)
    assert sync["bound"] == "young"
    # async: Young gives sqrt(2 * 2 * 36000) = 379.5 s, but a save persists for 600 s, so 600 s
    assert asynchronous["mode"] == "async" and asynchronous["lag_s"] == 600.0
    assert asynchronous["interval_s"] == 600.0 and asynchronous["bound"] == "persist"
    # 2/600 + (300 + 600)/36000 = 0.0033333 + 0.025 = 0.0283333
    assert asynchronous["waste_pct"] == pytest.approx(2.83333, rel=1e-5)
    assert asynchronous["gpu_hours_lost_per_day"] == pytest.approx(0.0283333 * 32 * 24, rel=1e-5)
    assert advice.attrs["gpus"] == 32


def test_advise_daly_with_restore() -> None:
    advice = advise({"sync": (50.0, 0.0)}, job_mtbf_hours=10.0, gpus=8, restore_s=120.0)
    row = advice.iloc[0]
    young = math.sqrt(2 * 50 * 36_000)
    tau = young * (1 + math.sqrt(50 / 72_000) / 3 + 50 / (18 * 36_000)) - 50
    assert row["interval_s"] == pytest.approx(tau)
    assert row["waste_pct"] == pytest.approx(100 * (50 / tau + (tau / 2 + 120) / 36_000))
    assert row["rework_pct"] == pytest.approx(100 * (tau / 2) / 36_000)
    assert row["restore_pct"] == pytest.approx(100 * 120 / 36_000)  # the same for every strategy
    assert row["checkpoint_pct"] + row["drag_pct"] + row["rework_pct"] + row["restore_pct"] == pytest.approx(
        row["waste_pct"]
    )


def test_advise_counts_the_drag_of_the_background_write_and_the_storage_duty() -> None:
    # job MTBF 10 h = 36000 s. The async save stalls 1 s, drags training by
    # 3 s per checkpoint and takes 100 s to persist: cost C = 1 + 3 = 4 s;
    # Young: sqrt(2 * 4 * 36000) = 536.66 s (> the 100 s lag, so Young sets it)
    advice = advise({"async": (1.0, 100.0, 3.0)}, job_mtbf_hours=10.0, gpus=8, method="young")
    row = advice.iloc[0]
    tau = math.sqrt(2 * 4 * 36_000)
    assert row["cost_s"] == 4.0 and row["drag_s"] == 3.0 and row["bound"] == "young"
    assert row["interval_s"] == pytest.approx(tau)
    assert row["checkpoint_pct"] == pytest.approx(100 * 1 / tau)
    assert row["drag_pct"] == pytest.approx(100 * 3 / tau)
    # rework: half an interval plus the 100 s lag per failure
    assert row["rework_pct"] == pytest.approx(100 * (tau / 2 + 100) / 36_000)
    # the storage writes 100 s of every tau + 1 s: 100 / 537.66 = 18.6 %
    assert row["storage_duty_pct"] == pytest.approx(100 * 100 / (tau + 1.0))
    without_drag = advise({"async": (1.0, 100.0)}, job_mtbf_hours=10.0, gpus=8, method="young")
    assert without_drag["waste_pct"].iloc[0] < row["waste_pct"]  # drag is not free


def test_compare_modes_says_why_async_loses_when_it_does() -> None:
    # async: 0.1 s stall but 2 s of drag and a 600 s lag; sync: 1 s stall, nothing behind it
    advice = advise(
        {"slow-sync": (1.0, 1.0), "fast-async": (0.1, 600.0, 2.0)},
        job_mtbf_hours=10.0,
        gpus=64,
        restore_s=120.0,
    )
    rows = advice.set_index("strategy")
    assert rows.loc["fast-async", "waste_pct"] > rows.loc["slow-sync", "waste_pct"]
    [sentence] = compare_modes(advice)
    assert sentence.startswith("fast-async (async) loses")
    assert "more than slow-sync (sync)" in sentence
    assert "costs more than the stall it hides" in sentence
    assert f"{rows.loc['fast-async', 'restore_pct']:.3f} %" in sentence
    assert compare_modes(advice[advice["mode"] == "sync"]) == []


def test_measurements_from_results_frame() -> None:
    results = pd.DataFrame(
        {
            "strategy": ["none", "torch-save", "nbckpt-async"],
            "checkpoints": [0, 4, 4],
            "stall_mean_s": [math.nan, 0.75, 0.06],
            "persist_s": [math.nan, 0.70, 1.0],
        }
    )
    costs = measurements(results)
    assert costs["strategy"].tolist() == ["torch-save", "nbckpt-async"]
    assert costs["mode"].tolist() == ["sync", "async"]
    assert costs["lag_s"].tolist() == [0.0, 1.0]


def test_measurements_mode_column_overrides_inference() -> None:
    results = pd.DataFrame({"strategy": ["a"], "stall_s": [1.0], "persist_s": [0.5], "mode": ["async"]})
    assert measurements(results)["lag_s"].tolist() == [0.5]


@pytest.mark.parametrize(
    ("results", "match"),
    [
        (pd.DataFrame({"strategy": ["a"]}), "stall_mean_s"),
        (pd.DataFrame({"strategy": ["none"], "stall_mean_s": [0.0]}), "no strategy"),
        (pd.DataFrame({"strategy": ["a"], "stall_mean_s": [-1.0]}), ">= 0"),
    ],
)
def test_measurements_reject_bad_results(results: pd.DataFrame, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        measurements(results)


def test_waste_curve_matches_expected_waste() -> None:
    advice = advise({"sync": (50.0, 0.0)}, job_mtbf_hours=10.0, gpus=8)
    curve = waste_curve(advice, intervals=[600.0, 1200.0])
    # 50/600 + 300/36000 = 0.0916667 ; 50/1200 + 600/36000 = 0.0583333
    assert curve["waste_pct"].tolist() == pytest.approx([9.16667, 5.83333], rel=1e-5)
    default = waste_curve(advice)
    assert len(default) == 120
    assert default["interval_s"].min() < advice["interval_s"].iloc[0] < default["interval_s"].max()


def test_checkpoint_size_helpers() -> None:
    # 7e9 parameters * 16 bytes = 112 GB
    assert checkpoint_gb(7e9) == pytest.approx(112.0)


def test_the_shared_defaults_take_the_job_mtbf_from_its_size() -> None:
    assert DEFAULTS.job_mtbf_hours is None and DEFAULTS.gpus == 1024


def test_report_and_notebook_07_state_the_same_advisor_defaults() -> None:
    import papermill

    notebooks = ROOT / "notebooks"
    for name in ("report.ipynb", "07_interval_and_scale.ipynb"):
        declared = papermill.inspect_notebook(str(notebooks / name))
        for key, value in DEFAULTS.to_dict().items():
            if key in declared:
                assert str(value) == declared[key]["default"].strip("\"'"), (name, key)
        assert {"job_mtbf_hours", "gpus", "restore_s"} <= set(declared), name


def _job(comparison: Comparison, strategy: str) -> dict[str, object]:
    return next(row for row in comparison.job["strategies"] if row["strategy"] == strategy)


def test_advise_takes_its_costs_from_the_run_of_the_jobs_size_and_says_so() -> None:
    one, two = runs = read_jobs([ONE, TWO])
    advice = advise(runs, job_mtbf_hours=1000.0, gpus=2).set_index("strategy")
    assert advice.attrs["measured_ranks"] == 2 and advice.attrs["job_size_measured"]
    assert advice.attrs["costs_from"].startswith("costs measured on 2 ranks on 1 host (")
    assert advice.attrs["costs_from"].endswith("the job's size")
    for name in ("dcp-sync", "nbckpt-async"):
        job = _job(two, name)
        # The job waits for its slowest rank (rank 1's saves were made 0.2 s late): the longest
        # stall of any rank, not rank 0's; and a save is durable when the last rank's write is.
        assert advice.loc[name, "stall_s"] == job["stall_s"]["max"] > 0.2  # type: ignore[index]
        assert advice.loc[name, "stall_s"] > two.results.set_index("strategy").loc[name, "stall_mean_s"]
        assert advice.loc[name, "persist_s"] == job["time_to_durable_s"]
    # A built-in strategy's mode is its own, whatever its figures: the async write's lag counts.
    assert advice.loc["dcp-sync", "mode"] == "sync" and advice.loc["dcp-sync", "lag_s"] == 0.0
    assert advice.loc["nbckpt-async", "mode"] == "async"
    assert advice.loc["nbckpt-async", "lag_s"] == _job(two, "nbckpt-async")["time_to_durable_s"]
    alone = advise(runs, job_mtbf_hours=1000.0, gpus=1).set_index("strategy")
    assert alone.attrs["measured_ranks"] == 1
    assert alone.loc["dcp-sync", "stall_s"] == _job(one, "dcp-sync")["stall_s"]["max"]  # type: ignore[index]


def test_advise_for_a_size_not_measured_takes_the_largest_run_and_says_what_is_missing() -> None:
    advice = advise(read_jobs([TWO, ONE]), job_mtbf_hours=1000.0, gpus=1024)
    assert advice.attrs["measured_ranks"] == 2 and not advice.attrs["job_size_measured"]
    assert "the job's 1,024 GPUs were not measured (runs of 1, 2 ranks given)" in advice.attrs["costs_from"]
    assert "contention beyond it is not in them" in advice.attrs["costs_from"]
    (single,) = read_jobs([TWO])
    assert advise(single, job_mtbf_hours=1000.0, gpus=2).attrs["measured_ranks"] == 2  # one run, no list
    table = advise({"sync": (1.0, 1.0)}, job_mtbf_hours=1000.0)
    assert table.attrs["costs_from"].startswith("costs from the results table given: one rank's")
    with pytest.raises(ConfigError, match="give advise"):
        advise([single, "x"], job_mtbf_hours=1000.0)  # type: ignore[list-item]


def test_a_drag_that_is_noise_counts_as_zero_and_a_measured_one_as_measured() -> None:
    """The report's table showed drag -0.18 s for the sync strategies and the advisor 0, with no
    word why: now the table says "noise" where the interval contains 0, and the advisor counts
    exactly those (and any drag below 0) as 0."""
    from nbckpt.bench import _internal as bench

    results = pd.DataFrame(
        {
            "strategy": ["torch-save", "nbckpt-async", "nbckpt-sync"],
            "stall_mean_s": [0.5, 0.01, 0.4],
            "persist_s": [0.5, 0.4, 0.4],
            "drag_s": [-0.18, 0.05, 0.02],
            "checkpoints": [2, 2, 2],
            "drag_ci_s": [[-0.4, 0.05], [0.03, 0.07], [-0.01, 0.05]],
        }
    )
    costs = measurements(results).set_index("strategy")["drag_s"]
    assert costs.to_dict() == {"torch-save": 0.0, "nbckpt-async": 0.05, "nbckpt-sync": 0.0}
    assert bench.drag_text(results.iloc[0].to_dict()).startswith("noise (-0.1800 s")
    older = results.drop(columns=["drag_ci_s"])  # without intervals: only below 0 is clipped
    assert measurements(older).set_index("strategy")["drag_s"].to_dict() == {
        "torch-save": 0.0,
        "nbckpt-async": 0.05,
        "nbckpt-sync": 0.02,
    }
