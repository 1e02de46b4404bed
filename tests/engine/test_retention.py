"""Retention policies: one rule for the saver and the mirror, ``keep=3`` as the simple case."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from nbckpt import AnyOf, BestN, Checkpointer, ConfigError, CustomSteps, EveryNSteps, LatestN
from nbckpt.engine._retention import StepInfo, expired, policy_of
from nbckpt.engine._workers import Backlog, Worker


def infos(*steps: int, **metrics: list[float | None]) -> list[StepInfo]:
    return [
        StepInfo(s, {k: v[i] for k, v in metrics.items() if v[i] is not None}) for i, s in enumerate(steps)
    ]


def test_each_policy_keeps_what_it_says() -> None:
    steps = infos(0, 5, 10, 15, 20, loss=[0.9, 0.3, None, 0.3, float("nan")])
    assert LatestN(2).keep(steps) == {15, 20}
    assert EveryNSteps(10).keep(steps) == {0, 10, 20}
    # least loss: 0.3 twice (the newer first on a tie), never a step without it or with NaN
    assert BestN("loss", 1).keep(steps) == {15}
    assert BestN("loss", 3).keep(steps) == {5, 15, 0}
    assert BestN("loss", 1, mode="max").keep(steps) == {0}
    named = {5}
    assert CustomSteps(lambda: named).keep(steps) == {5}
    named.add(20)  # asked each time
    assert CustomSteps(lambda: named).keep(steps) == {5, 20}
    assert AnyOf(LatestN(1), BestN("loss", 1)).keep(steps) == {15, 20}


def test_the_step_just_committed_is_the_latest_and_never_expires_nor_a_higher_one() -> None:
    steps = infos(10, 20, 30)
    assert expired(LatestN(2), steps, newest=10) == []  # a loop that started over at 10 (20 went)
    assert expired(LatestN(1), infos(5, 10, 20, 30), newest=10) == [5]
    assert expired(BestN("loss", 1), steps, newest=30) == [10, 20]
    assert expired(None, steps, newest=30) == []


@pytest.mark.parametrize(
    ("keep", "message"),
    [(0, "keep"), (True, "keep must be"), ("3", "keep must be"), (LatestN, "keep must be")],
)
def test_a_bad_keep_is_one_line(keep: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        policy_of(keep)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "build", [lambda: LatestN(0), lambda: EveryNSteps(-1), lambda: BestN("", 1), lambda: BestN("x", 1, "low")]
)
def test_a_bad_policy_is_refused_when_made(build: object) -> None:
    with pytest.raises(ConfigError):
        build()  # type: ignore[operator]


def test_keep_best_by_a_metric_given_to_save(tmp_path: Path) -> None:
    losses = {1: 0.8, 2: 0.2, 3: 0.5, 4: 0.1, 5: 0.9}
    with Checkpointer(tmp_path, keep=AnyOf(LatestN(1), BestN("val_loss", 2))) as ckpt:
        for step, loss in losses.items():
            ckpt.save({"w": torch.full((4,), float(step))}, step, metrics={"val_loss": loss})
        ckpt.wait()
        assert ckpt.steps() == [2, 4, 5]
        assert ckpt.manifest(4)["metrics"] == {"val_loss": 0.1}
    # the metrics are read back from the manifests by a Checkpointer opened later
    with Checkpointer(tmp_path, keep=BestN("val_loss", 1)) as again:
        again.save({"w": torch.zeros(4)}, 6, metrics={"val_loss": 0.05})
        again.wait()
        assert again.steps() == [6]


def test_keep_every_n_steps_beside_the_latest(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, keep=AnyOf(LatestN(2), EveryNSteps(4)), mode="sync") as ckpt:
        for step in range(10):
            ckpt.save({"w": torch.zeros(2)}, step)
        ckpt.wait()
        assert ckpt.steps() == [0, 4, 8, 9]


def test_retain_applies_a_policy_whose_answer_changed(tmp_path: Path) -> None:
    live = {0, 1, 2}
    with Checkpointer(tmp_path, keep=CustomSteps(lambda: set(live))) as ckpt:
        for step in range(3):
            ckpt.save({"w": torch.zeros(2)}, step)
        ckpt.wait()
        assert ckpt.steps() == [0, 1, 2]
        live.discard(0)
        ckpt.retain()
        ckpt.wait()
        assert ckpt.steps() == [1, 2]


def test_retention_runs_a_thread_only_where_it_deletes(tmp_path: Path) -> None:
    """Retention is a commit observer the run wires on rank 0 of a writing run with a ``keep=``
    policy; without a policy, or read-only, no thread waits for commits it is never told of."""
    before = set(threading.enumerate())

    def retention_threads() -> int:
        return sum(t.name == "nbckpt-retention" for t in set(threading.enumerate()) - before)

    with Checkpointer(tmp_path) as ckpt:  # keep=None keeps every step
        ckpt.save({"w": torch.zeros(2)}, 1).wait()
        assert retention_threads() == 0
    with Checkpointer(tmp_path, keep=1, read_only=True):
        assert retention_threads() == 0
    with Checkpointer(tmp_path, keep=1) as ckpt:
        assert retention_threads() == 1
        ckpt.save({"w": torch.zeros(2)}, 2).wait()
        ckpt.wait()
        assert ckpt.steps() == [2]
    assert retention_threads() == 0  # stopped with its Checkpointer


def test_the_mirror_keeps_what_the_directory_keeps(tmp_path: Path) -> None:
    policy = BestN("loss", 2)
    with Checkpointer(tmp_path / "run", keep=policy, mirror=str(tmp_path / "mirror")) as ckpt:
        for step, loss in enumerate([0.5, 0.1, 0.7, 0.2, 0.9]):
            ckpt.save({"w": torch.zeros(2)}, step, metrics={"loss": loss})
        ckpt.wait()
        # a step the mirror was still uploading when the last pass ran stayed for it: it goes now
        ckpt.retain()
        ckpt.wait()
        local = ckpt.steps()
    with Checkpointer(tmp_path / "mirror", read_only=True) as mirror:
        assert mirror.steps() == local == [1, 3, 4]  # the newest stays until a later commit


@pytest.mark.parametrize(
    ("metrics", "message"),
    [([1.0], "metrics must be a dict"), ({"loss": "low"}, "'loss': 'low'"), ({3: 1.0}, "3: 1.0")],
)
def test_bad_metrics_are_refused_before_anything_is_written(
    tmp_path: Path, metrics: object, message: str
) -> None:
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ConfigError, match=message):
            ckpt.save({"w": torch.zeros(2)}, 1, metrics=metrics)  # type: ignore[arg-type]
        assert ckpt.steps() == []


def test_non_finite_metrics_are_left_out(tmp_path: Path) -> None:
    with Checkpointer(tmp_path, mode="sync", keep=BestN("loss", 1)) as ckpt:
        ckpt.save({"w": torch.zeros(2)}, 1, metrics={"loss": 0.5})
        ckpt.save({"w": torch.zeros(2)}, 2, metrics={"loss": float("nan"), "acc": 0.5})
        assert ckpt.manifest(2)["metrics"] == {"acc": 0.5}
        ckpt.save({"w": torch.zeros(2)}, 3, metrics={"loss": 0.7})
        ckpt.wait()
        assert ckpt.steps() == [1, 3]  # the diverged step 2 is no best one


def test_the_mirror_applies_the_runs_retention_rule_to_a_stray_save(tmp_path: Path) -> None:
    """One retention decision for both tiers: with ``keep=2``, three model saves and a stray
    ``{"x": 5}`` keep the two model steps beside the stray one, locally and on the mirror (the
    mirror counted every step alike and kept one model step: after losing the local disk,
    ``keep=2`` had promised two)."""
    with Checkpointer(tmp_path / "run", keep=2, mirror=str(tmp_path / "mirror")) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"model": {"w": torch.full((2,), float(step))}}, step)
        ckpt.wait()
        # a step the mirror was still uploading when a pass ran stayed for it: it goes now (a
        # pass after the stray save looks at the stray save's names only)
        ckpt.retain()
        ckpt.wait()
        with pytest.warns(UserWarning, match="step 4 holds 'x'"):
            ckpt.save({"x": 5}, 4)
        ckpt.wait()
        ckpt.retain()
        ckpt.wait()
        local = ckpt.steps()
    with Checkpointer(tmp_path / "mirror", read_only=True) as mirror:
        assert mirror.steps() == local == [2, 3, 4]


def test_the_backlog_waits_for_a_job_promised_before_it_is_queued() -> None:
    """Retention's pass is promised at the commit and queued once the commit is reported:
    wait() in between must wait for it (the retainer and the mirror wait through a Backlog)."""
    worker = Worker("nbckpt-test-backlog")
    try:
        backlog = Backlog(worker)
        ran: list[int] = []
        queue_it = backlog.promise(lambda: ran.append(1))
        waited = threading.Event()
        waiter = threading.Thread(target=lambda: (backlog.wait(), waited.set()))
        waiter.start()
        assert not waited.wait(0.2), "wait() returned before the promised job was even queued"
        queue_it()
        waiter.join(30)
        assert waited.is_set() and ran == [1]
        backlog.submit(lambda: ran.append(2))
        backlog.wait()
        assert ran == [1, 2]
    finally:
        worker.stop()
