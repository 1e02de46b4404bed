"""The save schedule's interval: Young/Daly from this run's costs, never faster than the write."""

from __future__ import annotations

import math
import signal
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from nbckpt import Checkpointer, CheckpointError, ConfigError, SaveRecord, SaveSchedule
from nbckpt.engine._schedule import ASK_AT_MOST, JOB_MTTF_H, Costs, Pacer, job_mtbf_s


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
    [
        ((), {}, "needs one of mtbf"),
        (("8h",), {"gpus": 8}, "needs one of mtbf"),
        (("soon",), {}, "mtbf must be"),
        ((), {"gpus": 0}, "gpus"),
        ((-1.0,), {}, "mtbf must be"),
    ],
)
def test_bad_schedules_are_one_line(
    args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        SaveSchedule(*args, **kwargs)  # type: ignore[arg-type]


def _record(stall: float, persist: float, stage: float = 0.01) -> SaveRecord:
    return SaveRecord(
        step=1,
        path="",
        bytes=1,
        stall_s=stall,
        stage_s=stage,
        persist_s=persist,
        wait_s=0.0,
        write_gbs=0.0,
        cpu_s=0.0,
    )


def _steps(pacer: Pacer, clock: list[float], step_s: float, count: int, persisting: bool = False) -> None:
    for _ in range(count):
        clock[0] += step_s
        pacer.tick(clock[0], persisting)


def test_the_pacer_saves_first_then_at_the_interval_of_the_measured_costs() -> None:
    pacer, clock = Pacer(SaveSchedule("1h")), [0.0]
    pacer.tick(clock[0], False)
    assert pacer.decide(clock[0], [], None) == (True, 1)  # the first save measures the costs
    pacer.saved(clock[0])
    _steps(pacer, clock, 0.1, 10)
    cheap = [_record(stall=0.05, persist=1.0)]
    due, ask_in = pacer.decide(clock[0], cheap, None)
    assert pacer.interval is not None and not due
    first = pacer.interval.seconds  # sqrt(2 * 0.05 * 3600) = 19 s: about 180 steps of 0.1 s left
    assert first == pytest.approx(19.0, rel=0.05) and ask_in == ASK_AT_MOST  # 180 steps left
    costly = [_record(stall=0.8, persist=1.0)] * 5  # a slower save: a longer interval
    pacer.decide(clock[0], costly, None)
    assert pacer.interval.seconds > 3 * first
    _steps(pacer, clock, 0.1, 800)
    assert pacer.decide(clock[0], costly, None) == (True, 1)


class _Ranks:
    """A group as the pacer sees it: ``pg`` None is one process; otherwise rank 0 decides."""

    def __init__(self, pg: object | None) -> None:
        self.pg, self.decisions = pg, 0

    def from_rank0(self, tag: tuple[str], run: Callable[[], tuple[bool, int]]) -> tuple[bool, int]:
        self.decisions += 1
        return run()


@pytest.mark.parametrize("ranks", [None, "a process group"])
def test_a_save_is_due_on_time_when_the_steps_slow_down(ranks: object | None) -> None:
    """Steps of 10 ms, then of 1 s after a decision: in one process the save is due at the first
    step past the interval; with ranks at most ASK_AT_MOST steps late (a count of steps ran the
    old pace for up to 1,000 steps, 1,000 s here, on a 19 s interval)."""
    clock = [0.0]
    pacer, group = Pacer(SaveSchedule("1h"), clock=lambda: clock[0]), _Ranks(ranks)
    cheap = [_record(stall=0.05, persist=1.0)]  # every 19 s
    records: list[SaveRecord] = []
    assert pacer.due(False, records, lambda: None, group)
    pacer.saved(clock[0])
    records.extend(cheap)
    for _ in range(20):  # the pace the first decisions see
        clock[0] += 0.01
        assert not pacer.due(False, records, lambda: None, group)
    assert pacer.interval is not None
    due_at = pacer.interval.seconds
    while not pacer.due(False, records, lambda: None, group):
        clock[0] += 1.0
        assert clock[0] < 10 * due_at, "the save never came due"
    late = clock[0] - due_at
    assert late < (1.0 if ranks is None else ASK_AT_MOST * 1.0 + 1.0), late
    if ranks is not None:  # and the collective was not asked at every step
        assert group.decisions < 20 + (clock[0] - 0.2) / 1.0


def test_the_pacer_measures_the_drag_of_steps_beside_a_write() -> None:
    pacer, clock = Pacer(SaveSchedule("1h")), [0.0]
    pacer.saved(clock[0])
    _steps(pacer, clock, 0.1, 10)
    _steps(pacer, clock, 0.15, 4, persisting=True)  # four steps 50 ms slower while writing
    pacer.saved(clock[0])
    _steps(pacer, clock, 0.1, 5)
    costs = pacer.costs([_record(stall=0.05, persist=0.6)], restore_s=2.0)
    assert costs.drag_s == pytest.approx(0.2) and costs.restore_s == 2.0
    assert costs.persist_s == pytest.approx(0.61)  # the copy (stage 0.01 s) and the write


def test_the_pacer_never_saves_faster_than_the_write_persists() -> None:
    pacer, clock = Pacer(SaveSchedule(60.0)), [0.0]
    pacer.saved(clock[0])
    slow_write = [_record(stall=0.01, persist=20.0)]  # Young/Daly alone: every 1.1 s
    _steps(pacer, clock, 0.5, 10, persisting=True)
    due, ask_in = pacer.decide(clock[0], slow_write, None, persisting=True)
    assert not due and ask_in == 30  # the write's 20 s, 15 s of it left: 30 steps of 0.5 s
    assert pacer.interval is not None and pacer.interval.bound == "persist"
    assert pacer.interval.seconds == pytest.approx(20.01) and pacer.interval.daly_s < 1.2
    _steps(pacer, clock, 0.5, 31, persisting=True)  # a write slower than its records said
    assert pacer.decide(clock[0], slow_write, None, persisting=True)[0] is False
    _steps(pacer, clock, 0.5, 1)  # ... durable now: the save is due at once
    assert pacer.decide(clock[0], slow_write, None, persisting=False)[0] is True


def test_due_in_a_training_loop_saves_first_and_says_why(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, mode="sync", schedule=SaveSchedule("1h")) as ckpt:
        assert ckpt.save_interval is None
        saved = [step for step in range(1, 6) if ckpt.due() and ckpt.save({"w": torch.ones(4)}, step)]
        assert saved == [1]  # then the interval (about 10 s for a sub-millisecond save) is far off
        assert ckpt.save_interval is not None and ckpt.save_interval.reason.startswith("save every ")
    with Checkpointer(tmp_path / "often", mode="sync", schedule=SaveSchedule(1e-3)) as ckpt:
        # a sync save is durable when it returns (its stall holds its write): with failures every
        # millisecond, a save is due at every step, none waiting for a write counted twice
        saved = [step for step in range(1, 9) if ckpt.due() and ckpt.save({"w": torch.ones(4)}, step)]
        interval = ckpt.save_interval
        assert interval is not None and interval.bound == "persist"
        # the pace of one save's write, the median of recent ones: within theirs, not their sum
        # (a bound on times measured by this run, not a wall-clock one: it held 1.9 ms against a
        # 3.5 ms interval once, under the whole suite's load, one save's write the slowest)
        durable = [r.wait_s + r.stage_s + r.persist_s for r in ckpt.records[1:]]
        assert min(durable) <= interval.seconds <= max(durable) and len(saved) >= 4, (
            interval,
            durable,
            saved,
        )
    with Checkpointer(tmp_path / "none") as plain, pytest.raises(ConfigError, match="needs a schedule"):
        plain.due()
    with pytest.raises(ConfigError, match="schedule must be a SaveSchedule"):
        Checkpointer(tmp_path / "bad", schedule="8h")


def test_due_after_close_raises_the_closed_error(tmp_path: Path) -> None:
    """A closed Checkpointer decides nothing (it answered from this rank alone, its ranks gone)."""
    ckpt = Checkpointer(tmp_path, mode="sync", schedule=SaveSchedule("1h"))
    assert ckpt.due()  # the first ask saves
    ckpt.close()
    with pytest.raises(CheckpointError, match=r"the Checkpointer for .* is closed"):
        ckpt.due()


def test_the_grace_window_warns_once_when_a_final_save_would_not_fit(tmp_path: Path) -> None:
    """Issue 33: save_on_signal knows its window; a run whose saves take longer is told once, as
    soon as a save shows it, and a run whose saves fit is told nothing."""
    state = {"w": torch.ones(1 << 18)}
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        with Checkpointer(tmp_path / "fits", mode="sync") as ckpt:
            ckpt.save_on_signal(lambda: None, signals=(signal.SIGUSR1,), timeout_s=25.0)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for step in (1, 2, 3):
                    ckpt.save(state, step)
        with Checkpointer(tmp_path / "tight", mode="sync") as ckpt:
            ckpt.save_on_signal(lambda: None, signals=(signal.SIGUSR1,), timeout_s=1e-6)
            ckpt.save(state, 1)
            with pytest.warns(UserWarning, match="more than the 1e-06 s save_on_signal gives it") as said:
                ckpt.save(state, 2)
                ckpt.save(state, 3)
            assert len(said) == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_final_save_logs_when_its_window_is_too_short_for_this_runs_saves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """final_save(timeout_s) checks its window against the run's measured saves before saving."""
    state = {"w": torch.ones(1 << 18)}
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save(state, 1)
        with caplog.at_level("WARNING", logger="nbckpt"):
            ckpt.final_save(lambda: (state, 2), timeout_s=60.0)
            assert not [r for r in caplog.records if "final save takes" in r.getMessage()]
            ckpt.final_save(lambda: (state, 3), timeout_s=1e-6)
        warned = [r.getMessage() for r in caplog.records if "final save takes" in r.getMessage()]
        assert len(warned) == 1 and "the 1e-06 s final_save gives it" in warned[0], warned
