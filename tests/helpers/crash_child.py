"""The training run the crash tests kill: an async checkpoint every step, progress on a log.

Every generation's state is a pure function of ``(seed, generation)``, so the parent can
recompute what any checkpoint must hold without reading anything the child wrote except
through nbckpt. A generation is saved as its own step, or with ``ring`` as step
``generation % ring`` (saving the same steps again and again). Run as a script
(``python tests/helpers/crash_child.py DIR --seed 1 --steps 3``) for the crash-point tests, or
call :func:`train` in a forked process for the random-kill trials.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from nbckpt import Checkpointer
from nbckpt.engine import _store
from nbckpt.engine._faults import armed

WIDTH = 768  # two Linear layers: about 4.7 MB of float32, so a save takes a while


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def train_step(model: nn.Module, seed: int, step: int) -> None:
    """Stand-in for an optimizer step: the parameters become a function of (seed, step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))


def make_state(model: nn.Module, seed: int, generation: int) -> dict[str, Any]:
    return {
        "model": model,
        "step": generation,
        "meta": {"seed": seed, "loss": 1.0 / (generation + 1), "generation": generation},
    }


def expected_state(seed: int, generation: int) -> dict[str, Any]:
    """What a checkpoint of ``generation`` must restore to, bit for bit."""
    model = build_model()
    train_step(model, seed, generation)
    return make_state(model, seed, generation)


def newest_generation(ckpt: Checkpointer) -> int:
    """The newest generation any committed step holds (-1 for none)."""
    return max((int(ckpt.load(step)["meta"]["generation"]) for step in ckpt.steps()), default=-1)


def train(
    directory: str,
    seed: int,
    steps: int,
    keep: int | None,
    say: Callable[[str], None],
    overlap: bool = False,
    ring: int | None = None,
    mirror: str | None = None,
    rewind: bool = False,
) -> None:
    """Resume after the newest generation (if any), then save every generation asynchronously.

    Prints ``ready START`` once set up and ``committed STEP GENERATION`` after each save has
    committed. With ``overlap`` the copy runs behind the caller, who waits for it before the
    next step; with ``ring`` generations go to steps ``0..ring-1`` over and over; with
    ``mirror`` every commit is uploaded there too; with ``rewind`` the run goes back one step
    first (restores the one before the newest), so its first save sets the newest step aside.
    """
    ckpt = Checkpointer(directory, mode="async", keep=keep, mirror=mirror)
    model = build_model()
    state = make_state(model, seed, 0)
    start = newest_generation(ckpt) + 1
    say(f"ready {start}")
    older = [step for step in ckpt.steps() if step < start - 1]
    if rewind and older:
        start = ckpt.restore(state, step=older[-1]) + 1  # generation == step without a ring
    pending = []
    for generation in range(start, start + steps):
        ckpt.wait_staged()  # the overlap contract: the copy is done before the state changes
        train_step(model, seed, generation)
        state.update(make_state(model, seed, generation))
        step = generation % ring if ring else generation
        handle = ckpt.save(state, step=step, overlap=overlap, overwrite=True)
        pending.append((handle, generation))
        for done in [p for p in pending if p[0].done()]:
            done[0].wait()
            say(f"committed {done[0].step} {done[1]}")
            pending.remove(done)
    for handle, generation in pending:
        handle.wait()
        say(f"committed {handle.step} {generation}")
    ckpt.close()
    say("finished")


def train_logged(
    directory: str,
    seed: int,
    steps: int,
    keep: int | None,
    log_path: str,
    overlap: bool = False,
    ring: int | None = None,
    mirror: str | None = None,
    rewind: bool = False,
) -> None:
    """:func:`train` writing its progress with one unbuffered write per line (survives SIGKILL)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def say(line: str) -> None:
        os.write(fd, f"{line}\n".encode())

    train(directory, seed, steps, keep, say, overlap, ring, mirror, rewind)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", type=int, default=None)
    parser.add_argument("--ring", type=int, default=None, help="save generations as steps 0..RING-1")
    parser.add_argument(
        "--no-exchange",
        action="store_true",
        help="behave as on NFS: no renameat2(RENAME_EXCHANGE) for re-saves",
    )
    parser.add_argument("--crash-at", default=None, help="a crash point (_store.arm_crash): die there")
    args = parser.parse_args(argv)
    _store.arm_crash(args.crash_at)
    with armed("file.exchange", _no_exchange) if args.no_exchange else nullcontext():
        train(
            args.directory,
            args.seed,
            args.steps,
            args.keep,
            lambda line: print(line, flush=True),
            ring=args.ring,
        )
    return 0


def _no_exchange(a: str, b: str) -> None:
    """NFS: the file system offers no renameat2(RENAME_EXCHANGE)."""
    raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
