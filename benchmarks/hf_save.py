"""Hugging Face benchmark: what ``transformers.Trainer`` loses to its checkpoints, its own against nbckpt's.

    .venv/bin/python benchmarks/hf_save.py --json data/results/hf-cpu.json
    .venv/bin/python benchmarks/hf_save.py --quick      # a small model, 1 repeat (checks the script)

Method. ``Trainer.train`` fits a GPT-2 built from a config (``--n-embd`` 256, 4 layers, the
GPT-2 vocabulary: ~16M parameters, ~200 MB of checkpoint with AdamW's moments) on random tokens,
saving every ``--save-steps`` steps. Three variants, interleaved within each repeat:

- ``none``: ``save_strategy="no"`` (the floor);
- ``Trainer``: the Trainer's own ``checkpoint-N/`` folders (safetensors weights, ``torch.save``
  of optimizer, scheduler and RNG states, no fsync), ``save_total_limit=2``;
- ``NbckptCallback``: the Trainer's saves taken over by nbckpt (``keep=2``): copied, then written,
  fsynced and committed in the background.

"save" is the time the training loop spends in one save: ``Trainer._save_checkpoint`` for the
Trainer's own, the callback's ``on_step_end`` at a save step for nbckpt. "overhead per save" is
the run's wall time minus the ``none`` run's, over the number of saves: the whole cost, including
the end-of-training wait for the last write and background work competing for the cores.
Intervals are 95 % t-intervals over the repeats (each repeat's mean per save).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from _output import finish, parser
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

from nbckpt.bench._internal import t_interval
from nbckpt.integrations.hf import NbckptCallback

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
logging.getLogger("nbckpt").setLevel(logging.ERROR)

VARIANTS = ("none", "Trainer", "NbckptCallback")


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class TimedTrainer(Trainer):  # type: ignore[misc]
    """A Trainer that records how long each of its own checkpoint saves kept the loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[float] = []

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        began = time.perf_counter()
        super()._save_checkpoint(model, trial)
        self.saves.append(time.perf_counter() - began)


class TimedCallback(NbckptCallback):
    """NbckptCallback that records how long each save step's ``on_step_end`` kept the loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        began, due = time.perf_counter(), control.should_save
        super().on_step_end(args, state, control, **kwargs)
        if due and not control.should_save:  # taken over: saved here
            self.saves.append(time.perf_counter() - began)


def train(variant: str, n_embd: int, steps: int, save_steps: int, directory: Path) -> dict[str, Any]:
    shutil.rmtree(directory, ignore_errors=True)
    config = GPT2Config(n_layer=4, n_head=4, n_embd=n_embd, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    callback = TimedCallback(directory / "nbckpt", keep=2) if variant == "NbckptCallback" else None
    args = TrainingArguments(
        output_dir=str(directory),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_strategy="no" if variant == "none" else "steps",
        save_steps=save_steps,
        save_total_limit=2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=10_000,
        dataloader_num_workers=0,
    )
    data = Tokens(2 * steps, 64, config.vocab_size)
    trainer = TimedTrainer(
        model=model, args=args, train_dataset=data, callbacks=[callback] if callback else []
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training line
    began = time.perf_counter()
    trainer.train()  # the callback waits for its last write at the end (on_train_end)
    wall = time.perf_counter() - began
    saves = callback.saves if callback is not None else trainer.saves
    size, waits = 0, []
    if callback is not None:
        callback.close()
        records = callback.ckpt.records
        # the part of each save's stall spent waiting for the previous save's write (backpressure)
        size, waits = records[-1].bytes, [r.wait_s for r in records]
    elif variant == "Trainer":
        size = sum(p.stat().st_size for p in sorted(directory.glob("checkpoint-*"))[-1].iterdir())
    shutil.rmtree(directory, ignore_errors=True)
    return {"wall_s": wall, "saves_s": saves, "waits_s": waits, "checkpoint_bytes": size}


def run(args: argparse.Namespace) -> dict[str, Any]:
    n_embd, repeats = (64, 1) if args.quick else (args.n_embd, args.repeats)
    root = Path(args.dir)
    train("none", n_embd, args.save_steps, args.save_steps, root / "warmup")  # first-run costs
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    for repeat in range(repeats):
        for name in VARIANTS:
            result = train(name, n_embd, args.steps, args.save_steps, root / name)
            samples[name].append(result)
            saves = ", ".join(f"{s:.3f}" for s in result["saves_s"])
            waits = ", ".join(f"{s:.3f}" for s in result["waits_s"])
            print(
                f"  repeat {repeat + 1}/{repeats} {name}: train {result['wall_s']:.2f} s, saves [{saves}] s"
                + (f", of which waiting for the previous write [{waits}] s" if waits else "")
            )
    rows = {}
    for name in VARIANTS[1:]:
        runs = samples[name]
        rows[name] = {
            "save_s": t_interval([statistics.fmean(r["saves_s"]) for r in runs]),
            "save_max_s": max(s for r in runs for s in r["saves_s"]),
            "overhead_s": t_interval(
                [
                    (r["wall_s"] - f["wall_s"]) / len(r["saves_s"])
                    for r, f in zip(runs, samples["none"], strict=True)
                ]
            ),
            "saves": len(runs[0]["saves_s"]),
            "checkpoint_bytes": runs[0]["checkpoint_bytes"],
            "runs": runs,
        }
    print(f"\nTrainer, GPT-2 n_embd={n_embd}, save every {args.save_steps} steps, {repeats} repeats")
    print(
        f"{'saves by':<16} {'size':>6} {'save s [95% CI]':>24} {'max s':>7} {'overhead/save s [95% CI]':>27}"
    )
    for name, row in rows.items():
        save, over = row["save_s"], row["overhead_s"]
        print(
            f"{name:<16} {row['checkpoint_bytes'] / 1e6:>4.0f}MB"
            f" {save[0]:>8.3f} [{save[1]:.3f}, {save[2]:.3f}] {row['save_max_s']:>7.3f}"
            f" {over[0]:>10.3f} [{over[1]:.3f}, {over[2]:.3f}]"
        )
    return {
        "benchmark": "transformers Trainer save",
        "n_embd": n_embd,
        "steps": args.steps,
        "save_steps": args.save_steps,
        "repeats": repeats,
        "directory": str(root.resolve()),
        "transformers": version("transformers"),
        "rows": rows,
        "none_runs": samples["none"],  # the floor's wall times, which overhead_s subtracts
    }


def main(argv: list[str] | None = None) -> None:
    options = parser(__doc__, repeats=5, directory="data/checkpoints/bench-hf", quick="n_embd 64, 1 repeat")
    options.add_argument("--n-embd", type=int, default=256)
    options.add_argument("--steps", type=int, default=24)
    options.add_argument("--save-steps", type=int, default=4)
    finish(run, options.parse_args(argv))


if __name__ == "__main__":
    main()
