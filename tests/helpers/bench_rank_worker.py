"""One rank of ``nbckpt bench`` under torchrun, one rank's saves made late on purpose.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/helpers/bench_rank_worker.py \
    SLOW_RANK SLOW_S bench --dir DIR ...

The fault seam (``arm_slow``, in ``nbckpt.bench._ranks``) is armed here, in the rank's own code, as
``arm_crash`` is by the crash tests' children; the rest is ``nbckpt``'s command line itself.
"""

from __future__ import annotations

import sys

from nbckpt import cli
from nbckpt.bench import _internal


def main(argv: list[str]) -> int:
    slow_rank, slow_s, *command = argv
    _internal.arm_slow(int(slow_rank), float(slow_s))
    return cli.main(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
