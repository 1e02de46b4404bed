"""One rank of ``nbckpt bench`` under torchrun, one rank's saves made late on purpose.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/bench_rank_worker.py \
    SLOW_RANK SLOW_S bench --dir DIR ...

or, the same from Python (``nbckpt.bench.compare`` called on every rank, as a user's script
under torchrun calls it), rank 0 writing its comparison to OUT and every rank printing a line::

    ... tests/helpers/bench_rank_worker.py SLOW_RANK SLOW_S compare DIR OUT

The fault seam (``arm_slow``, in ``nbckpt.bench._ranks``) is armed here, in the rank's own code, as
``arm_crash`` is by the crash tests' children; the rest is ``nbckpt``'s own.
"""

from __future__ import annotations

import json
import os
import sys

from nbckpt import bench, cli
from nbckpt.bench import _internal


def compare_from_python(directory: str, out: str) -> int:
    """``compare()`` on a 1 MiB state per rank, nbckpt's async saves at steps 2 and 4."""
    workload = bench.synthetic(1.0, compute_ms=1.0)
    comparison = bench.compare(
        workload, ["nbckpt-async"], directory, steps=4, every=2, repeats=1, warmup=False, progress=None
    )
    if comparison.job:
        comparison.to_json(out)
    line = {"rank": int(os.environ["RANK"]), "job": bool(comparison.job), "ranks": len(comparison.ranks)}
    # one write: under PYTHONUNBUFFERED print() writes the text and its newline apart, and the two
    # ranks sharing torchrun's stdout ran their lines into one
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    slow_rank, slow_s, *command = argv
    _internal.arm_slow(int(slow_rank), float(slow_s))
    if command[0] == "compare":
        return compare_from_python(*command[1:])
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
