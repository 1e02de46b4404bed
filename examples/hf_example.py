"""transformers.Trainer with nbckpt: the Trainer decides when to save, nbckpt saves asynchronously.

    python examples/hf_example.py --dir ckpt-hf --max_steps 20
    python examples/hf_example.py --dir ckpt-hf --max_steps 40   # resumes at step 20

A tiny GPT-2 built from a config (nothing is downloaded) on random tokens.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from nbckpt.integrations.hf import NbckptCallback

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="ckpt-hf")
    p.add_argument("--max_steps", type=int, default=20)
    args = p.parse_args(argv)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32))
    ids = torch.randint(0, 128, (256, 32), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    cb = NbckptCallback(os.path.join(args.dir, "nbckpt"), keep=2)  # keep plays save_total_limit
    training = TrainingArguments(
        output_dir=args.dir,
        max_steps=args.max_steps,
        save_steps=10,
        per_device_train_batch_size=8,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training, train_dataset=dataset, callbacks=[cb])
    resume = cb.resume_checkpoint()  # a checkpoint-N/ folder the Trainer resumes from; None at first
    print(f"resuming from {resume}" if resume else "starting fresh", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    cb.close()  # every save committed
    print(f"trained to step {trainer.state.global_step}; checkpoints at steps {cb.ckpt.steps()}")


if __name__ == "__main__":
    main()
