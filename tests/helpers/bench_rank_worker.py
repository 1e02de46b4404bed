"""One rank of ``nbckpt bench`` under torchrun, one rank's saves made late on purpose.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/bench_rank_worker.py \
    SLOW_RANK SLOW_S bench --dir DIR ...

or, the same from Python (``nbckpt.bench.compare`` called on every rank, as a user's script
under torchrun calls it), rank 0 writing its comparison to OUT and every rank printing a line::

    ... tests/helpers/bench_rank_worker.py SLOW_RANK SLOW_S compare DIR OUT

or the room check before a run's first chunk, where rank 1 alone cannot fit its saves in DIR::

    ... tests/helpers/bench_rank_worker.py -1 0 room DIR

The fault seam (``arm_slow``, in ``nbckpt.bench._ranks``) is armed here, in the rank's own code, as
``arm_crash`` is by the crash tests' children; the rest is ``nbckpt``'s own.
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from nbckpt import ConfigError, bench, cli
from nbckpt.bench import _internal


def compare_from_python(directory: str, out: str) -> int:
    """``compare()`` on a 1 MiB state per rank, nbckpt's async saves at steps 2 and 4."""
    workload = bench.synthetic(1.0, compute_ms=1.0)
    comparison = bench.compare(
        workload, ["nbckpt-async"], directory, steps=4, every=2, repeats=1, warmup=False, progress=None
    )
    if comparison.job:
        comparison.to_json(out)
    _line({"rank": int(os.environ["RANK"]), "job": bool(comparison.job), "ranks": len(comparison.ranks)})
    return 0


def _line(line: dict[str, object]) -> None:
    # one write: under PYTHONUNBUFFERED print() writes the text and its newline apart, and the two
    # ranks sharing torchrun's stdout ran their lines into one
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def room_on_one_rank(directory: str) -> int:
    """The room check before a run's first chunk (``nbckpt.bench._room``) where only rank 1's
    saves cannot fit (a state of 2**50 bytes, 4096 saves); each rank's line says what it raised."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        _internal.check_room(
            directory,
            [(_internal.get_strategy("torch-save"), 2**50 if rank == 1 else 1)],
            4096,
            dist.group.WORLD,
        )
        error = None
    except ConfigError as exc:
        error = str(exc)
    dist.destroy_process_group()
    _line({"rank": rank, "error": error})
    return 0


def main(argv: list[str]) -> int:
    slow_rank, slow_s, *command = argv
    _internal.arm_slow(int(slow_rank), float(slow_s))
    if command[0] == "compare":
        return compare_from_python(*command[1:])
    if command[0] == "room":
        return room_on_one_rank(command[1])
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
