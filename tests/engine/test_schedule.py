"""The save schedule's interval: Young/Daly from this run's costs, never faster than the write."""

from __future__ import annotations

import math

import pytest

from nbckpt import ConfigError
from nbckpt.engine._schedule import JOB_MTTF_H, Costs, SaveSchedule, job_mtbf_s


def test_the_job_mtbf_goes_through_metas_published_points() -> None:
    for gpus, hours in JOB_MTTF_H:
        assert job_mtbf_s(gpus) == pytest.approx(hours * 3600.0)
    # between them on log-log axes, beyond them along the nearest segment: fewer GPUs fail less
    assert JOB_MTTF_H[1][1] * 3600 < job_mtbf_s(4096) < JOB_MTTF_H[0][1] * 3600
    assert job_mtbf_s(64) > job_mtbf_s(1024) and job_mtbf_s(262144) < job_mtbf_s(131072)


def test_a_costlier_save_lengthens_the_interval() -> None:
    schedule = SaveSchedule("8h")
    cheap = schedule.interval(Costs(stall_s=0.1, drag_s=0.0, persist_s=1.0, restore_s=5.0))
    costly = schedule.interval(Costs(stall_s=2.0, drag_s=0.5, persist_s=1.0, restore_s=5.0))
    assert cheap.bound == costly.bound == "daly"
    assert costly.seconds > cheap.seconds
    assert cheap.seconds == pytest.approx(math.sqrt(2 * 0.1 * 8 * 3600), rel=0.01)
    assert cheap.reason.startswith("save every ") and "an MTBF of 8 h" in cheap.reason


def test_the_interval_never_outruns_the_background_write() -> None:
    schedule = SaveSchedule(600.0)  # a small job MTBF: Young/Daly would save every 11 s
    advised = schedule.interval(Costs(stall_s=0.1, drag_s=0.0, persist_s=30.0, restore_s=0.0))
    assert advised.seconds == 30.0 and advised.bound == "persist"
    assert "faster than one save in flight can persist" in advised.reason


def test_a_job_size_names_its_source() -> None:
    advised = SaveSchedule(gpus=16384).interval(Costs(0.5, 0.0, 1.0, 1.0))
    assert "16,384 GPUs" in advised.reason and "HPCA 2025" in advised.reason


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [((), {}, "needs one of mtbf"), (("8h",), {"gpus": 8}, "needs one of mtbf"),
     (("soon",), {}, "mtbf must be"), ((), {"gpus": 0}, "gpus"), ((-1.0,), {}, "mtbf must be")],
)
def test_bad_schedules_are_one_line(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        SaveSchedule(*args, **kwargs)  # type: ignore[arg-type]
