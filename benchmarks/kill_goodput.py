"""Save-schedule benchmark: goodput of a training loop killed at random, at the advised interval and
at intervals 4x shorter and longer, sync and async, beside what the model predicts.

    .venv/bin/python benchmarks/kill_goodput.py --json data/results/kill-goodput-cpu.json
    .venv/bin/python benchmarks/kill_goodput.py --quick     # seconds-scale failures: checks the script

Method. A child process trains (a fixed amount of CPU work per step over a state of ``--size-mb``)
and checkpoints with nbckpt every ``interval`` seconds of training, restoring from its newest
checkpoint at start. The parent kills it with SIGKILL at exponentially distributed times (mean
``--mtbf`` seconds) and restarts it at once, for ``--duration`` seconds per configuration. Goodput
is the training progress at the end (steps held by the newest checkpoint or reached since, as the
child last reported) over what a run without failures or checkpoints makes in the same time
(``--calibrate`` seconds of bare steps). The costs that set the advised interval are measured first,
in a run without kills: the stall and persist time of each save, the restore time and the
restart (process start to the first step). The model's goodput at an interval ``tau`` is
``1 - waste(tau)`` with ``waste = C / tau + (tau / 2 + lag + R) / M``, ``R`` the restore plus the
restart, the engine's :func:`expected_waste`. Configurations are interleaved over ``--repeats``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nbckpt import Checkpointer
from nbckpt.engine._internal import expected_waste
from nbckpt.engine._schedule import Costs, SaveSchedule

sys.path.insert(0, str(Path(__file__).parent))
from _output import finish, parser


def child(args: argparse.Namespace) -> int:
    """The training loop: restore, then steps of fixed work, a save every ``--interval`` seconds
    of training; prints ``restored N`` after the restore and ``step N`` after each step."""
    torch.set_num_threads(1)
    weights = torch.zeros(args.size_mb << 18)  # float32: 4 bytes an element
    state: dict[str, Any] = {"w": weights, "step": 0}
    work = torch.randn(args.work, args.work)
    with Checkpointer(args.directory, mode=args.mode, keep=2) as ckpt:
        step = 0
        if ckpt.steps():
            step = ckpt.restore(state)
        print(f"restored {step}", flush=True)
        last_save = time.monotonic()
        while True:
            work @ work  # the step's work
            step += 1
            weights.add_(1.0)  # every element changes: nothing is saved for free
            state["step"] = step
            print(f"step {step} {time.monotonic():.4f}", flush=True)
            if args.interval > 0 and time.monotonic() - last_save >= args.interval:
                last_save = time.monotonic()
                ckpt.save(state, step)


def _progress(out: str) -> int:
    """The newest step a child reported."""
    words = [line.split() for line in out.splitlines()]
    return max((int(w[1]) for w in words if w[:1] in (["step"], ["restored"])), default=0)


def _command(args: argparse.Namespace, directory: Path, mode: str, interval: float) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        str(directory),
        "--mode",
        mode,
        "--interval",
        str(interval),
        "--size-mb",
        str(args.size_mb),
        "--work",
        str(args.work),
    ]


def _run(
    args: argparse.Namespace, mode: str, interval: float, mtbf: float, seed: int, duration: float
) -> dict[str, Any]:
    """One configuration for ``duration`` seconds, killed at exponential times of mean ``mtbf``
    (0: never): the progress made, and the kills."""
    directory = Path(args.dir) / f"{mode}-{interval:.3g}-{seed}"
    shutil.rmtree(directory, ignore_errors=True)
    rng = random.Random(seed)
    command = _command(args, directory, mode, interval)
    began = time.monotonic()
    deadline = began + duration
    kills, progress = 0, 0
    while (now := time.monotonic()) < deadline:
        life = min(rng.expovariate(1.0 / mtbf) if mtbf > 0 else float("inf"), deadline - now)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            out, _ = proc.communicate(timeout=life)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            out, _ = proc.communicate()
            kills += time.monotonic() < deadline
        progress = max(progress, _progress(out))  # a child killed before its restore reported none
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "mode": mode,
        "interval_s": interval,
        "mtbf_s": mtbf,
        "seed": seed,
        "kills": kills,
        "steps": progress,
        "seconds": time.monotonic() - began,
    }


def _costs(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """Stall and persist per save (saves one after another), and the recovery after a kill: a new
    process's start, imports and restore, up to its first step."""
    directory = Path(args.dir) / f"costs-{mode}"
    shutil.rmtree(directory, ignore_errors=True)
    weights = torch.zeros(args.size_mb << 18)
    with Checkpointer(directory, mode=mode, keep=2) as ckpt:
        for step in range(1, 6):
            weights.add_(1.0)
            state = {"w": weights, "step": step}
            ckpt.save(state, step).wait()
        records = ckpt.records[1:]  # the first pays for allocating the host buffers
    began = time.monotonic()
    proc = subprocess.Popen(
        _command(args, directory, mode, 0.0), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # "restored 5"
    recovery = time.monotonic() - began
    proc.kill()
    proc.communicate()
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "stall_s": statistics.median(r.stall_s for r in records),
        "persist_s": statistics.median(r.persist_s for r in records),
        "recovery_s": recovery,
    }


def _bare_rate(args: argparse.Namespace) -> float:
    """Steps per second of the loop without failures or checkpoints, once started (a run without
    failures pays its start-up once; each restart's is part of the recovery)."""
    directory = Path(args.dir) / "bare"
    shutil.rmtree(directory, ignore_errors=True)
    proc = subprocess.Popen(
        _command(args, directory, "sync", 0.0), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:  # read as the runs read their children (a line a step), until well past its start-up
        out, _ = proc.communicate(timeout=args.calibrate)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    shutil.rmtree(directory, ignore_errors=True)
    stamps = [(int(w[1]), float(w[2])) for w in map(str.split, out.splitlines()) if w[:1] == ["step"]]
    if len(stamps) < 10:
        raise SystemExit(f"the bare loop made {len(stamps)} steps in {args.calibrate:g} s: raise --calibrate")
    (first, began), (last, ended) = stamps[len(stamps) // 10], stamps[-1]  # past the first, slower steps
    return (last - first) / (ended - began)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rate = _bare_rate(args)
    schedule = SaveSchedule(args.mtbf)
    plans: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        costs = _costs(args, mode)
        stall = costs["stall_s"] if mode == "async" else costs["stall_s"] + costs["persist_s"]
        lag = costs["stall_s"] + costs["persist_s"] if mode == "async" else 0.0
        recovery = costs["recovery_s"]
        advised = schedule.interval(Costs(stall_s=stall, drag_s=0.0, persist_s=lag, restore_s=recovery))
        plans[mode] = {
            "costs": costs,
            "cost_s": stall,
            "lag_s": lag,
            "recovery_s": recovery,
            "advised_s": advised.seconds,
            "reason": advised.reason,
        }
        print(f"{mode}: {advised.reason}", flush=True)
    runs = []
    for repeat in range(args.repeats):
        for mode, plan in plans.items():
            for factor in args.factors:
                interval = plan["advised_s"] * factor
                run = _run(args, mode, interval, args.mtbf, 1000 * repeat + int(factor * 8), args.duration)
                run["goodput"] = run["steps"] / (rate * run["seconds"])
                run["predicted"] = 1.0 - expected_waste(
                    interval, plan["cost_s"], args.mtbf, lag_s=plan["lag_s"], restore_s=plan["recovery_s"]
                )
                run["factor"] = factor
                runs.append(run)
                print(
                    f"repeat {repeat + 1} {mode:5s} x{factor:<4g} interval {interval:7.2f} s: "
                    f"{run['kills']:3d} kills, goodput {run['goodput']:.3f} "
                    f"(model {run['predicted']:.3f})",
                    flush=True,
                )
    return {
        "benchmark": "kill_goodput",
        "options": vars(args),
        "bare_steps_per_s": rate,
        "plans": plans,
        "runs": runs,
        "table": _table(runs, args),
    }


def _table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for mode in args.modes:
        for factor in args.factors:
            mine = [r for r in runs if r["mode"] == mode and r["factor"] == factor]
            measured = sum(r["steps"] for r in mine) / sum(r["steps"] / r["goodput"] for r in mine)
            rows.append(
                {
                    "mode": mode,
                    "factor": factor,
                    "interval_s": mine[0]["interval_s"],
                    "kills": sum(r["kills"] for r in mine),
                    "goodput": measured,
                    "predicted": statistics.fmean(r["predicted"] for r in mine),
                }
            )
    print(f"{'mode':6s} {'interval':>9s} {'kills':>6s} {'goodput':>8s} {'model':>7s} {'diff pp':>8s}")
    for row in rows:
        print(
            f"{row['mode']:6s} {row['interval_s']:8.2f}s {row['kills']:6d} {row['goodput']:8.3f} "
            f"{row['predicted']:7.3f} {100 * (row['goodput'] - row['predicted']):+8.1f}"
        )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_args = argparse.ArgumentParser()
        child_args.add_argument("--child", dest="directory")
        child_args.add_argument("--mode", default="async")
        child_args.add_argument("--interval", type=float, default=0.0)
        child_args.add_argument("--size-mb", type=int, default=64)
        child_args.add_argument("--work", type=int, default=1024)
        sys.exit(child(child_args.parse_args()))
    options = parser(
        __doc__,
        repeats=1,
        directory="data/checkpoints/kill-goodput",
        quick="failures every few seconds, 20 s per configuration",
    )
    options.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between kills")
    options.add_argument("--duration", type=float, default=900.0, help="seconds per configuration")
    options.add_argument(
        "--calibrate", type=float, default=60.0, help="seconds the bare loop runs, its start-up included"
    )
    options.add_argument("--size-mb", type=int, default=64)
    options.add_argument("--work", type=int, default=1024, help="the step's matrix size")
    options.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    options.add_argument(
        "--factors",
        nargs="+",
        type=float,
        default=[0.25, 1.0, 4.0],
        help="intervals tried, as multiples of the advised one",
    )
    args = options.parse_args()
    if args.quick:  # seconds-scale failures: checks the script, measures nothing worth keeping
        args.mtbf, args.duration, args.calibrate, args.size_mb, args.work = 6.0, 15.0, 12.0, 8, 512
    os.makedirs(args.dir, exist_ok=True)
    finish(measure, args)


if __name__ == "__main__":
    main()
