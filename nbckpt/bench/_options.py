"""The options of a benchmark run, defined once for ``nbckpt bench`` and ``%ckpt_bench``.

:func:`add_bench_arguments` puts them on an argparse parser; :func:`run_bench_from_args`
checks them all before anything is measured, then runs the comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch

from .._errors import ConfigError
from .._util import check_count, is_url, writable_directory
from ._compare import DEFAULT_REPEATS, DEFAULT_STRATEGIES, compare
from ._comparison import Comparison
from ._runner import Progress, check_run_args
from ._strategies import STRATEGIES, get_strategy
from ._workloads import make_workload

__all__ = ["add_bench_arguments", "run_bench_from_args"]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``nbckpt bench`` (and ``%ckpt_bench``)."""
    parser.add_argument("-d", "--dir", default="data/checkpoints/bench",
                        help="where checkpoints are written, a directory or s3:// URL "
                        "(default: %(default)s)")
    parser.add_argument("--preset", default=None,
                        help="GPT workload preset: tiny, small, base, 350m, 1b, 3b "
                        "(default: tiny unless --size-mb is given)")
    parser.add_argument("--size-mb", type=float, default=None,
                        help="synthetic workload: a state of this many MiB instead of a GPT "
                        "(default: none)")
    parser.add_argument("--compute-ms", type=float, default=5.0,
                        help="synthetic workload: compute per step in ms (default: %(default)s)")
    parser.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                        help="comma-separated strategies, from: " + ", ".join(STRATEGIES)
                        + " (default: %(default)s); none is added when missing")
    parser.add_argument("--steps", type=int, default=20,
                        help="training steps per run (default: %(default)s)")
    parser.add_argument("--every", type=int, default=5,
                        help="checkpoint every K steps (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                        help="repeats; each runs every strategy, in an order rotated per repeat; "
                        "overhead pairs every checkpoint cycle with the baseline's beside it, and "
                        "its interval counts the repeats, not the cycles, as independent "
                        "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for training (default: torch's choice, one "
                        "per core); fewer than the cores leaves one for background writes, as "
                        "on a GPU node")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the warm-up steps and saves (default: warm up)")
    parser.add_argument("--json", default=None, metavar="OUT",
                        help="write the results as JSON to OUT (default: no file)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress lines (default: on stderr, a line per checkpoint and per "
                        "run: strategy, repeat, step, the stall, elapsed and expected time)")


def run_bench_from_args(args: argparse.Namespace, progress: Progress | None = None) -> Comparison:
    """Validate ``nbckpt bench``'s options first, then run the comparison (``%ckpt_bench`` too)."""
    if args.preset is not None and args.size_mb is not None:
        raise ConfigError("give --preset or --size-mb, not both")
    names = [name.strip() for name in args.strategies.split(",") if name.strip()]
    if not names:
        raise ConfigError("--strategies names no strategy")
    for name in names:
        get_strategy(name)  # unknown: the one-line error that lists them
    check_run_args(args.steps, args.every)
    check_count(args.repeats, "--repeats")
    if args.threads is not None:
        check_count(args.threads, "--threads")
    if args.json is not None:
        parent = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            raise ConfigError(f"--json {args.json} is a directory; give a file name")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--json {args.json}: directory {parent} does not exist or is not writable")
    workload = make_workload(args.preset, args.size_mb, args.device, compute_ms=args.compute_ms)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    created = not is_url(args.dir) and not os.path.exists(args.dir)
    if not is_url(args.dir):
        writable_directory(args.dir, "--dir")
    try:
        return compare(workload, names, args.dir, steps=args.steps, every=args.every,
                       repeats=args.repeats, warmup=not args.no_warmup, progress=progress)
    except BaseException:
        if created:
            shutil.rmtree(args.dir, ignore_errors=True)
        raise
