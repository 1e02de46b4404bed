"""The bench on many ranks, at 4 ranks on /dev/shm and on local disk (issue 28's speed targets).

    .venv/bin/python benchmarks/scale.py --json data/results/scale-cpu.json
    .venv/bin/python benchmarks/scale.py --quick        # small state, 2 repeats: checks the script
    .venv/bin/python benchmarks/scale.py --hosts 2      # 2x2: two torchrun agents as two hosts

Each repeat launches ``torchrun --nproc-per-node 4 -m nbckpt bench`` once per compute mode and
target, interleaved (repeat 1: host shm, host disk, idle shm, idle disk; repeat 2 the reverse;
...), each run holding the ``none`` baseline, ``nbckpt-async`` (nbckpt's default: the copy inside
the stall), ``nbckpt-async-overlap`` (the copy behind the loop, waited for before the update) and
``dcp-async-stager`` (DCP at its best: a reused stager whose async staging copies behind the
loop, cached plans, the process executor) in the bench's own rotated order, and the concurrent
raw write of all 4 ranks measured before them.

The compute modes (``--compute``) model two deployments:

- ``host``: each step multiplies matrices on the host's cores, as training on CPU does. Here 4
  ranks share 2 cores, so the checkpoint's background copy and writes compete with training for
  them (nbckpt's writers at ``writer_nice=10``, below training).
- ``idle``: ``nbckpt bench --idle-compute``: each step's compute stands for device compute, the
  host's cores idle through it, as a GPU node's CPU is while its kernels run. Both modes are
  checked against the same targets and reported apart.

Per run, ratios against the issue's targets:

- nbckpt-async's aggregate persist bandwidth over the concurrent raw-write floor of the same run:
  >= 0.8. Declared here, before any run: "persist" is the write phase of a save (stage, persist,
  commit), so the figure is all ranks' bytes over the first rank's write start to the last
  commit (median over its checkpoints), like against like with the floor, a raw write with no
  copy before it. Which floor depends on the mode, as the job sees its storage:
  - ``host``: the floor beside training (``job.floors.beside_training``): every rank's share
    written raw (no copy, no checksum, no manifest) by as many threads as nbckpt's writers, at
    their ``nice``, in a lane that takes its turns with the strategies and trains the same steps
    while it writes, its span measured as nbckpt's persist is (the first rank's write start to
    the last fsync's end, median over its checkpoints). Training takes the host's cores from
    both alike. The ratio against the idle floor is printed beside it, with no target.
  - ``idle``: the idle floor (``job.floors.concurrent_write_gbs``), written between turns with no
    rank training: every rank prepared (its directory, its bytes) before a barrier releases them
    all, each rank's first byte to its fsync's end. (Until issue 28's aggregate work its span
    began before the preparation, 43 ms median under load: 0-20 % shorter than the real one.)
    Until this floor beside training, host mode was checked against this idle floor too, which
    has the cores that training takes from nbckpt's writers during the persist (0.59 of it on
    ``/dev/shm``, 4 ranks on 2 cores, where the writers at nice 10 yield to 4 ranks' matmuls).
  Beside it, with no target, the same bytes over the time to durable (first start, the copy
  included, to last commit: the job's aggregate write rate of its reports). One way both floors
  still differ from a save: the idle floor's file is removed after each write, so the next write
  may reuse its pages, while on ``/dev/shm`` the saves (and the floor beside training) keep every
  step (tmpfs pages are the data) and write into fresh pages, which in a VM whose host takes free
  guest memory back may cost a host fault each (docs/benchmarks.md; on disk a save drops the step
  before from the page cache once it commits);
- the stall (median over ranks) of nbckpt at its best over DCP at its best's: <= 0.7. Declared
  here, before any run: like against like, both copying behind the loop, so nbckpt's side is
  ``nbckpt-async-overlap`` against ``dcp-async-stager`` (whose stall is its wait for the copy
  before the update). ``nbckpt-async``'s ratio to the same is reported beside it, with no target:
  its stall holds the copy that DCP's async staging does behind the loop;
- the bench's own coordination per step over the baseline's mean step time: <= 0.02. The
  coordination is what the bench's collectives (its barriers and the events' gather, outside the
  lanes' clocks) cost the last rank to arrive at each, plus rank 0's gather; a rank arriving
  early waits for the slowest, which is the job going at its slowest rank, reported beside it as
  the largest turn wait per step, with no target.

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
STRATEGIES = ("nbckpt-async", "nbckpt-async-overlap", "dcp-async-stager")
#: nbckpt at its best against DCP at its best, declared before any run: both copy behind the loop.
BEST = "nbckpt-async-overlap"
TARGETS = {"shm": "/dev/shm", "disk": "data/checkpoints"}
#: The compute modes and the bench's options for each (see the docstring for what each models).
COMPUTE = {"host": [], "idle": ["--idle-compute"]}
#: The floor persist_vs_floor is against in each mode (see the docstring): where the host's
#: cores train, the raw write beside training; where they idle, the raw write between turns.
FLOOR_OF = {"host": "floor beside training", "idle": "idle floor"}
CHECKS = (  # name, what, target (None: reported, no target), at most (True) or at least
    ("persist_vs_floor", "nbckpt-async aggregate persist / {floor}", 0.8, False),
    ("persist_vs_idle_floor", "nbckpt-async aggregate persist / idle floor", None, False),
    ("aggregate_vs_floor", "nbckpt-async aggregate, copy included / {floor}", None, False),
    ("stall_vs_dcp_best", f"{BEST} stall / dcp-async-stager stall", 0.7, True),
    ("default_stall_vs_dcp_best", "nbckpt-async stall / dcp-async-stager stall", None, True),
    ("coordination_vs_step", "bench coordination per step / step time", 0.02, True),
    ("turn_wait_vs_step", "largest turn wait per step / step time", None, True),
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


def run_once(target: str, compute: str, args: argparse.Namespace, scratch: str, label: str) -> dict[str, Any]:
    """One torchrun job of the bench on ``target`` in compute mode ``compute`` (one agent per
    host); its JSON document."""
    out = os.path.join(scratch, f"run-{label}.json")
    directory = tempfile.mkdtemp(prefix="nbckpt-scale-", dir=target)
    bench = [
        *("-m", "nbckpt", "bench", "--dir", directory, "--size-mb", str(args.size_mb)),
        *("--compute-ms", str(args.compute_ms), *COMPUTE[compute]),
        *("--strategies", ",".join(STRATEGIES)),
        *(() if args.every == 0 else ("--steps", str(args.steps), "--every", str(args.every))),
        *("--repeats", "1", "--threads", "1", "--quiet", "--json", out),
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


def ratios(document: dict[str, Any], compute: str) -> dict[str, float]:
    job = document["job"]
    by_name = {row["strategy"]: row for row in job["strategies"]}
    ours, best, dcp = by_name["nbckpt-async"], by_name[BEST], by_name["dcp-async-stager"]
    (baseline,) = [row for row in document["results"] if row["strategy"] == "none"]
    idle_floor = job["floors"]["concurrent_write_gbs"] or float("nan")
    beside = job["floors"].get("beside_training")
    if compute == "host" and beside is None:
        raise SystemExit("host compute without the floor beside training in the bench's JSON")
    beside_gbs = float("nan") if beside is None else beside["write_gbs"] or float("nan")
    floor = beside_gbs if compute == "host" else idle_floor
    step_s = baseline["mean_step_s"]
    turn_wait = max(row["per_step_s"] for row in job["turn_wait"])
    return {
        "aggregate_gbs": ours["aggregate_write_gbs"],
        "persist_gbs": ours["aggregate_persist_gbs"],
        "floor_gbs": floor,
        "idle_floor_gbs": idle_floor,
        "beside_floor_gbs": beside_gbs,
        "stall_s": ours["stall_s"]["median"],
        "best_stall_s": best["stall_s"]["median"],
        "dcp_stall_s": dcp["stall_s"]["median"],
        "coordination_per_step_s": job["coordination"]["per_step_s"],
        "turn_wait_per_step_s": turn_wait,
        "step_s": step_s,
        "aggregate_vs_floor": ours["aggregate_write_gbs"] / floor,
        "persist_vs_floor": ours["aggregate_persist_gbs"] / floor,
        "persist_vs_idle_floor": ours["aggregate_persist_gbs"] / idle_floor,
        "stall_vs_dcp_best": best["stall_s"]["median"] / dcp["stall_s"]["median"],
        "default_stall_vs_dcp_best": ours["stall_s"]["median"] / dcp["stall_s"]["median"],
        "coordination_vs_step": job["coordination"]["per_step_s"] / step_s,
        "turn_wait_vs_step": turn_wait / step_s,
    }


def summarise(rows: list[dict[str, float]]) -> dict[str, Any]:
    """One mode and target's repeats: every figure's interval, every check's."""
    ratio_names = {name for name, _, _, _ in CHECKS}
    figures = {key: interval([row[key] for row in rows]) for key in rows[0] if key not in ratio_names}
    checks = {}
    for name, _, limit, at_most in CHECKS:
        found = ratio_interval([row[name] for row in rows])
        met = (
            None if limit is None else bool(found["median"] <= limit if at_most else found["median"] >= limit)
        )
        checks[name] = {**found, "target": limit, "met": met}
    return {"figures": figures, "checks": checks}


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'mode':<5} {'target':<6} {'check':<62} {'median':>8} {'95 % interval':>20} {'target':>8} met"]
    for mode, by_target in summary.items():
        for target, found in by_target.items():
            for name, what, limit, at_most in CHECKS:
                if name == "persist_vs_idle_floor" and FLOOR_OF[mode] == "idle floor":
                    continue  # the check above is against it already
                row = found["checks"][name]
                bound = "" if limit is None else f"{'<=' if at_most else '>='} {limit:g}"
                span = f"[{row['lo']:.3f}, {row['hi']:.3f}]"
                met = "-" if row["met"] is None else "yes" if row["met"] else "no"
                cells = f"{row['median']:>8.3f} {span:>20} {bound:>8} {met}"
                lines.append(f"{mode:<5} {target:<6} {what.format(floor=FLOOR_OF[mode]):<62} {cells}")
            figures = {key: value["median"] for key, value in found["figures"].items()}
            lines.append(
                f"{'':<12} aggregate {figures['aggregate_gbs']:.3f} GB/s (writes alone "
                f"{figures['persist_gbs']:.3f}), floor beside training "
                f"{figures['beside_floor_gbs']:.3f} GB/s, idle floor {figures['idle_floor_gbs']:.3f} "
                f"GB/s; stall "
                f"{figures['stall_s']:.4f} s, at its best {figures['best_stall_s']:.4f} s, "
                f"DCP-best {figures['dcp_stall_s']:.4f} s; step {figures['step_s']:.4f} s, coordination "
                f"{figures['coordination_per_step_s'] * 1e3:.3f} ms per step, turn wait up to "
                f"{figures['turn_wait_per_step_s'] * 1e3:.3f} ms per step"
            )
    return "\n".join(lines)


def _names(given: str, allowed: dict[str, Any], option: str, parser: argparse.ArgumentParser) -> list[str]:
    names = [name.strip() for name in given.split(",") if name.strip()]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        parser.error(f"{option} {given!r}: choose from {', '.join(allowed)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=RANKS, help="ranks in all, over every host")
    parser.add_argument("--hosts", type=int, default=1, help="torchrun agents as hosts (2x2: --hosts 2)")
    parser.add_argument(
        "--size-mb",
        type=float,
        default=64.0,
        help="state per rank, MiB (every recorded run's; at 256, 4 ranks on /dev/shm fill a 23 GB VM)",
    )
    parser.add_argument("--compute-ms", type=float, default=50.0, help="compute per step")
    parser.add_argument("--compute", default=",".join(COMPUTE), help="modes, from: " + ", ".join(COMPUTE))
    parser.add_argument("--steps", type=int, default=20, help="with --every N")
    parser.add_argument(
        "--every",
        type=int,
        default=0,
        help="steps between saves; 0: the bench's own choice (4x a save's time apart, the largest "
        "any rank measured), so that no save queues behind the write before it",
    )
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
    targets = _names(args.targets, TARGETS, "--targets", parser)
    modes = _names(args.compute, COMPUTE, "--compute", parser)
    os.makedirs(TARGETS["disk"], exist_ok=True)
    pairs = [(mode, target) for mode in modes for target in targets]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        mode: {name: [] for name in targets} for mode in modes
    }
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for mode, name in pairs if repeat % 2 == 0 else pairs[::-1]:  # interleaved, alternating
                print(
                    f"repeat {repeat + 1}/{args.repeats}: {args.ranks} ranks on {args.hosts} host(s), "
                    f"{mode} compute, {name}",
                    file=sys.stderr,
                    flush=True,
                )
                document = run_once(TARGETS[name], mode, args, scratch, f"{mode}-{name}-{repeat}")
                runs[mode][name].append(ratios(document, mode))
    summary = {
        mode: {name: summarise(rows) for name, rows in by_target.items()} for mode, by_target in runs.items()
    }
    print(table(summary))
    if args.note:
        print(f"note: {args.note}")
    declared = f"stall_vs_dcp_best: {BEST} against dcp-async-stager, both copying behind the loop"
    write_json(
        args.json,
        {
            "options": vars(args),
            "checked": declared,
            "runs": runs,
            "summary": summary,
            "note": args.note,
            "machine": machine(),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
