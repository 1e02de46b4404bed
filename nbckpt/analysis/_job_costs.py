"""What a checkpoint costs the whole job, as the interval advisor counts it, from a bench run on
many ranks: :func:`job_costs`, and :func:`costs_for` that picks, of the runs given, the one of
the job's size and says which it took.

On many ranks the job steps at its slowest rank's pace, so a checkpoint stalls it for the
longest stall of any rank (the ``job``'s stall max over ranks), and a save is durable when the
last rank's write is (the job's time to durable, first stage to last commit). The drag is rank
0's (the one rank whose steps beside a background write the JSON keeps), counted as the advisor
counts it (:func:`~._costs.measured_drag`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from .._errors import ConfigError
from ..bench import Comparison
from ..bench._internal import STRATEGIES
from ._costs import measurements
from ._job_report import _number

__all__ = ["costs_for", "describe_run", "job_costs", "world_size"]


def world_size(comparison: Comparison) -> int:
    """The ranks a comparison was measured on: 1 for a one-process bench."""
    return int(comparison.job.get("world_size") or 1) if comparison.job else 1


def describe_run(comparison: Comparison) -> str:
    """Where the run was measured, in words: on its ranks and hosts (or in one process), and its
    workload."""
    if comparison.job:
        ranks, hosts = world_size(comparison), len(comparison.job.get("hosts", {}))
        where = f"on {ranks} rank{'s' if ranks > 1 else ''} on {hosts} host{'s' if hosts > 1 else ''}"
    else:
        where = "in one process"
    return f"{where} ({comparison.workload.split(';')[0]})"


def job_costs(comparison: Comparison) -> pd.DataFrame:
    """Per strategy that wrote, what a checkpoint costs the job (columns of
    :func:`~._costs.measurements`, a built-in strategy's mode its own): on many ranks the stall
    of the slowest rank and the job's time to durable; in one process the comparison's own."""
    results = comparison.results
    # A built-in strategy's mode is known; inferring it (persist longer than stall) fails on a
    # state so small that an async write ends within its own stall.
    known = {name: cls.mode for name, cls in STRATEGIES.items()}
    results = results.assign(
        mode=[
            known.get(name, "async" if persist > stall else "sync")
            for name, persist, stall in zip(
                results["strategy"], results["persist_s"].fillna(0.0), results["stall_mean_s"], strict=True
            )
        ]
    )
    costs = measurements(results)
    if not comparison.job:
        return costs
    job = {row["strategy"]: row for row in comparison.job.get("strategies", []) if row.get("checkpoints")}
    costs = costs[costs["strategy"].isin(list(job))].copy()
    if costs.empty:
        raise ConfigError(f"the run on {describe_run(comparison)} has no strategy that wrote a checkpoint")
    # The job waits for its slowest rank, and a save is durable when the last rank's write is.
    stalls = [_number((job[name].get("stall_s") or {}).get("max")) for name in costs["strategy"]]
    durable = [_number(job[name].get("time_to_durable_s")) for name in costs["strategy"]]
    for column, found in (("stall_s", stalls), ("persist_s", durable)):  # else rank 0's own
        costs[column] = [
            new if math.isfinite(new) else old for new, old in zip(found, costs[column], strict=True)
        ]
    costs["lag_s"] = costs["persist_s"].where(costs["mode"] == "async", 0.0)
    return costs.reset_index(drop=True)


def costs_for(runs: Comparison | Sequence[Comparison], gpus: int) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The costs of the run of ``gpus`` ranks among ``runs`` (else of the largest run measured),
    and what the advisor says of where they came from: ``costs_from`` (a sentence),
    ``measured_ranks`` and ``job_size_measured``."""
    given = [runs] if isinstance(runs, Comparison) else list(runs)
    if not given or not all(isinstance(run, Comparison) for run in given):
        raise ConfigError("give advise() a Comparison, a list of them, or a table of results")
    sizes = [world_size(run) for run in given]
    chosen = given[sizes.index(gpus)] if gpus in sizes else given[sizes.index(max(sizes))]
    ranks = world_size(chosen)
    text = f"costs measured {describe_run(chosen)}"
    if ranks == gpus:
        text += ", the job's size"
    else:
        measured = ", ".join(map(str, sorted(set(sizes))))
        text += (
            f"; the job's {gpus:,} GPUs were not measured (runs of {measured} ranks given), so "
            "these are the largest run's: contention beyond it is not in them"
        )
    return job_costs(chosen), {
        "costs_from": text,
        "measured_ranks": ranks,
        "job_size_measured": ranks == gpus,
    }
