"""A training run that saves every 5 steps and on SIGTERM (``save_on_signal``), for the preemption tests.

    python tests/helpers/preempted_child.py DIR [--slow-final] [--signal-at N] [--bare]

Prints ``step N`` after each step. The weight is ``step`` everywhere, so a checkpoint's
content says which step it holds. Each step runs inside ``ckpt.whole_step()``, as the recipe
has it; ``--bare`` leaves that out. With ``--slow-final`` the final save's writes hang, so it
cannot commit within its 2 s. With ``--signal-at N`` the run sends itself SIGTERM in the middle
of step N, between its weight and its counter.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from contextlib import nullcontext
from typing import Any

import torch

from nbckpt import Checkpointer
from nbckpt.engine._store import LocalStore


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--slow-final", action="store_true")
    parser.add_argument("--signal-at", type=int, default=0)
    parser.add_argument("--bare", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # nbckpt's log on stderr
    model = torch.nn.Linear(64, 64)
    final = threading.Event()
    if args.slow_final:
        original = LocalStore.sink

        def hanging_sink(store: LocalStore, location: str, name: str) -> Any:
            if final.is_set():
                threading.Event().wait(600)  # storage that stopped answering
            return original(store, location, name)

        LocalStore.sink = hanging_sink  # type: ignore[method-assign]
    step = 0

    def snapshot() -> tuple[dict[str, Any], int]:
        final.set()
        return {"model": model, "step": step}, step

    ckpt = Checkpointer(args.directory, keep=2)
    ckpt.save_on_signal(snapshot, timeout_s=2.0)
    while True:
        with nullcontext() if args.bare else ckpt.whole_step():
            with torch.no_grad():
                model.weight.fill_(float(step + 1))
            if step + 1 == args.signal_at:
                signal.raise_signal(signal.SIGTERM)  # to this thread: its handler runs right here
            step += 1
        if step % 5 == 0:
            ckpt.save({"model": model, "step": step}, step=step)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
