"""A training run that saves every 5 steps and on SIGTERM (``save_on_signal``), for the preemption tests.

    python tests/helpers/preempted_child.py DIR [--slow-final] [--signal-at N] [--signal-in-final]
        [--bare] [--timeout S]

Prints ``step N`` after each step. The weight is ``step`` everywhere, so a checkpoint's
content says which step it holds. Each step runs inside ``ckpt.whole_step()``, as the recipe
has it; ``--bare`` leaves that out. With ``--slow-final`` the final save's writes hang, so it
cannot commit within its 2 s. With ``--signal-at N`` the run sends itself SIGTERM in the middle
of step N, between its weight and its counter. With ``--signal-in-final`` it gets SIGTERM (on
its main thread) while its final save stages, as a rank saving for another's signal can. With
``WORLD_SIZE`` (and ``RANK``, ``MASTER_*``) set it is one rank of a gloo group whose steps
all-reduce, as DDP's do, and every rank saves.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nbckpt import Checkpointer
from nbckpt.engine._faults import armed


def arm_final(args: argparse.Namespace, final: threading.Event, stack: ExitStack) -> None:
    """What ``--slow-final`` and ``--signal-in-final`` do to the final save (``final``: begun)."""

    def hanging(location: str, name: str) -> None:
        if final.is_set():
            threading.Event().wait(600)  # storage that stopped answering

    def signal_now() -> None:
        if final.is_set() and not signalled.is_set():  # once, in the final save
            signalled.set()
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGTERM)

    signalled = threading.Event()
    if args.slow_final:
        stack.enter_context(armed("store.sink", hanging))
    if args.signal_in_final:
        stack.enter_context(armed("staging.fit", signal_now))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--slow-final", action="store_true")
    parser.add_argument("--signal-at", type=int, default=0)
    parser.add_argument("--signal-in-final", action="store_true")
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # nbckpt's log on stderr
    torch.manual_seed(0)  # the same bias on every rank: a replicated model
    model = torch.nn.Linear(64, 64)
    final = threading.Event()

    never_disarmed = ExitStack()  # for the rest of the process, its exit too
    arm_final(args, final, never_disarmed)
    step = 0

    def snapshot() -> tuple[dict[str, Any], int]:
        final.set()
        return {"model": model, "step": step}, step

    ranks = "WORLD_SIZE" in os.environ
    if ranks:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ckpt = Checkpointer(args.directory, keep=2)
    ckpt.save_on_signal(snapshot, timeout_s=args.timeout)
    while True:
        with nullcontext() if args.bare else ckpt.whole_step():
            with torch.no_grad():
                model.weight.fill_(float(step + 1))
            if ranks:
                dist.all_reduce(torch.ones(1))  # the gradients' all-reduce: the ranks keep in step
            if step + 1 == args.signal_at:
                signal.raise_signal(signal.SIGTERM)  # to this thread: its handler runs right here
            step += 1
        if step % 5 == 0:
            ckpt.save({"model": model, "step": step}, step=step)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
