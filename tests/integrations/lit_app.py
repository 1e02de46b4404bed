"""A tiny Lightning model and the runs the Lightning tests compare; also the DDP worker.

As a script (one process per rank, started by the test with LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set, so Lightning joins them instead of launching its own):
``python lit_app.py DIR`` runs 4 epochs straight in DIR/straight, 2 epochs then a resume to 4
from "last" in DIR/resumed, and prints one JSON line of what it saw.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from nbckpt.integrations.lightning import NbckptCheckpointIO

__all__ = ["TinyModel", "digest", "fit", "run_ddp"]

warnings.filterwarnings("ignore", module="lightning")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class TinyModel(pl.LightningModule):
    """Two layers, AdamW and a step LR schedule: optimizer and scheduler state both matter."""

    def __init__(self, hidden: int = 16, lr: float = 0.05, tag: Path | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def trainer(
    directory: Path, epochs: int, save_last: bool | Literal["link"] = True, **kwargs: Any
) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        callbacks=[
            ModelCheckpoint(dirpath=directory, monitor="train_loss", save_top_k=2, save_last=save_last)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        **kwargs,
    )


def fit(
    directory: Path,
    epochs: int,
    *,
    resume: bool = False,
    save_last: bool | Literal["link"] = True,
    **kwargs: Any,
) -> tuple[TinyModel, pl.Trainer]:
    torch.manual_seed(0)
    model = TinyModel(tag=directory)
    t = trainer(directory, epochs, save_last, **kwargs)
    t.fit(model, data(), ckpt_path="last" if resume else None)
    return model, t


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def run_ddp(directory: Path) -> dict[str, Any]:
    """Three fits in the same two processes, each ended by a barrier as separate launches end
    (the next starts once the last has exited): rank 1 may leave ``fit`` while rank 0 still
    waits for its async writes in teardown. Whether that caused the rare 300 s hang of full runs
    is not proven (a slowed commit did not reproduce it); a hang now prints every rank's stacks."""
    ddp: dict[str, Any] = {"strategy": "ddp", "devices": 2}
    straight, _ = fit(directory / "straight", 4, **ddp)
    torch.distributed.barrier()
    fit(directory / "resumed", 2, **ddp)
    torch.distributed.barrier()
    resumed, t = fit(directory / "resumed", 4, resume=True, **ddp)
    return {
        "rank": t.global_rank,
        "straight": digest(straight),
        "resumed": digest(resumed),
        "global_step": t.global_step,
        "files": sorted(p.name for p in (directory / "resumed").iterdir()),
    }


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test prints where this rank was
    print(json.dumps(run_ddp(Path(sys.argv[1]))), flush=True)
