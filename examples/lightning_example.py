"""Lightning with nbckpt: asynchronous checkpoints behind ModelCheckpoint, resume from "last".

    python examples/lightning_example.py --dir ckpt-lightning --epochs 3
    python examples/lightning_example.py --dir ckpt-lightning --epochs 6   # resumes at epoch 3

Under DDP (``Trainer(strategy="ddp", devices=N)``, or torchrun) nothing changes: Lightning
saves from global rank 0 alone, and the plug-in saves rank-locally.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from nbckpt.integrations.lightning import NbckptCheckpointIO, load_from_checkpoint

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="ckpt-lightning")
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args(argv)

    trainer = pl.Trainer(
        max_epochs=args.epochs,
        plugins=[NbckptCheckpointIO()],  # save_checkpoint returns once the state is copied
        callbacks=[
            ModelCheckpoint(dirpath=args.dir, monitor="step", mode="max", save_top_k=2, save_last=True)
        ],
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(BoringModel(), ckpt_path="last")  # starts fresh when there is no last.ckpt yet
    best = trainer.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    model = load_from_checkpoint(BoringModel, best)  # Model.load_from_checkpoint for nbckpt's files
    print(f"trained to epoch {trainer.current_epoch}; best {best} loaded: {type(model).__name__}")


if __name__ == "__main__":
    main()
