"""A tiny GPT-2 under ``transformers.Trainer`` and the runs the Hugging Face tests compare; also
the torchrun worker.

As a script, one process per rank (``torchrun --nproc-per-node 2 hf_app.py DIR``): 12 steps
straight, then 6 steps (saving at 4) and a resume from nbckpt to 12, every rank saving; each
rank writes what it saw to ``DIR/rank<N>.json`` (the ranks share one stdout, where lines can mix).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from nbckpt.integrations.hf import NbckptCallback

__all__ = ["LossTrainer", "Tokens", "digest", "run_ddp", "train"]

warnings.filterwarnings("ignore", message=".*barrier.*")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, seed: int = 0, rows: int = 64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 50, (rows, 16), generator=g)

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


class RankSeed(TrainerCallback):  # type: ignore[misc]
    """Each rank its own random stream (the Trainer seeds every rank alike), so a rank that
    resumed with another rank's RNG states, or none, draws other dropout masks."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        torch.manual_seed(1000 + args.process_index)


class LossTrainer(Trainer):  # type: ignore[misc]
    """Records this rank's own loss at every step, as text (``repr``: bit for bit)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: list[str] = []

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
        loss = out[0] if return_outputs else out
        if model.training:
            self.losses.append(repr(float(loss.detach())))
        return out


def train(
    out: Path,
    callbacks: list[Any],
    *,
    stop_at: int | None = None,
    resume: str | None = None,
    eval_dataset: Any = None,
    wrap: Any = None,
    **overrides: Any,
) -> LossTrainer:
    torch.manual_seed(0)
    # a tiny GPT-2 from a config (no download), dropout on: the RNG states matter
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = GPT2LMHeadModel(config) if wrap is None else wrap(GPT2LMHeadModel(config))
    options: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 12,
        "per_device_train_batch_size": 4,
        "save_strategy": "steps",
        "save_steps": 4,
        "learning_rate": 1e-3,
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "logging_steps": 100,
        **overrides,
    }
    extra = [StopAt(stop_at)] if stop_at else []
    trainer = LossTrainer(
        model=model,
        args=TrainingArguments(**options),
        train_dataset=Tokens(),
        eval_dataset=eval_dataset,
        callbacks=[*callbacks, RankSeed(), *extra],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def digest(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """A hash of every tensor of a model or state dict, with its name."""
    h = hashlib.sha256()
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    for key, t in sorted(state.items()):
        h.update(key.encode() + t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_ddp(directory: Path) -> dict[str, Any]:
    straight = train(directory / "straight", [NbckptCallback(directory / "straight-ckpt")])
    first_cb = NbckptCallback(directory / "ckpt")
    train(directory / "out", [first_cb], stop_at=6)
    first_cb.close()
    second = NbckptCallback(directory / "ckpt")
    folder = second.resume_checkpoint()
    assert folder is not None
    seen = sorted(os.listdir(folder))
    resumed = train(directory / "out", [second], resume=folder)
    second.close()
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "folder": folder,
        "files": seen,
        "left": os.path.exists(folder),
        "global_step": resumed.state.global_step,
        "straight": {"losses": straight.losses, "digest": digest(straight.model)},
        "resumed": {"losses": resumed.losses, "digest": digest(resumed.model)},
    }


if __name__ == "__main__":
    where = Path(sys.argv[1])
    result = run_ddp(where)
    (where / f"rank{result['rank']}.json").write_text(json.dumps(result))
