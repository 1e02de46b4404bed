"""What caps nbckpt's aggregate persist with every rank writing at once, part by part.

    .venv/bin/python benchmarks/scale_parts.py --json data/results/scale-parts-cpu-shm.json
    .venv/bin/python benchmarks/scale_parts.py --target data/checkpoints --json ...
    .venv/bin/python benchmarks/scale_parts.py --quick          # small state: checks the script

Issue 28's persist target sets nbckpt-async's aggregate persist against the raw write of every
rank at once. This splits what lies between the two, on the same target in the same run (one
torchrun of ``--ranks`` processes, gloo), each part writing ``--size-mb`` per rank:

- ``raw-1``: one stream per rank, 4 MiB writes and an fsync (the bench's idle floor);
- ``raw-2``: the same bytes in two files by two threads, nbckpt's ``writer_threads``;
- ``hashed-2``: ``raw-2`` through the engine's own ``write_image`` (1 MiB pieces, each hashed
  with xxh3 as it is written: nbckpt's block checksums), with no coordination;
- ``nbckpt``: ``Checkpointer.save`` (async) of a state of the same bytes: its writes, the ranks'
  exchanges and rank 0's commit, timed from its events as the bench times them (the first
  rank's ``persist`` start to the last ``commit``; the copy before it is left out).

All of it on one host (``--standalone``): the ranks share the monotonic clock the engine's
events are on. The raw parts start at a barrier and run from the first rank's first byte to the last rank's
end. Per repeat the parts run in an order rotated by one place, and each keeps only its last
two rounds (an nbckpt step is deleted through its Checkpointer), so that all of them write into
pages freed alike. Ratios are paired per repeat: median and the 95 % interval of the geometric
mean. CPU seconds per GB are every rank's (user+system of the process over the part) over the
part's bytes; nbckpt's hold its copy into the staging buffer too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from engine import cpu_seconds, interval, machine, parallel, ratio_interval, write_json  # the same statistics

from nbckpt import Checkpointer
from nbckpt._util import GB, MIB
from nbckpt.engine._files import LocalSink, write_image
from nbckpt.engine._internal import write_all

PARTS = ("raw-1", "raw-2", "hashed-2", "nbckpt")
RATIOS = (  # name, numerator, denominator: a part's aggregate rate over another's
    ("raw2_vs_raw1", "raw-2", "raw-1"),
    ("hashed_vs_raw2", "hashed-2", "raw-2"),
    ("nbckpt_vs_hashed", "nbckpt", "hashed-2"),
    ("nbckpt_vs_raw1", "nbckpt", "raw-1"),
)
CHUNK = 4 * MIB


def raw_write(path: str, data: memoryview) -> None:
    """``data`` to a new file in 4 MiB writes, fsync'd: the floor's write."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for start in range(0, len(data), CHUNK):
            write_all(fd, data[start : start + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def hashed_write(path: str, data: memoryview) -> None:
    """``data`` to a new file as nbckpt writes one: 1 MiB pieces, each hashed as it goes, fsync."""
    write_image(LocalSink(path), data, fsync=True)


class Rank:
    """This rank's state, its folder for the raw parts and its Checkpointer."""

    def __init__(self, target: str, size: int) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tensor = torch.rand(size // 4)  # random bytes: nothing compresses them
        self.data = self.tensor.numpy().data.cast("B")
        self.folder = os.path.join(target, f"raw-rank{self.rank}")
        os.makedirs(self.folder, exist_ok=True)
        self.ckpt = Checkpointer(os.path.join(target, "nbckpt"), mode="async")
        self.round = 0

    def raw(self, part: str) -> tuple[int, int]:
        """One round of a raw part, from the barrier: its wall-clock start and end."""
        halves = (
            [self.data]
            if part == "raw-1"
            else [self.data[: len(self.data) // 2], self.data[len(self.data) // 2 :]]
        )
        names = [os.path.join(self.folder, f"{part}-{self.round}-{i}") for i in range(len(halves))]
        write = hashed_write if part == "hashed-2" else raw_write
        jobs = [partial(write, name, half) for name, half in zip(names, halves, strict=True)]
        dist.barrier()
        begin = time.perf_counter_ns()  # the engine's events' clock: one host's, shared by its ranks
        parallel(jobs)
        return begin, time.perf_counter_ns()

    def forget_raw(self, part: str) -> None:
        for name in os.listdir(self.folder):
            if name.startswith(f"{part}-{self.round - 2}-"):
                os.unlink(os.path.join(self.folder, name))

    def nbckpt(self, step: int) -> tuple[int, int]:
        """One async save and its commit; its first persist start and its commit's end."""
        dist.barrier()
        self.ckpt.save({f"state.rank{self.rank}": self.tensor}, step)
        self.ckpt.wait()
        events = [e for e in self.ckpt.timeline.events if e.step == step]
        begin = min(e.start_ns for e in events if e.kind == "persist")
        end = max(e.end_ns for e in events if e.kind == "commit")
        if step > 2:
            self.ckpt.delete(step - 2)  # keeps two, as the raw parts do
        return begin, end

    def run(self, part: str, step: int) -> tuple[int, int, float]:
        before = cpu_seconds()
        begin, end = self.nbckpt(step) if part == "nbckpt" else self.raw(part)
        spent = cpu_seconds() - before
        if part != "nbckpt":
            self.forget_raw(part)
        return begin, end, spent


def measure(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank's rounds; rank 0's summary (None elsewhere)."""
    dist.init_process_group("gloo")
    rank = Rank(args.target, int(args.size_mb * MIB))
    rows: list[dict[str, Any]] = []
    try:
        for warm in range(2):  # first touch of every page each part writes, and the plans
            for part in PARTS:
                rank.run(part, step=1 + warm)
            rank.round += 1
        for repeat in range(args.repeats):
            order = PARTS[repeat % len(PARTS) :] + PARTS[: repeat % len(PARTS)]
            rates: dict[str, Any] = {}
            for part in order:
                begin, end, spent = rank.run(part, step=3 + repeat)
                spans: list[Any] = [None] * rank.world
                dist.all_gather_object(spans, (begin, end, spent))
                seconds = (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e9
                total = len(rank.data) * rank.world
                rates[part] = {
                    "gbs": total / seconds / GB,
                    "cpu_s_per_gb": sum(s[2] for s in spans) / (total / GB),
                }
            rank.round += 1
            rows.append(rates)
    finally:
        rank.ckpt.close()
        dist.destroy_process_group()
    if rank.rank != 0:
        return None
    figures = {part: interval([row[part]["gbs"] for row in rows]) for part in PARTS}
    cpu = {part: interval([row[part]["cpu_s_per_gb"] for row in rows]) for part in PARTS}
    ratios = {name: ratio_interval([row[a]["gbs"] / row[b]["gbs"] for row in rows]) for name, a, b in RATIOS}
    return {"rows": rows, "gbs": figures, "cpu_s_per_gb": cpu, "ratios": ratios}


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'part':<10} {'GB/s':>8} {'95 % interval':>18} {'CPU s/GB':>9}"]
    for part in PARTS:
        rate, cpu = summary["gbs"][part], summary["cpu_s_per_gb"][part]
        span = f"[{rate['lo']:.2f}, {rate['hi']:.2f}]"
        lines.append(f"{part:<10} {rate['median']:>8.2f} {span:>18} {cpu['median']:>9.3f}")
    lines.append("")
    for name, a, b in RATIOS:
        found = summary["ratios"][name]
        lines.append(f"{a + ' / ' + b:<22} {found['median']:.3f} [{found['lo']:.3f}, {found['hi']:.3f}]")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size-mb", type=float, default=64.0, help="per rank (scale.py's)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--target", default="/dev/shm", help="a directory (a fresh folder is made in it)")
    parser.add_argument("--quick", action="store_true", help="4 MiB per rank, 4 repeats")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rank-of-torchrun", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.repeats = 4.0, 4
    if args.rank_of_torchrun:
        summary = measure(args)
        if summary is not None and args.json:
            write_json(args.json, summary)
        return 0
    folder = tempfile.mkdtemp(prefix="nbckpt-parts-", dir=args.target)
    out = os.path.join(folder, "summary.json")
    try:
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.ranks}",
        ]
        rank_args = ["--rank-of-torchrun", "--size-mb", str(args.size_mb), "--repeats", str(args.repeats)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(
            [*torchrun, __file__, *rank_args, "--target", folder, "--json", out], env=env, check=True
        )
        summary = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(table(summary))
    write_json(args.json, {"options": vars(args), **summary, "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
