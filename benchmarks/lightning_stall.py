"""Lightning benchmark: what a ``ModelCheckpoint``-driven run loses to checkpointing, per checkpoint IO.

    .venv/bin/python benchmarks/lightning_stall.py --json data/results/lightning-cpu.json
    .venv/bin/python benchmarks/lightning_stall.py --quick     # small models, 1 repeat (checks the script)

Method. ``Trainer.fit`` trains an MLP with AdamW (the checkpoint holds the parameters and two
moments: ``--sizes-mb`` 100 and 500 by default) with ``ModelCheckpoint(every_n_train_steps=E,
save_top_k=2, save_last=True, monitor="step", mode="max")``, so every event saves a top-k
checkpoint, saves ``last`` and removes the oldest top-k one, as a run that keeps its best two
does. Events ``--every`` 3 and 8 steps apart: close enough that a background write may still be
running at the next event, or far enough that it is not. Four variants, interleaved within each
repeat so that drift on a shared machine hits all alike:

- ``none``: no checkpointing (the floor the others are measured against);
- ``TorchCheckpointIO``: Lightning's default, ``torch.save`` (no fsync: its files may still be
  in the page cache when the call returns);
- ``AsyncCheckpointIO``: Lightning's own asynchronous wrapper (clones the tensors on the
  caller's thread, ``torch.save`` on a worker thread; one event queues two saves);
- ``NbckptCheckpointIO``: this project's plug-in (copy into reused host buffers, write, fsync and
  commit in the background; an event whose two saves are equal is one write: all but the first).

"stall per event" is the time the training loop spends inside ``ModelCheckpoint``'s hook at an
event (both saves, the removal, and any wait for an earlier write); "fit overhead" is the fit's
wall time minus the ``none`` run's, over the number of events: the whole cost, including the
end-of-fit wait for the last write and background work competing for the cores. Intervals are
95 % t-intervals over the repeats (each repeat's mean per event).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _output import finish, parser
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from nbckpt.bench._internal import t_interval
from nbckpt.integrations.lightning import NbckptCheckpointIO

warnings.filterwarnings("ignore", module="lightning")
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

DEPTH = 6
IOS: dict[str, Callable[[], CheckpointIO] | None] = {
    "none": None,
    "TorchCheckpointIO": TorchCheckpointIO,
    "AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
    "NbckptCheckpointIO": NbckptCheckpointIO,
}


class Mlp(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(DEPTH)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss: torch.Tensor = self.net(batch[0]).square().mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class TimedCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that records how long each of its events kept the training loop."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stalls: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        saved = self._last_global_step_saved
        began = time.perf_counter()
        super().on_train_batch_end(trainer, *args, **kwargs)
        if self._last_global_step_saved != saved:
            self.stalls.append(time.perf_counter() - began)


def width_for(size_mb: float) -> int:
    """The MLP width whose parameters and two AdamW moments take ``size_mb`` MB."""
    params = size_mb * 1e6 / 12 / DEPTH  # 3 float32 tensors per parameter, per layer
    return int((params**0.5) - 0.5)


def fit(io_name: str, width: int, every: int, steps: int, directory: Path) -> dict[str, Any]:
    """One fit; its wall time, the stalls of its events and the bytes of one checkpoint."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    make = IOS[io_name]
    io = make() if make is not None else None
    checkpoint = TimedCheckpoint(
        dirpath=directory, every_n_train_steps=every, save_top_k=2, save_last=True, monitor="step", mode="max"
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        plugins=[io] if io is not None else None,
        callbacks=[checkpoint] if io is not None else [],
        enable_checkpointing=io is not None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=directory,
    )
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, width))
    began = time.perf_counter()
    trainer.fit(Mlp(width), torch.utils.data.DataLoader(data, batch_size=4))
    wall = time.perf_counter() - began
    writes, size = None, 0
    if isinstance(io, NbckptCheckpointIO):
        writes, size = len(io.records), io.records[-1].bytes
    elif io is not None:
        size = max(p.stat().st_size for p in directory.glob("*.ckpt") if not p.is_symlink())
    shutil.rmtree(directory, ignore_errors=True)
    return {"wall_s": wall, "stalls_s": checkpoint.stalls, "writes": writes, "checkpoint_bytes": size}


def summarize(runs: list[dict[str, Any]], floor: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-event stall and fit time over the repeats (medians; means with a 95 % interval)."""
    stalls = [s for r in runs for s in r["stalls_s"]]
    events = max(len(runs[0]["stalls_s"]), 1)
    return {
        "stall_median_s": statistics.median(stalls) if stalls else 0.0,
        "stall_s": t_interval([statistics.fmean(r["stalls_s"]) for r in runs]) if stalls else (0.0,) * 3,
        "stall_max_s": max(stalls, default=0.0),
        "first_event_s": statistics.median(r["stalls_s"][0] for r in runs) if stalls else 0.0,
        "fit_median_s": statistics.median(r["wall_s"] for r in runs),
        "overhead_s": t_interval(
            [(r["wall_s"] - f["wall_s"]) / events for r, f in zip(runs, floor, strict=True)]
        ),
        "events": len(runs[0]["stalls_s"]),
        "writes": runs[0]["writes"],
        "checkpoint_bytes": runs[0]["checkpoint_bytes"],
        "runs": runs,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [20.0] if args.quick else args.sizes_mb
    everies = [3] if args.quick else args.every
    repeats = 1 if args.quick else args.repeats
    root = Path(args.dir)
    samples: dict[tuple[float, int, str], list[dict[str, Any]]] = {}
    fit("none", width_for(sizes[0]), everies[0], everies[0] * args.events, root / "warmup")  # first-fit costs
    for repeat in range(repeats):
        for size in sizes:
            for every in everies:
                steps = every * args.events
                for name in IOS:
                    result = fit(name, width_for(size), every, steps, root / name)
                    samples.setdefault((size, every, name), []).append(result)
                    stalls = ", ".join(f"{s:.3f}" for s in result["stalls_s"])
                    print(
                        f"  repeat {repeat + 1}/{repeats} {size:.0f} MB every {every}: {name}: "
                        f"fit {result['wall_s']:.2f} s, stalls [{stalls}] s",
                        flush=True,
                    )
    rows = []
    for size in sizes:
        for every in everies:
            floor = samples[(size, every, "none")]
            for name in IOS:
                row = summarize(samples[(size, every, name)], floor)
                rows.append({"size_mb": size, "every": every, "io": name, **row})
    print_table(rows, repeats, args.events)
    return {
        "benchmark": "lightning ModelCheckpoint stall",
        "repeats": repeats,
        "events_per_fit": args.events,
        "depth": DEPTH,
        "directory": str(root.resolve()),
        "lightning": version("lightning"),
        "rows": rows,
    }


def print_table(rows: list[dict[str, Any]], repeats: int, events: int) -> None:
    print(f"\nModelCheckpoint(save_top_k=2, save_last=True), {events} events per fit, {repeats} repeats")
    print(
        f"{'size':>5} {'every':>5} {'checkpoint IO':<19} {'stall median s':>14}"
        f" {'stall mean s [95% CI]':>24} {'first s':>8} {'fit median s':>12} {'writes/event':>12}"
    )
    for row in rows:
        mean, low, high = row["stall_s"]
        writes = "" if row["writes"] is None else f"{row['writes'] / max(row['events'], 1):.1f}"
        print(
            f"{row['size_mb']:>3.0f}MB {row['every']:>5} {row['io']:<19} {row['stall_median_s']:>14.3f}"
            f" {mean:>8.3f} [{low:.3f}, {high:.3f}] {row['first_event_s']:>8.3f} {row['fit_median_s']:>12.1f}"
            f" {writes:>12}"
        )


def main(argv: list[str] | None = None) -> None:
    quick = "a 20 MB model, events 3 apart, 1 repeat"
    options = parser(__doc__, repeats=3, directory="data/checkpoints/bench-lightning", quick=quick)
    options.add_argument("--sizes-mb", type=float, nargs="+", default=[100.0, 500.0])
    options.add_argument("--every", type=int, nargs="+", default=[3, 8], help="steps between events")
    options.add_argument("--events", type=int, default=6, help="checkpoint events per fit")
    finish(run, options.parse_args(argv))


if __name__ == "__main__":
    main()
