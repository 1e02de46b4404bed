"""The training run the crash tests kill: an async checkpoint every step, progress on a log.

Every step's state is a pure function of ``(seed, step)``, so the parent can recompute what
any checkpoint must hold without reading anything the child wrote except through nbckpt.
Run as a script (``python tests/crash_child.py DIR --seed 1 --steps 3``) for the crash-point
tests, or call :func:`train` in a forked process for the random-kill trials.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nbckpt import Checkpointer

WIDTH = 768  # two Linear layers: about 4.7 MB of float32, so a save takes a while


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def train_step(model: nn.Module, seed: int, step: int) -> None:
    """Stand-in for an optimizer step: the parameters become a function of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))


def make_state(model: nn.Module, seed: int, step: int) -> dict[str, Any]:
    return {"model": model, "step": step, "meta": {"seed": seed, "loss": 1.0 / (step + 1)}}


def expected_state(seed: int, step: int) -> dict[str, Any]:
    """What the checkpoint of ``step`` must restore to, bit for bit."""
    model = build_model()
    train_step(model, seed, step)
    return make_state(model, seed, step)


def train(
    directory: str,
    seed: int,
    steps: int,
    keep: int | None,
    say: Callable[[str], None],
    overlap: bool = False,
) -> None:
    """Resume from the newest checkpoint (if any), then save every step asynchronously.

    Prints ``ready START`` once set up and ``committed N`` after each save has committed.
    With ``overlap`` the copy runs behind the caller, who waits for it before the next step.
    """
    ckpt = Checkpointer(directory, mode="async", keep=keep)
    model = build_model()
    state = make_state(model, seed, 0)
    start = ckpt.restore(state) + 1 if ckpt.steps() else 0
    say(f"ready {start}")
    pending = []
    for step in range(start, start + steps):
        ckpt.wait_staged()  # the overlap contract: the copy is done before the state changes
        train_step(model, seed, step)
        state.update(make_state(model, seed, step))
        pending.append(ckpt.save(state, step=step, overlap=overlap))
        for handle in [h for h in pending if h.done()]:
            handle.wait()
            say(f"committed {handle.step}")
            pending.remove(handle)
    for handle in pending:
        handle.wait()
        say(f"committed {handle.step}")
    ckpt.close()
    say("finished")


def train_logged(
    directory: str, seed: int, steps: int, keep: int | None, log_path: str, overlap: bool = False
) -> None:
    """:func:`train` writing its progress with one unbuffered write per line (survives SIGKILL)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def say(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    train(directory, seed, steps, keep, say, overlap)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", type=int, default=None)
    args = parser.parse_args(argv)
    train(args.directory, args.seed, args.steps, args.keep, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
