"""A training run that saves every 5 steps and on SIGTERM (``save_on_signal``), for the preemption tests.

    python tests/helpers/preempted_child.py DIR [--slow-final]

Prints ``step N`` after each step. The weight is ``step`` everywhere, so a checkpoint's
content says which step it holds. With ``--slow-final`` the final save's writes hang, so it
cannot commit within its 2 s.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import Any

import torch

from nbckpt import Checkpointer
from nbckpt.engine._store import LocalStore


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--slow-final", action="store_true")
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
        # The handler runs between any two bytecodes of the loop, so the counter beside the
        # weight may be a step behind it (it was in CI, whichever line came first; holding the
        # signal back cannot help, as the engine's threads take it): the step is the weight's.
        final.set()
        held = int(model.weight.detach()[0, 0])
        return {"model": model, "step": held}, held

    ckpt = Checkpointer(args.directory, keep=2)
    ckpt.save_on_signal(snapshot, timeout_s=2.0)
    while True:
        with torch.no_grad():
            model.weight.fill_(float(step + 1))
        step += 1
        if step % 5 == 0:
            ckpt.save({"model": model, "step": step}, step=step)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
