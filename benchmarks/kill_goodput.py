"""Save-schedule benchmark: goodput of a training loop killed at random, at the advised interval and
at intervals 4x shorter and longer, sync and async, beside what the model predicts.

    .venv/bin/python benchmarks/kill_goodput.py --json data/results/kill-goodput-cpu.json
    .venv/bin/python benchmarks/kill_goodput.py --quick     # seconds-scale failures: checks the script

Method. A child process trains (a fixed amount of CPU work per step over a state of ``--size-mb``)
and starts an nbckpt save every ``interval`` seconds (from one save's start to the next's),
restoring from its newest checkpoint at start. The parent kills it with SIGKILL at exponentially
distributed times (mean ``--mtbf`` seconds) and restarts it at once. Every configuration sees the
same sequence of lifetimes (common random numbers), in ``--rounds`` chunks of about ``--chunk``
seconds, the configurations taking turns; a chunk ends at a kill, so the chunks of one
configuration make one run. Between the chunks a process without failures or saves (stopped in
between) trains for ``--window`` seconds: the no-failure baseline, measured under the same load as
the chunks beside it. Goodput is the durable progress (the newest committed step) over what the
baseline would have made in the same time (``goodput``), and over what the chunk's own steps
without a save in flight make in that time (``goodput_own_speed``, the targets' figure): on a
machine shared with CPU-bound work, a loop that waits on fsync gets the CPU back faster when it
computes (the scheduler credits its sleep), so the windows' CPU-bound baseline undercounts what
its steps did and the stall looks cheaper than it was (data/results/kill-goodput-cpu.json: at
a quarter of the advised interval, 0.60 of the windows' baseline while the saves stalled 66 % of
the time).

The costs that set the advised interval are measured first, in a run without kills: the stall and
the time to durable of each save, the drag (steps beside a background write against steps
without) and the recovery (process start, imports and restore). Each configuration's prediction
uses the costs measured in its own run and its own failure rate (kills over time): the engine's
:func:`expected_waste` at the measured period between saves (first order), and the same model
exact for exponential failures (:func:`exponential_goodput`), which differ where the cost is not
small against the period or the period against the MTBF.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from nbckpt import Checkpointer, SaveSchedule
from nbckpt.engine._internal import Costs, expected_waste

sys.path.insert(0, str(Path(__file__).parent))
from _output import finish, parser

#: Each life a new process, forked from one that has imported torch and nbckpt: a restart costs
#: the fork and the restore, as on a node whose software is loaded (a Python start and the
#: imports take 3 to 10 s on this shared machine, and would swamp everything else measured).
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["torch", "nbckpt", "nbckpt.bench"])  # what this file imports


@dataclass(frozen=True)
class Spec:
    """What one child trains and how it saves."""

    directory: str
    mode: str
    interval: float
    size_mb: int
    work: int


def child(spec: Spec, log: str) -> None:
    """The training loop: restore, then steps of fixed work, a save every ``spec.interval`` seconds.
    Writes to ``log`` ``restored N T`` after the restore, ``step N T SECONDS BUSY`` after each
    step (its compute time; BUSY: a save was persisting), ``save T STALL`` after starting a save,
    and ``durable SECONDS`` when one has committed (from its start); T on the monotonic clock."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "nbckpt: cleaned up")  # what a kill left: every restart says so
    weights = torch.zeros(spec.size_mb << 18)  # float32: 4 bytes an element
    state: dict[str, Any] = {"w": weights, "step": 0}
    work = torch.randn(spec.work, spec.work)
    durable: list[float] = []  # appended on nbckpt's committing thread
    with open(log, "w", buffering=1) as out, Checkpointer(spec.directory, mode=spec.mode, keep=2) as ckpt:
        step = ckpt.restore(state) if ckpt.steps() else 0
        out.write(f"restored {step} {time.monotonic():.4f}\n")
        last_save, handle = time.monotonic(), None
        while True:
            began = time.monotonic()
            work @ work  # the step's work
            step += 1
            weights.add_(1.0)  # every element changes: nothing is saved for free
            state["step"] = step
            now = time.monotonic()
            busy = handle is not None and not handle.done()
            out.write(f"step {step} {now:.4f} {now - began:.5f} {int(busy)}\n")
            if spec.interval > 0 and now - last_save >= spec.interval:
                last_save = now
                handle = ckpt.save(state, step)
                out.write(f"save {now:.4f} {time.monotonic() - now:.5f}\n")
                handle.committed.add_done_callback(partial(_durable, durable, now))
            while durable:
                out.write(f"durable {durable.pop(0):.5f}\n")


def _durable(out: list[float], began: float, _: object) -> None:
    out.append(time.monotonic() - began)


@dataclass
class Life:
    """One child process from its start to its kill, as its output tells it."""

    seconds: float
    recovery_s: float | None = None  # start to restored (None: killed before)
    restored: int | None = None  # the step restored
    steps: list[tuple[float, int]] = field(default_factory=list)  # (compute seconds, busy)
    saves: list[tuple[float, float]] = field(default_factory=list)  # (start, stall)
    durable_s: list[float] = field(default_factory=list)


def _parse(out: str, began: float, seconds: float) -> Life:
    life = Life(seconds)
    for words in map(str.split, out.splitlines()):
        kind = words[:1]
        if kind == ["restored"]:
            life.recovery_s, life.restored = float(words[2]) - began, int(words[1])
        elif kind == ["step"] and len(words) == 5:  # a line cut by the kill is left out
            life.steps.append((float(words[3]), int(words[4])))
        elif kind == ["save"] and len(words) == 3:
            life.saves.append((float(words[1]), float(words[2])))
        elif kind == ["durable"] and len(words) == 2:
            life.durable_s.append(float(words[1]))
    return life


def _live(spec: Spec, seconds: float, log: Path) -> Life:
    """Run ``spec`` in a new process for ``seconds``, then SIGKILL it."""
    began = time.monotonic()
    proc = _FORKS.Process(target=child, args=(spec, str(log)))
    proc.start()
    proc.join(timeout=seconds)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return _parse(log.read_text() if log.exists() else "", began, time.monotonic() - began)


def _durable_step(directory: Path) -> int:
    if not directory.exists():
        return 0
    with Checkpointer(directory, read_only=True, ranks="local") as reader:
        return reader.latest_step() or 0


def _spec(args: argparse.Namespace, directory: Path, mode: str, interval: float) -> Spec:
    return Spec(str(directory), mode, interval, args.size_mb, args.work)


class Baseline:
    """The loop without failures or saves, in one process stopped between its windows."""

    def __init__(self, args: argparse.Namespace) -> None:
        directory = Path(args.dir) / "baseline"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self._log = directory / "log"
        self._proc = _FORKS.Process(target=child, args=(_spec(args, directory, "sync", 0.0), str(self._log)))
        self._proc.start()
        self.rates: list[float] = []
        self.loop_shares: list[float] = []
        """Of each window: the share of the loop's time its steps' compute takes (the rest: the
        loop's own work, writing its line)."""

    def _stamps(self) -> list[tuple[float, float]]:
        text = self._log.read_text() if self._log.exists() else ""
        lines = map(str.split, text.splitlines())
        return [(float(w[2]), float(w[3])) for w in lines if w[:1] == ["step"] and len(w) == 5]

    def window(self, seconds: float) -> float:
        """Let it train for ``seconds`` (after its start-up, the first time): its steps per second."""
        while len(self._stamps()) < 5 and self._proc.is_alive():
            time.sleep(0.1)  # its start-up, once: a file polled, nothing else waits on it
        assert self._proc.pid is not None
        os.kill(self._proc.pid, signal.SIGCONT)
        began = time.monotonic()
        time.sleep(seconds)  # the window itself: the time it trains
        os.kill(self._proc.pid, signal.SIGSTOP)
        inside = [(t, d) for t, d in self._stamps() if t > began]
        if len(inside) < 3:
            raise SystemExit(f"the baseline made {len(inside)} steps in {seconds:g} s: raise --window")
        self.rates.append((len(inside) - 1) / (inside[-1][0] - inside[0][0]))
        # the first step's may hold the time it was stopped
        self.loop_shares.append(self.rates[-1] * statistics.fmean(d for _, d in inside[1:]))
        return self.rates[-1]

    def close(self) -> None:
        self._proc.kill()
        self._proc.join()


@dataclass
class Run:
    """One configuration's chunks, lives and progress."""

    mode: str
    factor: float
    interval_s: float
    directory: Path
    lifetimes: random.Random
    lives: list[Life] = field(default_factory=list)
    chunks: list[dict[str, float]] = field(default_factory=list)

    def chunk(self, args: argparse.Namespace, budget: float, rate: float) -> None:
        """Lives until ``budget`` seconds have passed, the last ending at its kill."""
        spec = _spec(args, self.directory, self.mode, self.interval_s)
        log = Path(args.dir) / f"{self.directory.name}.log"
        before, seconds, kills = _durable_step(self.directory), 0.0, 0
        while seconds < budget:
            life = _live(spec, self.lifetimes.expovariate(1.0 / args.mtbf), log)
            self.lives.append(life)
            seconds, kills = seconds + life.seconds, kills + 1
        steps = _durable_step(self.directory) - before
        idle = [s for life in self.lives[-kills:] for s, busy in life.steps if not busy]
        self.chunks.append(
            {
                "seconds": seconds,
                "kills": kills,
                "steps": steps,
                "rate_before": rate,
                "idle_step_s": statistics.fmean(idle) if idle else math.nan,
            }
        )

    def summary(self, rates_after: list[float], mtbf: float, loop_share: float) -> dict[str, Any]:
        """Measured goodput (and its spread over the chunks) beside the model's, from this run's
        costs. Two baselines: the windows on each side of a chunk (``goodput``), and the speed of
        the chunk's own steps without a save in flight, as a share ``loop_share`` of the loop
        (``goodput_own_speed``: the load the chunk met, even where it changed within it)."""
        for chunk, after in zip(self.chunks, rates_after, strict=True):
            chunk["bare_steps"] = chunk["seconds"] * (chunk["rate_before"] + after) / 2
            chunk["bare_steps_own_speed"] = chunk["seconds"] * loop_share / chunk["idle_step_s"]
        seconds = sum(c["seconds"] for c in self.chunks)
        kills = sum(c["kills"] for c in self.chunks)
        steps = sum(c["steps"] for c in self.chunks)
        goodput = steps / sum(c["bare_steps"] for c in self.chunks)
        own = steps / sum(c["bare_steps_own_speed"] for c in self.chunks)
        per_chunk = [c["steps"] / c["bare_steps_own_speed"] for c in self.chunks]
        costs = measured_costs(self.lives)
        period = costs["period_s"] or self.interval_s
        rate_mtbf = seconds / kills
        model = (period, costs["cost_s"])
        extra = {"lag_s": costs["lag_s"], "restore_s": costs["recovery_s"]}
        predicted = {
            "predicted": 1.0 - expected_waste(*model, rate_mtbf, **extra),
            "predicted_nominal_mtbf": 1.0 - expected_waste(*model, mtbf, **extra),
            "predicted_exponential": exponential_goodput(*model, rate_mtbf, **extra),
        }
        return {
            "mode": self.mode,
            "factor": self.factor,
            "interval_s": self.interval_s,
            "seconds": seconds,
            "kills": kills,
            "measured_mtbf_s": rate_mtbf,
            "goodput": goodput,
            "goodput_own_speed": own,
            "goodput_se": statistics.stdev(per_chunk) / math.sqrt(len(per_chunk))
            if len(per_chunk) > 1
            else None,
            **predicted,
            "costs": costs,
            "chunks": self.chunks,
            "lives": [(life.seconds, life.recovery_s, life.restored) for life in self.lives],
        }


def exponential_goodput(period: float, cost: float, mtbf: float, *, lag_s: float, restore_s: float) -> float:
    """The goodput with failures exactly exponential: a life ``X`` keeps ``period * floor((X - R -
    lag) / period)`` of its time (none if shorter than ``R + lag``), of which ``1 - cost / period``
    was training: ``(1 - C/P) (P/M) e^(-(R + lag)/M) / (e^(P/M) - 1)``; to first order in ``P/M``
    and ``(R + lag)/M``, the engine's ``1 - expected_waste``."""
    ratio = period / mtbf
    return (1 - cost / period) * ratio * math.exp(-(restore_s + lag_s) / mtbf) / math.expm1(ratio)


def measured_costs(lives: list[Life]) -> dict[str, float]:
    """What the saves of ``lives`` cost, as the model takes them: the stall, the drag (the compute
    time that steps beside a background write took beyond those without, per save), the lag from
    the stall's end to durable, the recovery, and the mean period between two saves' starts."""
    saves = [s for life in lives for s in life.saves]
    stall = statistics.fmean(s[1] for s in saves) if saves else 0.0
    lag = [d for life in lives for d in life.durable_s]
    idle = [s for life in lives for s, busy in life.steps if not busy]
    busy = [s for life in lives for s, b in life.steps if b]
    drag = (
        (statistics.fmean(busy) - statistics.fmean(idle)) * len(busy) / len(saves) if busy and idle else 0.0
    )
    gaps = [b[0] - a[0] for life in lives for a, b in zip(life.saves, life.saves[1:], strict=False)]
    recovery = [life.recovery_s for life in lives if life.recovery_s is not None]
    return {
        "saves": len(saves),
        "stall_s": stall,
        "drag_s": max(drag, 0.0),
        "cost_s": stall + max(drag, 0.0),
        "lag_s": max(statistics.fmean(lag) - stall, 0.0) if lag else 0.0,
        "recovery_s": statistics.fmean(recovery) if recovery else 0.0,
        "period_s": statistics.fmean(gaps) if gaps else 0.0,
        "step_s": statistics.fmean(idle) if idle else 0.0,
    }


def _plan(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The advised interval for ``mode``, from costs measured without kills: saves every second
    for ``--calibrate`` seconds, then two restarts."""
    directory = Path(args.dir) / f"costs-{mode}"
    shutil.rmtree(directory, ignore_errors=True)
    spec, log = _spec(args, directory, mode, 1.0), Path(args.dir) / f"costs-{mode}.log"
    lives = [_live(spec, args.calibrate, log)]
    lives += [_live(spec, (lives[0].recovery_s or 5.0) + 1.0, log) for _ in range(3)]
    shutil.rmtree(directory, ignore_errors=True)
    costs = measured_costs(lives)
    restarts = [life.recovery_s for life in lives[1:] if life.recovery_s is not None]
    costs["recovery_s"] = statistics.fmean(restarts) if restarts else costs["recovery_s"]
    advised = SaveSchedule(args.mtbf).interval(
        Costs(
            stall_s=costs["stall_s"],
            drag_s=costs["drag_s"],
            persist_s=costs["stall_s"] + costs["lag_s"],
            restore_s=costs["recovery_s"],
        )
    )
    print(f"{mode}: {advised.reason}", flush=True)
    return {"costs": costs, "advised_s": advised.seconds, "reason": advised.reason}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    plans = {mode: _plan(args, mode) for mode in args.modes}
    runs = [
        Run(
            mode,
            factor,
            plan["advised_s"] * factor,
            Path(args.dir) / f"{mode}-x{factor:g}",
            random.Random(args.seed),
        )
        for mode, plan in plans.items()
        for factor in args.factors
    ]
    for run in runs:
        shutil.rmtree(run.directory, ignore_errors=True)
    baseline = Baseline(args)
    try:
        rate = baseline.window(args.window)
        after: dict[int, list[float]] = {id(run): [] for run in runs}
        for round_ in range(args.rounds):
            for run in runs:  # the window after a chunk is the one before the next
                run.chunk(args, args.chunk, rate)
                rate = baseline.window(args.window)
                after[id(run)].append(rate)
                last = run.chunks[-1]
                print(
                    f"round {round_ + 1} {run.mode:5s} x{run.factor:<4g}: {last['kills']:3.0f} kills, "
                    f"{last['steps']:6.0f} steps in {last['seconds']:5.1f} s; baseline {rate:.1f} steps/s",
                    flush=True,
                )
    finally:
        baseline.close()
    share = statistics.median(baseline.loop_shares)
    rows = [run.summary(after[id(run)], args.mtbf, share) for run in runs]
    for run in runs:
        shutil.rmtree(run.directory, ignore_errors=True)
    return {
        "benchmark": "kill_goodput",
        "options": vars(args),
        "plans": plans,
        "baseline_steps_per_s": baseline.rates,
        "baseline_loop_shares": baseline.loop_shares,
        "runs": rows,
        "targets": _targets(rows, args),
    }


def _targets(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; whether the issue's three targets hold, on the goodput against the chunks'
    own speed (the windows' baseline beside it)."""
    head = ("mode", "interval", "kills", "windows", "goodput", "+-se", "model", "diff pp", "exp.model")
    widths = (6, 9, 6, 8, 8, 6, 7, 8, 9)
    print(" ".join(f"{h:>{w}s}" for h, w in zip(head, widths, strict=True)))
    for row in rows:
        se = "" if row["goodput_se"] is None else f"{row['goodput_se']:.3f}"
        print(
            f"{row['mode']:>6s} {row['interval_s']:8.2f}s {row['kills']:6d} {row['goodput']:8.3f} "
            f"{row['goodput_own_speed']:8.3f} {se:>6s} {row['predicted']:7.3f} "
            f"{100 * (row['goodput_own_speed'] - row['predicted']):+8.1f} {row['predicted_exponential']:9.3f}"
        )
    measured = "goodput_own_speed"
    best = {m: max((r for r in rows if r["mode"] == m), key=lambda r: r[measured]) for m in args.modes}
    advised = {m: next((r for r in rows if r["mode"] == m and r["factor"] == 1.0), None) for m in args.modes}
    targets: dict[str, Any] = {
        "worst_model_error_pp": max(100 * abs(r[measured] - r["predicted"]) for r in rows),
        "worst_exponential_model_error_pp": max(
            100 * abs(r[measured] - r["predicted_exponential"]) for r in rows
        ),
        "advised_is_best": {m: advised[m] is best[m] for m in args.modes},
    }
    sync, async_ = advised.get("sync"), advised.get("async")
    if sync is not None and async_ is not None:
        targets["async_ahead_of_sync"] = async_[measured] > sync[measured]
    print(targets, flush=True)
    return targets


def main() -> None:
    options = parser(
        __doc__,
        repeats=1,
        directory="data/checkpoints/kill-goodput",
        quick="failures every few seconds, one short chunk per configuration",
    )
    options.add_argument("--mtbf", type=float, default=60.0, help="mean seconds between kills")
    options.add_argument("--rounds", type=int, default=6, help="chunks per configuration")
    options.add_argument("--chunk", type=float, default=240.0, help="seconds of a chunk (it ends at a kill)")
    options.add_argument("--window", type=float, default=8.0, help="seconds of a baseline window")
    options.add_argument("--calibrate", type=float, default=20.0, help="seconds of the run measuring costs")
    options.add_argument("--seed", type=int, default=3301, help="of the lifetimes")
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
        args.mtbf, args.rounds, args.chunk, args.window, args.calibrate = 5.0, 1, 10.0, 2.0, 6.0
        args.size_mb, args.work = 8, 512
    os.makedirs(args.dir, exist_ok=True)
    finish(measure, args)


if __name__ == "__main__":
    main()
