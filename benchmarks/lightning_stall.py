"""Lightning benchmark: how long ``trainer.save_checkpoint`` stops training, per checkpoint IO.

    .venv/bin/python benchmarks/lightning_stall.py --json data/results/lightning-cpu.json
    .venv/bin/python benchmarks/lightning_stall.py --quick     # a 5M model, 2 repeats (checks the script)

Method. One Trainer fits a ~50M-parameter MLP (AdamW: the checkpoint holds the parameters and
two moments, ~600 MB) for a few steps, then ``trainer.save_checkpoint(path)`` is timed: that
is the call ``ModelCheckpoint`` makes, so the time includes Lightning's own collection of the
state (``dump_checkpoint``). Three IOs, one after another within each repeat so that drift on a
shared machine hits all alike:

- ``TorchCheckpointIO``: Lightning's default, ``torch.save`` (no fsync: its file may still be
  in the page cache when the call returns, not on disk);
- ``AsyncCheckpointIO``: Lightning's own asynchronous wrapper (clones the tensors on the
  caller's thread, ``torch.save`` on a worker thread);
- ``NbckptCheckpointIO``: this project's plug-in (copy into reused host buffers, write and
  fsync in the background, commit atomically).

"stall" is what the training loop waits for; "durable" is the time until the checkpoint is
written (fsynced, for nbckpt), measured by waiting for the background work after the stall.
Before each timed save the IO has saved once already (nbckpt's buffers are allocated then,
as in a run, where only the first save pays for them), and the parameters have changed since.
Rows give the median and min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from nbckpt.integrations.lightning import NbckptCheckpointIO

warnings.filterwarnings("ignore", module="lightning")


class Mlp(pl.LightningModule):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out: torch.Tensor = self.net(batch[0]).square().mean()
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _trainer(io: CheckpointIO, width: int, depth: int, root: Path) -> pl.Trainer:
    data = torch.utils.data.TensorDataset(torch.randn(4, width))
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        plugins=[io],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    torch.manual_seed(0)
    trainer.fit(Mlp(width, depth), torch.utils.data.DataLoader(data, batch_size=2))
    return trainer


def _finish(io: CheckpointIO) -> None:
    """Wait for the IO's background work (none for TorchCheckpointIO)."""
    if isinstance(io, NbckptCheckpointIO):
        io.wait()
    elif isinstance(io, AsyncCheckpointIO):
        io.teardown()  # joins its worker thread (a new one starts on the next save)


def measure(name: str, io: CheckpointIO, width: int, depth: int, root: Path) -> tuple[float, float, int]:
    """(stall, durable) seconds of one save after a warm-up save, and the checkpoint's bytes."""
    directory = root / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    trainer = _trainer(io, width, depth, directory)
    trainer.save_checkpoint(directory / "warmup.ckpt")
    _finish(io)
    with torch.no_grad():  # as an optimizer step would: new values (nbckpt skips unchanged state)
        for param in trainer.lightning_module.parameters():
            param.mul_(0.5)
    began = time.perf_counter()
    trainer.save_checkpoint(directory / "timed.ckpt")
    stall = time.perf_counter() - began
    _finish(io)
    durable = time.perf_counter() - began
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    io.teardown()
    shutil.rmtree(directory, ignore_errors=True)
    return stall, durable, size // 2  # two checkpoints were on disk


def run(args: argparse.Namespace) -> dict[str, Any]:
    width, depth = (1024, 5) if args.quick else (args.width, args.depth)
    params = depth * (width * width + width)
    root = Path(args.dir)
    makers: dict[str, Callable[[], CheckpointIO]] = {
        "TorchCheckpointIO": TorchCheckpointIO,
        "AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "NbckptCheckpointIO": NbckptCheckpointIO,
    }
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in makers}
    repeats = 2 if args.quick else args.repeats
    for repeat in range(repeats):
        for name, make in makers.items():
            samples[name].append(measure(name, make(), width, depth, root))
            stall, durable, _ = samples[name][-1]
            print(
                f"  repeat {repeat + 1}/{repeats} {name}: stall {stall:.3f} s, durable {durable:.3f} s",
                flush=True,
            )
    rows: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        stalls, durables = [v[0] for v in values], [v[1] for v in values]
        rows[name] = {
            "stall_s": {"median": statistics.median(stalls), "min": min(stalls), "max": max(stalls)},
            "durable_s": {"median": statistics.median(durables), "min": min(durables), "max": max(durables)},
            "checkpoint_bytes": values[0][2],
            "samples": [{"stall_s": s, "durable_s": d} for s, d, _ in values],
        }
    base = rows["TorchCheckpointIO"]["stall_s"]["median"]
    print(f"\nLightning save_checkpoint, {params / 1e6:.1f}M parameters + AdamW state, {repeats} repeats")
    print(
        f"{'checkpoint IO':<20} {'stall median (min-max)':>26} {'durable median':>16} {'stall vs torch':>15}"
    )
    for name, row in rows.items():
        st, du = row["stall_s"], row["durable_s"]
        print(
            f"{name:<20} {st['median']:>9.3f} s ({st['min']:.3f}-{st['max']:.3f})"
            f" {du['median']:>14.3f} s {base / st['median']:>14.1f}x"
        )
    return {
        "benchmark": "lightning save_checkpoint stall",
        "parameters": params,
        "width": width,
        "depth": depth,
        "repeats": repeats,
        "directory": str(root.resolve()),
        "torch": torch.__version__,
        "lightning": version("lightning"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2896, help="features per layer (2896 x 6: 50.3M)")
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="data/checkpoints/bench-lightning")
    parser.add_argument("--quick", action="store_true", help="a 5M model, 2 repeats")
    parser.add_argument("--json", help="write the results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    result = run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
