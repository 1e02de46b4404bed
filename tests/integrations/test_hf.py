"""NbckptCallback under a real transformers.Trainer: saves taken over, exact resume."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from nbckpt import Checkpointer
from nbckpt.integrations.hf import NbckptCallback


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 50, (64, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def _train(
    out: Path, cb: NbckptCallback, *, stop_at: int | None = None, resume: str | None = None
) -> Trainer:
    torch.manual_seed(0)
    # a tiny GPT-2 from a config (no download), dropout on: the RNG states matter
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16))
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=12,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=4,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        logging_steps=100,
    )
    callbacks: list[Any] = [cb] + ([StopAt(stop_at)] if stop_at else [])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, t in sorted(model.state_dict().items()):
        h.update(key.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_trainer_saves_through_nbckpt_and_resumes_exactly(tmp_path: Path) -> None:
    straight_cb = NbckptCallback(tmp_path / "straight-ckpt", keep=2)
    straight = _train(tmp_path / "straight", straight_cb)
    straight_cb.close()
    assert not list((tmp_path / "straight").glob("checkpoint-*"))  # the Trainer's own saves were skipped
    with Checkpointer(tmp_path / "straight-ckpt", read_only=True) as ckpt:
        assert ckpt.steps() == [8, 12]
        peek = ckpt.load(map_location="meta")
        assert '"global_step": 12' in peek["trainer_state"]

    first = NbckptCallback(tmp_path / "ckpt")
    assert first.resume_checkpoint() is None  # a fresh start
    _train(tmp_path / "out", first, stop_at=6)
    first.close()
    second = NbckptCallback(tmp_path / "ckpt")
    folder = second.resume_checkpoint()
    assert folder is not None and folder.endswith("checkpoint-4")
    resumed = _train(tmp_path / "out", second, resume=folder)
    second.close()
    assert resumed.state.global_step == 12
    assert straight.optimizer is not None and resumed.optimizer is not None
    assert _digest(resumed.model) == _digest(straight.model)  # type: ignore[arg-type]
    opt_a, opt_b = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(opt_a[k]["exp_avg"], opt_b[k]["exp_avg"]) for k in opt_a)
