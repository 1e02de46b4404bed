"""The bench on many ranks, at 4 ranks on /dev/shm and on local disk (issue 28's speed targets).

    .venv/bin/python benchmarks/scale.py --json data/results/scale-cpu.json
    .venv/bin/python benchmarks/scale.py --quick        # small state, 2 repeats: checks the script
    .venv/bin/python benchmarks/scale.py --hosts 2      # 2x2: two torchrun agents as two hosts

Each repeat launches ``torchrun --nproc-per-node 4 -m nbckpt bench`` once per target, the
targets interleaved (repeat 1: shm, disk; repeat 2: disk, shm; ...), each run holding the
``none`` baseline, ``nbckpt-async`` and ``dcp-async-stager`` (DCP at its best: a reused stager,
cached plans, the process executor) in the bench's own rotated order, and the concurrent raw
write of all 4 ranks measured before them. Per run, three ratios against the issue's targets:

- nbckpt-async's aggregate persist bandwidth (all ranks' bytes over first start to last commit,
  median over its checkpoints) over the concurrent raw-write floor of the same run: >= 0.8;
- nbckpt-async's stall (median over ranks) over dcp-async-stager's: <= 0.7;
- the bench's own coordination per step (its barriers and gather, outside the lanes' clocks,
  on the rank that spent most) over the baseline's mean step time: <= 0.02.

Each row: the median over repeats and the 95 % interval of the ratios' geometric mean.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from engine import interval, machine, ratio_interval, write_json  # the same statistics

#: Names a rank's host in the bench's JSON (docs/storage.md); here it tells local agents apart.
HOST_VARIABLE = "NBCKPT_BENCH_HOST"

RANKS = 4
STRATEGIES = ("nbckpt-async", "dcp-async-stager")
TARGETS = {"shm": "/dev/shm", "disk": "data/checkpoints"}
CHECKS = (  # name, what, target, at most (True) or at least
    ("aggregate_vs_floor", "nbckpt-async aggregate / concurrent floor", 0.8, False),
    ("stall_vs_dcp_best", "nbckpt-async stall / dcp-async-stager stall", 0.7, True),
    ("coordination_vs_step", "bench coordination per step / step time", 0.02, True),
)


def launchers(args: argparse.Namespace, label: str) -> list[tuple[list[str], dict[str, str]]]:
    """The torchrun command and environment of each agent: one, or ``--hosts`` told apart by
    ``NBCKPT_BENCH_HOST`` and meeting at one c10d rendezvous, as agents on separate hosts do."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run"]
    if args.hosts == 1:
        return [([*run, "--standalone", "--nproc-per-node", str(args.ranks)], env)]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    rendezvous = ["--nnodes", str(args.hosts), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    per_host = ["--rdzv-id", f"scale-{label}", "--nproc-per-node", str(args.ranks // args.hosts)]
    return [
        ([*run, *rendezvous, *per_host], {**env, HOST_VARIABLE: f"host-{node}"}) for node in range(args.hosts)
    ]


def run_once(target: str, args: argparse.Namespace, scratch: str, label: str) -> dict[str, Any]:
    """One torchrun job of the bench on ``target`` (one agent per host); its JSON document."""
    out = os.path.join(scratch, f"run-{label}.json")
    directory = tempfile.mkdtemp(prefix="nbckpt-scale-", dir=target)
    bench = [
        "-m",
        "nbckpt",
        "bench",
        "--dir",
        directory,
        "--size-mb",
        str(args.size_mb),
        "--compute-ms",
        str(args.compute_ms),
        "--strategies",
        ",".join(STRATEGIES),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--repeats",
        "1",
        "--threads",
        "1",
        "--quiet",
        "--json",
        out,
    ]
    agents = [
        subprocess.Popen([*command, *bench], env=env, stdout=subprocess.DEVNULL)
        for command, env in launchers(args, label)
    ]
    try:
        for agent in agents:
            code = agent.wait(timeout=args.timeout)
            if code != 0:
                raise SystemExit(f"torchrun agent {agents.index(agent)} exited with {code} on {target}")
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        shutil.rmtree(directory, ignore_errors=True)
    document: dict[str, Any] = json.loads(Path(out).read_text())
    return document


def ratios(document: dict[str, Any]) -> dict[str, float]:
    job = document["job"]
    by_name = {row["strategy"]: row for row in job["strategies"]}
    ours, dcp = by_name["nbckpt-async"], by_name["dcp-async-stager"]
    (baseline,) = [row for row in document["results"] if row["strategy"] == "none"]
    floor = job["floors"]["concurrent_write_gbs"] or float("nan")
    return {
        "aggregate_gbs": ours["aggregate_write_gbs"],
        "floor_gbs": floor,
        "stall_s": ours["stall_s"]["median"],
        "dcp_stall_s": dcp["stall_s"]["median"],
        "coordination_per_step_s": job["coordination"]["per_step_s"],
        "step_s": baseline["mean_step_s"],
        "aggregate_vs_floor": ours["aggregate_write_gbs"] / floor,
        "stall_vs_dcp_best": ours["stall_s"]["median"] / dcp["stall_s"]["median"],
        "coordination_vs_step": job["coordination"]["per_step_s"] / baseline["mean_step_s"],
    }


def summarise(runs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for target, rows in runs.items():
        ratio_names = {name for name, _, _, _ in CHECKS}
        figures = {key: interval([row[key] for row in rows]) for key in rows[0] if key not in ratio_names}
        checks = {}
        for name, _, limit, at_most in CHECKS:
            found = ratio_interval([row[name] for row in rows])
            met = found["median"] <= limit if at_most else found["median"] >= limit
            checks[name] = {**found, "target": limit, "met": bool(met)}
        out[target] = {"figures": figures, "checks": checks}
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'target':<6} {'check':<48} {'median':>8} {'95 % interval':>20} {'target':>8} met"]
    for target, found in summary.items():
        for name, what, _, at_most in CHECKS:
            row = found["checks"][name]
            bound = f"{'<=' if at_most else '>='} {row['target']:g}"
            span = f"[{row['lo']:.3f}, {row['hi']:.3f}]"
            met = "yes" if row["met"] else "no"
            lines.append(f"{target:<6} {what:<48} {row['median']:>8.3f} {span:>20} {bound:>8} {met}")
        figures = found["figures"]
        lines.append(
            f"{'':<6} aggregate {figures['aggregate_gbs']['median']:.3f} GB/s, floor "
            f"{figures['floor_gbs']['median']:.3f} GB/s; stall {figures['stall_s']['median']:.4f} s "
            f"against DCP-best {figures['dcp_stall_s']['median']:.4f} s; step "
            f"{figures['step_s']['median']:.4f} s, coordination "
            f"{figures['coordination_per_step_s']['median'] * 1e3:.3f} ms per step"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=RANKS, help="ranks in all, over every host")
    parser.add_argument("--hosts", type=int, default=1, help="torchrun agents as hosts (2x2: --hosts 2)")
    parser.add_argument("--size-mb", type=float, default=256.0, help="state per rank, MiB")
    parser.add_argument("--compute-ms", type=float, default=50.0, help="compute per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per torchrun, seconds")
    parser.add_argument("--targets", default=",".join(TARGETS), help="from: " + ", ".join(TARGETS))
    parser.add_argument("--quick", action="store_true", help="8 MiB per rank, 2 repeats: checks the script")
    parser.add_argument("--note", default="", help="recorded with the results (e.g. 'under load')")
    parser.add_argument("--json", help="write the results here (e.g. data/results/scale-cpu.json)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.size_mb, args.compute_ms, args.steps, args.every = 2, 8.0, 5.0, 6, 3
    if args.hosts < 1 or args.ranks % args.hosts:
        parser.error(f"--ranks {args.ranks} does not split evenly over --hosts {args.hosts}")
    targets = [name.strip() for name in args.targets.split(",") if name.strip()]
    os.makedirs(TARGETS["disk"], exist_ok=True)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = targets if repeat % 2 == 0 else targets[::-1]  # interleaved, alternating
            for name in order:
                print(
                    f"repeat {repeat + 1}/{args.repeats}: {args.ranks} ranks on {args.hosts} host(s), {name}",
                    file=sys.stderr,
                    flush=True,
                )
                document = run_once(TARGETS[name], args, scratch, f"{name}-{repeat}")
                runs[name].append(ratios(document))
    summary = summarise(runs)
    print(table(summary))
    if args.note:
        print(f"note: {args.note}")
    write_json(
        args.json,
        {"options": vars(args), "runs": runs, "summary": summary, "note": args.note, "machine": machine()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
