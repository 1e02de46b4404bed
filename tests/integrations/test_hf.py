"""NbckptCallback under a real transformers.Trainer: saves taken over, exact resume in one
process and under torchrun, load_best_model_at_end."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from helpers.faults import armed
from integrations.hf_app import Tokens, digest, train
from transformers import TrainerCallback

from nbckpt import BestN, Checkpointer, ConfigError, SaveSchedule
from nbckpt.integrations.hf import NbckptCallback

WORKER = Path(__file__).with_name("hf_app.py")
#: Evaluated and saved every 2 steps; at this learning rate the eval loss is lowest at step 4.
BEST = {
    "eval_dataset": Tokens(seed=1, rows=16),
    "learning_rate": 0.03,
    "eval_strategy": "steps",
    "eval_steps": 2,
    "save_steps": 2,
    "load_best_model_at_end": True,
}


def test_trainer_saves_through_nbckpt_and_resumes_exactly(tmp_path: Path) -> None:
    straight_cb = NbckptCallback(tmp_path / "straight-ckpt", keep=2)
    straight = train(tmp_path / "straight", [straight_cb])
    straight_cb.close()
    assert not list((tmp_path / "straight").glob("checkpoint-*"))  # the Trainer's own saves were skipped
    with Checkpointer(tmp_path / "straight-ckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [8, 12]
        peek = ckpt.load(map_location="meta")
        assert '"global_step": 12' in peek["trainer_state"]

    first = NbckptCallback(tmp_path / "ckpt")
    assert first.resume_checkpoint() is None  # a fresh start
    train(tmp_path / "out", [first], stop_at=6)
    first.close()
    second = NbckptCallback(tmp_path / "ckpt")
    folder = second.resume_checkpoint()
    assert folder is not None and folder.endswith("checkpoint-4")
    assert "rng_state.pth" in os.listdir(folder)  # one process: the name the Trainer reads
    resumed = train(tmp_path / "out", [second], resume=folder)
    second.close()
    assert not os.path.exists(folder)  # removed once the Trainer had read it
    assert resumed.state.global_step == 12
    assert resumed.losses == straight.losses[4:]
    assert digest(resumed.model) == digest(straight.model)
    opt_a, opt_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)


def test_resume_under_torchrun_is_exact_on_every_rank(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*torchrun, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, result in enumerate(results):
        assert result["global_step"] == 12
        # each rank found its own RNG file: the Trainer reads rng_state_{rank}.pth under DDP
        assert {"rng_state_0.pth", "rng_state_1.pth", "pytorch_model.bin"} <= set(result["files"])
        assert not result["left"]  # the resume folder is gone once every rank had read it
        # this rank's own losses after the resume, bit for bit, as in the uninterrupted run
        assert result["resumed"]["losses"] == result["straight"]["losses"][4:], rank
        assert result["resumed"]["digest"] == result["straight"]["digest"]
    assert results[0]["straight"]["losses"] != results[1]["straight"]["losses"]  # two streams, two batches
    assert not (tmp_path / "ckpt-resume").exists()


def test_load_best_model_at_end_as_the_trainer_does_it(tmp_path: Path) -> None:
    own = train(tmp_path / "own", [], **BEST)  # the Trainer's own checkpoints
    assert own.state.best_global_step == 4 and own.state.best_model_checkpoint.endswith("checkpoint-4")

    cb = NbckptCallback(tmp_path / "ckpt")
    ours = train(tmp_path / "ours", [cb], **BEST)
    cb.close()
    assert not list((tmp_path / "ours").glob("checkpoint-*"))
    assert digest(ours.model) == digest(own.model)  # the best weights, loaded at the end
    assert ours.state.best_model_checkpoint == str(tmp_path / "ckpt" / "step-000004")
    assert cb.best_step == ours.state.best_global_step == 4
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert digest(ckpt.load(12)["model"]) != digest(ours.model)  # the last step's were others

    # stopped after the best step's save and resumed: the saved state knew step 4's evaluation
    first = NbckptCallback(tmp_path / "resumed-ckpt")
    train(tmp_path / "resumed", [first], stop_at=5, **BEST)
    first.close()
    second = NbckptCallback(tmp_path / "resumed-ckpt")
    folder = second.resume_checkpoint()
    assert folder is not None and folder.endswith("checkpoint-4")
    resumed = train(tmp_path / "resumed", [second], resume=folder, **BEST)
    second.close()
    assert resumed.state.best_global_step == 4 and second.best_step == 4
    assert resumed.losses == ours.losses[4:]
    assert digest(resumed.model) == digest(own.model)


def test_each_save_names_the_best_step_as_the_trainers_own_saves_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The Trainer's own saves set ``state.best_model_checkpoint`` to the best checkpoint saved so
    far, with or without load_best_model_at_end (transformers' test_early_stopping_callback checks
    it): so do the callback's, naming nbckpt's step directory, in the live state and the saved one.
    With load_best_model_at_end a resumed run does not hand that directory to the Trainer's own
    loader at the end (it found no weight files there: "Could not locate the best model")."""
    options = {**BEST, "load_best_model_at_end": False, "metric_for_best_model": "loss"}
    own = train(tmp_path / "own", [], **options)
    assert own.state.best_model_checkpoint == str(tmp_path / "own" / "checkpoint-4")
    cb = NbckptCallback(tmp_path / "ckpt")
    ours = train(tmp_path / "ours", [cb], **options)
    cb.close()
    best = str(tmp_path / "ckpt" / "step-000004")
    assert ours.state.best_model_checkpoint == best
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert json.loads(ckpt.load(8)["trainer_state"])["best_model_checkpoint"] == best

    first = NbckptCallback(tmp_path / "resumed-ckpt")
    train(tmp_path / "resumed", [first], stop_at=6, **BEST)
    first.close()
    second = NbckptCallback(tmp_path / "resumed-ckpt")
    transformers_log = logging.getLogger("transformers")
    transformers_log.addHandler(caplog.handler)
    try:
        resumed = train(tmp_path / "resumed", [second], resume=second.resume_checkpoint(), **BEST)
    finally:
        transformers_log.removeHandler(caplog.handler)
        second.close()
    assert "Could not locate the best model" not in caplog.text
    assert resumed.state.best_model_checkpoint == str(tmp_path / "resumed-ckpt" / "step-000004")


def test_keep_keeps_the_best_step_for_load_best_model_at_end(tmp_path: Path) -> None:
    # keep=2 alone would have deleted step 4 by step 8: the best step stays beside the newest two
    cb = NbckptCallback(tmp_path / "ckpt", keep=2)
    ours = train(tmp_path / "ours", [cb], **BEST)
    cb.close()
    assert cb.best_step == ours.state.best_global_step == 4
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [4, 10, 12]
        assert digest(ckpt.load(4)["model"]) == digest(ours.model)  # what was loaded at the end
        assert ckpt.manifest(4)["metrics"]["eval_loss"] == ours.state.best_metric  # for BestN

    # a policy by the evaluation's metric: BestN keeps the lowest eval_loss
    best = NbckptCallback(tmp_path / "best-ckpt", keep=BestN("eval_loss", 1))
    train(tmp_path / "best", [best], **BEST)
    best.close()
    with Checkpointer(tmp_path / "best-ckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [4, 12]  # the best, and the newest that retention never deletes


def test_save_total_limit_applies_to_the_callbacks_steps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31, item 7: ``save_total_limit=2`` with the callback kept every step, silently.
    Without ``keep`` it applies to nbckpt's steps; with both, ``keep`` does and a line says so."""
    cb = NbckptCallback(tmp_path / "ckpt")
    train(tmp_path / "out", [cb], save_total_limit=2)
    cb.close()
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [8, 12]
    both = NbckptCallback(tmp_path / "both", keep=3)
    with caplog.at_level("WARNING", logger="nbckpt"):
        train(tmp_path / "out2", [both], save_total_limit=1)
    both.close()
    said = "NbckptCallback keeps the newest 3 and the steps named; TrainingArguments.save_total_limit=1"
    assert said in caplog.text
    with Checkpointer(tmp_path / "both", read_only=True) as ckpt:
        assert ckpt.steps() == [4, 8, 12]


#: Log values that differ between a run and its resume as they do with the Trainer's own
#: checkpoints: times (eval_runtime, train_samples_per_second) and train_loss (this session's mean).
_PER_RUN = re.compile(r"train_loss|.*_(runtime|per_second)")


def _without_per_run(state: dict[str, Any]) -> dict[str, Any]:
    """``TrainerState`` as a dict, its log lines without what differs per run (as transformers' own
    ``check_trainer_state_are_the_same`` leaves it out)."""
    lines = [{k: v for k, v in line.items() if not _PER_RUN.fullmatch(k)} for line in state["log_history"]]
    return {**state, "log_history": lines}


@pytest.mark.parametrize(
    "options",
    [
        {"logging_steps": 2},  # the save step (4) logs
        {"logging_steps": 3},  # it neither logs nor evaluates (lines at 3, 6, 9, 12)
        {"eval_dataset": Tokens(seed=1, rows=16), "eval_strategy": "steps", "eval_steps": 4},  # it evaluates
        {"logging_steps": 2, "gradient_accumulation_steps": 2},  # two batches a step, mid-epoch
    ],
    ids=["logs", "neither", "evaluates", "accumulating"],
)
def test_the_saved_trainer_state_is_the_trainers_own_and_so_is_the_resumed_run(
    tmp_path: Path, options: dict[str, Any]
) -> None:
    """Issue 31, item 8: the state nbckpt saves at step 4 is what the Trainer's own checkpoint-4
    holds, log_history and total_flos included (the callback saved before the Trainer logged: the
    saved log_history lacked the save step's line), and a run resumed from it ends with the state
    of a run resumed from the Trainer's own checkpoint-4, field by field, as transformers'
    test_can_resume_training compares them. Where the save step logs or evaluates, that is the
    straight run's state; where it does neither, the Trainer's own resume logs step 6's mean loss
    over steps 5-6 (the steps since it resumed), and so does this one."""
    own = train(tmp_path / "own", [], **options)  # the Trainer's own checkpoints
    theirs = json.loads((tmp_path / "own" / "checkpoint-4" / "trainer_state.json").read_text())
    own_resumed = train(
        tmp_path / "own-resumed", [], resume=str(tmp_path / "own" / "checkpoint-4"), **options
    )

    first = NbckptCallback(tmp_path / "ckpt")
    train(tmp_path / "out", [first], stop_at=6, **options)
    first.close()
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        ours = json.loads(ckpt.load(4)["trainer_state"])
    assert _without_per_run(ours) == _without_per_run(theirs)
    second = NbckptCallback(tmp_path / "ckpt")
    resumed = train(tmp_path / "out", [second], resume=second.resume_checkpoint(step=4), **options)
    second.close()
    assert resumed.losses == own.losses[4 * options.get("gradient_accumulation_steps", 1) :]
    after = _without_per_run(dataclasses.asdict(resumed.state))
    assert after == _without_per_run(dataclasses.asdict(own_resumed.state))
    assert (after == _without_per_run(dataclasses.asdict(own.state))) == (options.get("logging_steps") != 3)


@pytest.mark.parametrize(("mtbf", "saved"), [("1000h", [1]), (1e-3, "often")])
def test_a_save_schedule_decides_when_the_callback_saves(tmp_path: Path, mtbf: Any, saved: Any) -> None:
    """save_strategy="no": the schedule alone saves, its first save at once (step 1); an MTBF of
    1000 h wants nothing more in 12 steps, one of 1 ms a save as often as the write allows (in
    sync mode, where each save is durable when it returns)."""
    schedule = SaveSchedule(mtbf=mtbf)
    callback = NbckptCallback(tmp_path / "ckpt", schedule=schedule, keep=None, mode="sync")
    trainer = train(tmp_path / "out", [callback], save_strategy="no")
    callback.close()
    assert not list((tmp_path / "out").glob("checkpoint-*"))
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        steps = ckpt.steps()
        # at 1 ms, a save is due once the time since the one before began reaches the recent
        # saves' median: the next step, or a few later after a save faster than the median
        assert steps[0] == 1 and (len(steps) >= 3 if saved == "often" else steps == saved), steps
        assert f'"global_step": {steps[-1]}' in ckpt.load(map_location="meta")["trainer_state"]
    assert trainer.state.global_step == 12
    interval = callback.ckpt.save_interval  # decided once a save had committed: at 1 ms, by the write
    assert saved != "often" or (interval is not None and interval.bound == "persist")


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep must be"):
        NbckptCallback(tmp_path / "ckpt", keep="2")
    with pytest.raises(ConfigError, match="decides ranks"):
        NbckptCallback(tmp_path / "ckpt", ranks="local")


@pytest.mark.parametrize(("metric", "greater"), [("loss", False), ("eval_accuracy", True)])
def test_the_best_metric_rule_replicated_is_the_installed_trainers(metric: str, greater: bool) -> None:
    """The saved Trainer state counts each evaluation as Trainer._determine_best_metric (private)
    does: the same best metric and step after every evaluation of a run, or this fails naming
    transformers' version."""
    from types import SimpleNamespace

    import transformers
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import SaveStrategy

    from nbckpt.integrations._hf_compat import count_evaluation

    rule = getattr(Trainer, "_determine_best_metric", None)
    assert rule is not None, f"transformers {transformers.__version__} has no Trainer._determine_best_metric"
    args = TrainingArguments(
        "unused", metric_for_best_model=metric, greater_is_better=greater, save_strategy=SaveStrategy.STEPS
    )
    trainer = SimpleNamespace(args=args, state=SimpleNamespace(best_metric=None, best_global_step=None))
    saved: dict[str, Any] = {"best_metric": None, "best_global_step": None}
    key = metric if metric.startswith("eval_") else f"eval_{metric}"
    for step, value in enumerate([0.5, 0.7, 0.3, 0.3, 0.9, 0.1], start=1):
        trainer.state.global_step = saved["global_step"] = step
        rule(trainer, metrics={key: value}, trial=None)
        count_evaluation(saved, args, {key: value})
        theirs = (trainer.state.best_metric, trainer.state.best_global_step)
        assert (saved["best_metric"], saved["best_global_step"]) == theirs, (
            f"transformers {transformers.__version__} changed Trainer._determine_best_metric at step "
            f"{step}: update nbckpt/integrations/_hf_compat.py"
        )


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True)
    return peft.get_peft_model(model, config)


def test_a_peft_model_saves_its_adapter_alone_and_resumes_exactly(tmp_path: Path) -> None:
    """With PEFT the Trainer's own save writes the adapter alone (save_pretrained): so does the
    callback (it wrote the whole base model, 141x the bytes), and a resume loads it back as the
    Trainer loads its own adapter checkpoints."""
    pytest.importorskip("peft")
    straight = train(tmp_path / "straight", [NbckptCallback(tmp_path / "straight-ckpt")], wrap=_lora)
    first = NbckptCallback(tmp_path / "ckpt")
    model = train(tmp_path / "out", [first], stop_at=6, wrap=_lora).model
    first.close()
    adapter = {k for k, p in model.named_parameters() if p.requires_grad}
    frozen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad}
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        saved = ckpt.load(4, map_location="meta")
        assert len(saved["model"]) == len(adapter) and all("lora_" in k for k in saved["model"])
        assert ckpt.verify(4)["bytes"] < sum(frozen.values())  # none of the frozen base model
    second = NbckptCallback(tmp_path / "ckpt")
    folder = second.resume_checkpoint()
    assert folder is not None
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(folder))
    resumed = train(tmp_path / "out", [second], resume=folder, wrap=_lora)
    second.close()
    assert resumed.losses == straight.losses[4:]
    assert digest(resumed.model) == digest(straight.model)


def test_load_best_model_at_end_sets_the_best_adapter_as_the_trainer_does(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    # a learning rate that overshoots: the best evaluation comes before the last step
    best = {**BEST, "learning_rate": 0.5}
    own = train(tmp_path / "own", [], wrap=_lora, **best)  # the Trainer's own adapter checkpoints
    cb = NbckptCallback(tmp_path / "ckpt")
    ours = train(tmp_path / "ours", [cb], wrap=_lora, **best)
    cb.close()
    assert cb.best_step == ours.state.best_global_step == own.state.best_global_step != 12
    assert digest(ours.model) == digest(own.model)  # the best adapter, loaded at the end


def test_a_save_that_waits_for_the_one_before_says_so_in_the_training_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 31, item 13: with one save in flight (max_inflight=1) the next save waits for the
    previous write and fsync, and that wait becomes most of the stall the Trainer's loop sees.
    The callback says so in the training log (a warning the first time) and
    ``SaveRecord.wait_s`` holds it, as the Lightning plug-in does."""
    cb = NbckptCallback(tmp_path / "ckpt")
    release, waiting = threading.Event(), threading.Event()
    commit = cb.ckpt.store.commit

    def held_commit(*args: Any) -> Any:
        release.wait()
        return commit(*args)

    cb.ckpt.store.commit = held_commit  # type: ignore[method-assign]
    reached: list[bool] = []  # whether step 8's save reached the wait (step 4's commit held till then)
    threading.Thread(target=lambda: (reached.append(waiting.wait(60)), release.set()), daemon=True).start()
    with caplog.at_level("INFO", logger="nbckpt"), armed("save.wait", lambda step: waiting.set()):
        train(tmp_path / "out", [cb])
    cb.ckpt.wait()
    records = {record.step: record.wait_s for record in cb.ckpt.records}
    cb.close()
    assert reached == [True], "the save of step 8 never waited for room"
    assert set(records) == {4, 8, 12} and records[4] == 0 < records[8]
    said = [r for r in caplog.records if "waited" in r.getMessage()]
    assert said and said[0].levelname == "WARNING" and "the save of step 8 waited" in said[0].getMessage()
    assert "max_inflight" in said[0].getMessage() and [r.levelname for r in said[1:]] in ([], ["INFO"])


class _HoldAt(TrainerCallback):  # type: ignore[misc]
    """At the end of step ``step``: says so, then waits until released (the run goes on)."""

    def __init__(self, step: int) -> None:
        self.step, self.reached, self.release = step, threading.Event(), threading.Event()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            self.reached.set()
            assert self.release.wait(120)


class _CtrlCAt(TrainerCallback):  # type: ignore[misc]
    """Ctrl-C in the cell at the end of step ``step``: no on_train_end follows."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise KeyboardInterrupt


def test_a_cell_run_again_makes_a_new_callback_that_takes_the_directory_over(tmp_path: Path) -> None:
    """Issue 31: a notebook cell that makes a NbckptCallback and trains, run again, made a second
    one on the directory while the first (still bound) held it: refused ("in use by another
    Checkpointer in this process"). Now the new one takes over from an earlier one that is not
    training (its saves committed), also after a Ctrl-C ended that training; only one training on
    another thread refuses it, by name."""
    directory = tmp_path / "ckpt"
    first, hold = NbckptCallback(directory), _HoldAt(2)
    run = threading.Thread(target=train, args=(tmp_path / "out", [first, hold]), name="trainer")
    run.start()
    assert hold.reached.wait(120)
    with pytest.raises(
        ConfigError, match="earlier NbckptCallback of this process, training on thread 'trainer'"
    ):
        NbckptCallback(directory).resume_checkpoint()
    hold.release.set()
    run.join()

    second = NbckptCallback(directory)  # the cell again, `first` still bound and open
    folder = second.resume_checkpoint()
    assert folder is not None and folder.endswith("checkpoint-12") and first._ckpt is None
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C while it trains on: step 16 saved, no train end
        train(tmp_path / "out", [second, _CtrlCAt(17)], resume=folder, max_steps=24)

    third = NbckptCallback(directory)  # the cell again after the Ctrl-C
    assert third.ckpt.steps() == [4, 8, 12, 16] and second._ckpt is None
    assert first.ckpt.steps() == [4, 8, 12, 16] and third._ckpt is None  # the first one, used again
    first.close()
    with Checkpointer(directory, read_only=True) as ckpt:  # nothing holds it any longer
        assert ckpt.latest_step() == 16
