"""The numbers behind the report of a bench on many ranks (``nbckpt report --from``): pure.

Each function reads what ``nbckpt bench`` wrote under torchrun (a :class:`~nbckpt.bench.Comparison`
with ``ranks``, ``job`` and, when rank 0 gathered them, every rank's events in
``rank_timeline``) and returns a table; :func:`job_conclusions` and :func:`scaling_conclusions`
say in sentences what those tables show, and nothing else. :func:`read_jobs` reads the files
and refuses, in one line, what is not a bench on many ranks. No processes, no clocks.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from .._errors import ConfigError
from .._util import GB, is_url
from ..bench import Comparison
from ..bench._internal import SCALING_SCHEMA

__all__ = [
    "JOB_COLUMNS",
    "SCALING_COLUMNS",
    "checkpoint_rates",
    "host_loads",
    "job_conclusions",
    "job_table",
    "rank_floors",
    "rank_rows",
    "rate_over_time",
    "read_jobs",
    "read_runs",
    "scaling_conclusions",
    "scaling_table",
    "swimlanes",
]

#: Columns of :func:`job_table`: one row per strategy that wrote checkpoints.
JOB_COLUMNS = [
    "strategy",
    "checkpoints",
    "time_to_durable_s",
    "time_to_durable_lo_s",
    "time_to_durable_hi_s",
    "aggregate_write_gbs",
    "aggregate_write_lo_gbs",
    "aggregate_write_hi_gbs",
    "concurrent_floor_gbs",
    "vs_floor",
    "floor_beside_training_gbs",
    "vs_floor_beside_training",
    "stall_median_s",
    "stall_p99_s",
    "stall_max_s",
    "overhead_pct",
    "slowest_rank",
    "straggler_rank",
    "straggler_host",
    "straggler_over_median_s",
]
#: Columns of :func:`scaling_table`: one row per run (world size) and strategy.
SCALING_COLUMNS = [
    "ranks",
    "hosts",
    "strategy",
    "aggregate_write_gbs",
    "concurrent_floor_gbs",
    "floor_beside_training_gbs",
    "stall_median_s",
    "stall_max_s",
    "overhead_pct",
    "time_to_durable_s",
    "source",
]
#: The scaling columns each run's :func:`job_table` gives as they are (the rest: the run's size,
#: the strategy and where it came from).
_FROM_JOB_TABLE = [key for key in SCALING_COLUMNS if key not in ("ranks", "hosts", "strategy", "source")]


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _comparisons(name: str) -> list[tuple[str, Comparison]]:
    """The comparisons in one file: a bench result, or every size of a ``--ranks`` sweep."""
    try:
        with open(name, encoding="utf-8") as stream:
            document = json.load(stream)
    except (OSError, ValueError):
        document = None
    if not isinstance(document, dict):
        return [(name, Comparison.from_json(name))]  # what is wrong with it, in its one line
    if document.get("schema") != SCALING_SCHEMA:
        return [(name, Comparison.from_dict(document, source=f"--from {name}"))]
    sizes = [
        (f"{name} ({run.get('ranks')} ranks)", run.get("document") or {})
        for run in document.get("runs") or []
    ]
    return [(source, Comparison.from_dict(size, source=f"--from {source}")) for source, size in sizes]


def read_runs(paths: Sequence[str | os.PathLike[str]]) -> list[tuple[str, Comparison]]:
    """``(source, comparison)`` of every bench on many ranks in the files given, in order: a file
    ``nbckpt bench`` wrote under torchrun, or a ``nbckpt bench --ranks`` sweep (each of its sizes,
    the source naming the size). The first file that is missing, not a bench result, or a
    one-process bench raises :class:`ConfigError` naming it (before anything is drawn or written)."""
    if not paths:
        raise ConfigError("--from names no bench result")
    runs = []
    for path in paths:
        name = os.fspath(path)
        if not os.path.isfile(name):
            raise ConfigError(f"--from {name}: no such file")
        found = _comparisons(name)
        if not found:
            raise ConfigError(f"--from {name}: a sweep with no runs")
        for source, comparison in found:
            if not comparison.job or not comparison.ranks:
                raise ConfigError(
                    f"--from {source}: a one-process bench result (no 'job'); measure under "
                    "torchrun (torchrun --nproc-per-node N -m nbckpt bench ... --json OUT)"
                )
            runs.append((source, comparison))
    return runs


def read_jobs(paths: Sequence[str | os.PathLike[str]]) -> list[Comparison]:
    """The comparisons of :func:`read_runs`, without their sources."""
    return [comparison for _, comparison in read_runs(paths)]


def rank_rows(comparison: Comparison) -> pd.DataFrame:
    """Every rank's figures (the JSON's ``ranks``), strategies that wrote checkpoints only, in
    host then rank order."""
    rows = pd.DataFrame(comparison.ranks)
    rows = rows[pd.to_numeric(rows["checkpoints"], errors="coerce").fillna(0) > 0]
    for column in ("stall_s", "persist_s", "write_gbs", "mean_step_s", "overhead_pct"):
        rows[column] = pd.to_numeric(rows[column], errors="coerce")
    return rows.sort_values(["host", "rank"], kind="stable").reset_index(drop=True)


def _floor(comparison: Comparison) -> float:
    return _number(comparison.job.get("floors", {}).get("concurrent_write_gbs"))


def _floor_beside(comparison: Comparison) -> float:
    """The raw write beside training (host compute only; NaN where it was not measured)."""
    return _number((comparison.job.get("floors", {}).get("beside_training") or {}).get("write_gbs"))


def rank_floors(comparison: Comparison) -> pd.DataFrame:
    """Every rank's floors, all ranks measuring at once in the same run (``job.floors.by_rank``):
    its raw write of its share while every rank wrote, and its copy floor; in host then rank
    order, empty for a file that has none."""
    columns = ["rank", "host", "concurrent_write_gbs", "copy_gbs"]
    frame = pd.DataFrame(comparison.job.get("floors", {}).get("by_rank", []), columns=columns)
    for column in ("concurrent_write_gbs", "copy_gbs"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame.sort_values(["host", "rank"], kind="stable").reset_index(drop=True)


def host_loads(comparison: Comparison) -> pd.DataFrame:
    """Every host's load over the run, from its ranks' (``job.load_by_host``): its cores, the
    1-minute load average, the cores other processes than the job's ranks kept busy, and
    whether that was enough to widen the intervals; empty for a file that has none."""
    rows = [
        {**load, "host": host, "ranks": ", ".join(map(str, load.get("ranks", [])))}
        for host, load in comparison.job.get("load_by_host", {}).items()
    ]
    return pd.DataFrame(rows, columns=["host", "ranks", "cpus", "loadavg_1m", "other_cpu_cores", "high"])


def _interval(value: Any) -> tuple[float, float]:
    """``(lo, hi)`` of a ``[lo, hi]`` in the JSON; NaNs where there is none (one repeat, or a
    file from before nbckpt recorded it)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return math.nan, math.nan
    lo, hi = _number(value[0]), _number(value[1])
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else (math.nan, math.nan)


def job_table(comparison: Comparison) -> pd.DataFrame:
    """The job's figures per strategy that wrote checkpoints: median time to durable and
    aggregate write rate over checkpoints with their 95 % intervals over repeats (``_lo``/``_hi``,
    NaN with one repeat), that rate over each concurrent raw-write floor of the
    same run (``vs_floor``: between turns, no rank training; ``vs_floor_beside_training``: written
    by nbckpt's writer threads while every rank trained, host compute only, else NaN), the stall
    over ranks, the overhead at the slowest rank and the straggler."""
    floor, beside = _floor(comparison), _floor_beside(comparison)
    rows = []
    for row in comparison.job.get("strategies", []):
        if not row.get("checkpoints"):
            continue
        stall, late = row.get("stall_s") or {}, row.get("straggler") or {}
        rate = _number(row.get("aggregate_write_gbs"))
        durable_lo, durable_hi = _interval(row.get("time_to_durable_ci_s"))
        rate_lo, rate_hi = _interval(row.get("aggregate_write_ci_gbs"))
        rows.append(
            {
                "strategy": row["strategy"],
                "checkpoints": len(row["checkpoints"]),
                "time_to_durable_s": _number(row.get("time_to_durable_s")),
                "time_to_durable_lo_s": durable_lo,
                "time_to_durable_hi_s": durable_hi,
                "aggregate_write_gbs": rate,
                "aggregate_write_lo_gbs": rate_lo,
                "aggregate_write_hi_gbs": rate_hi,
                "concurrent_floor_gbs": floor,
                "vs_floor": rate / floor if floor > 0 else math.nan,
                "floor_beside_training_gbs": beside,
                "vs_floor_beside_training": rate / beside if beside > 0 else math.nan,
                "stall_median_s": _number(stall.get("median")),
                "stall_p99_s": _number(stall.get("p99")),
                "stall_max_s": _number(stall.get("max")),
                "overhead_pct": _number(row.get("overhead_pct")),
                "slowest_rank": row.get("slowest_rank"),
                "straggler_rank": late.get("rank"),
                "straggler_host": late.get("host"),
                "straggler_over_median_s": _number(late.get("over_median_s")),
            }
        )
    return pd.DataFrame(rows, columns=JOB_COLUMNS)


#: The medians :func:`job_table` gives a 95 % interval over repeats, with their digits shown.
_WITH_INTERVAL = {"time_to_durable": ("s", 3), "aggregate_write": ("gbs", 2)}


def job_table_shown(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`job_table` to show: each median with an interval over repeats as text beside it
    (``0.012 [0.010, 0.015]``; the median alone with one repeat), the ``_lo``/``_hi`` columns
    folded in."""
    shown = table.copy()
    for name, (unit, digits) in _WITH_INTERVAL.items():
        median, lo, hi = (shown[f"{name}{part}_{unit}"] for part in ("", "_lo", "_hi"))
        shown[f"{name}_{unit}"] = [
            f"{m:.{digits}f}"
            + (f" [{a:.{digits}f}, {b:.{digits}f}]" if math.isfinite(a) and math.isfinite(b) else "")
            for m, a, b in zip(median.astype(float), lo.astype(float), hi.astype(float), strict=True)
        ]
        shown = shown.drop(columns=[f"{name}_lo_{unit}", f"{name}_hi_{unit}"])
    return shown


def checkpoint_rates(comparison: Comparison) -> pd.DataFrame:
    """Every checkpoint of every strategy: its time to durable, its aggregate write rate (all
    ranks' bytes over that time) and the ranks that started first and ended last."""
    rows = [
        {"strategy": row["strategy"], **checkpoint}
        for row in comparison.job.get("strategies", [])
        for checkpoint in row.get("checkpoints", [])
    ]
    columns = [
        "strategy",
        "repeat",
        "step",
        "ranks_writing",
        "bytes",
        "time_to_durable_s",
        "aggregate_write_gbs",
        "first_rank",
        "last_rank",
    ]
    frame = pd.DataFrame(rows, columns=columns)
    for column in ("time_to_durable_s", "aggregate_write_gbs"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    return frame


def swimlanes(comparison: Comparison, strategy: str, repeat: int | None = None) -> pd.DataFrame:
    """``strategy``'s events on every rank in one repeat (default: its last), for a swimlane per
    rank: ``lane`` (``host · rank r``, grouped by host), ``start_s``/``end_s`` from the first
    event of that repeat on any rank. Empty when the JSON carries no ``rank_timeline``."""
    columns = ["lane", "host", "rank", "kind", "step", "start_s", "end_s", "bytes"]
    events = pd.DataFrame(comparison.rank_timeline)
    if events.empty:
        return pd.DataFrame(columns=columns)
    events = events[events["strategy"] == strategy]
    if events.empty:
        return pd.DataFrame(columns=columns)
    chosen = int(events["repeat"].max()) if repeat is None else repeat
    events = events[events["repeat"] == chosen]
    hosts = {int(row["rank"]): str(row["host"]) for row in comparison.ranks}
    origin = int(events["start_ns"].min())
    frame = events.assign(
        host=[hosts.get(int(rank), "") for rank in events["rank"]],
        start_s=(events["start_ns"] - origin) / 1e9,
        end_s=(events["end_ns"] - origin) / 1e9,
    )
    frame = frame.sort_values(["host", "rank", "start_s"], kind="stable")
    frame["lane"] = frame["host"] + " · rank " + frame["rank"].astype(str)
    return frame[columns].reset_index(drop=True)


def rate_over_time(events: pd.DataFrame, bin_s: float | None = None) -> pd.DataFrame:
    """All ranks' persist rate over time from :func:`swimlanes` rows: each persist's bytes spread
    evenly over its duration, summed over ranks in bins of ``bin_s`` (default: a 40th of the
    span); columns ``start_s`` (the bin's) and ``write_gbs``."""
    persists = events[(events["kind"] == "persist") & (events["end_s"] > events["start_s"])]
    if persists.empty:
        return pd.DataFrame(columns=["start_s", "write_gbs"])
    begin, end = float(persists["start_s"].min()), float(persists["end_s"].max())
    width = bin_s if bin_s is not None and bin_s > 0 else max((end - begin) / 40, 1e-6)
    edges = begin + width * np.arange(math.ceil((end - begin) / width) + 1)
    written = np.zeros(len(edges) - 1)
    spans = zip(
        persists["start_s"].astype(float),
        persists["end_s"].astype(float),
        persists["bytes"].astype(float),
        strict=True,
    )
    for start, stop, nbytes in spans:
        overlap = (np.minimum(edges[1:], stop) - np.maximum(edges[:-1], start)).clip(min=0)
        written += nbytes / (stop - start) * overlap
    return pd.DataFrame({"start_s": edges[:-1], "write_gbs": written / width / GB})


def scaling_table(jobs: Sequence[Comparison], sources: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per run and strategy that wrote: the job's rank and host counts, its aggregate
    write rate beside the concurrent raw-write floors measured in the same run (with the ranks
    idle; beside training where the ranks trained on the host, else NaN), the stall over
    ranks and the overhead at the slowest rank; sorted by rank count (the measured curve).
    ``attrs``: ``measured_ranks`` and ``label`` (the range measured, to title the curve with).
    Runs of several rank counts that are not one curve are refused (:func:`_check_one_curve`)."""
    names = list(sources) if sources is not None else [""] * len(jobs)
    labels = [name or f"run {index}" for index, name in enumerate(names, 1)]
    _check_one_curve(list(zip(labels, jobs, strict=True)))
    rows = []
    for comparison, source in zip(jobs, names, strict=True):
        for row in job_table(comparison).to_dict(orient="records"):
            rows.append(
                {
                    "ranks": _world_size(comparison),
                    "hosts": len(comparison.job.get("hosts", {})),
                    "strategy": row["strategy"],
                    **{key: row[key] for key in _FROM_JOB_TABLE},
                    "source": source,
                }
            )
    frame = pd.DataFrame(rows, columns=SCALING_COLUMNS)
    frame = frame.sort_values(["strategy", "ranks"], kind="stable").reset_index(drop=True)
    measured = sorted({int(count) for count in frame["ranks"]})
    # The curve says what it rests on: a fit or a reading beyond these counts is not measured.
    frame.attrs.update(measured_ranks=measured, label=_measured_range(measured))
    return frame


def _world_size(comparison: Comparison) -> int:
    return int(comparison.job.get("world_size") or len({row["rank"] for row in comparison.ranks}))


#: The rank count at the end of a workload's description on many ranks (``_rank_workload``:
#: "its own state on 1 rank", "... on each of 2 ranks").
_RANK_COUNT = re.compile(r"(?: each of)? \d+ ranks?$")


def _setting(comparison: Comparison) -> dict[str, str]:
    """What the points of one scaling curve share, as far as the JSON records it: the workload
    (less its rank count), the device, and the storage (:func:`_storage`)."""
    return {
        "workload": _RANK_COUNT.sub(" N ranks", comparison.workload),
        "device": " ".join(filter(None, (comparison.device, comparison.environment.get("device_name")))),
        "storage": _storage(comparison.directory),
    }


def _storage(directory: str) -> str:
    """An object store's bucket (``s3://bucket``); any local path is one local filesystem: the
    JSON records no mount, and runs of several sizes often write to a folder each."""
    if not is_url(directory):
        return "a local filesystem"
    scheme, _, rest = directory.partition("://")
    return f"{scheme}://{rest.split('/')[0]}"


def _check_one_curve(runs: Sequence[tuple[str, Comparison]]) -> None:
    """A one-line :class:`ConfigError` naming two of ``runs`` (``(source, comparison)``) unless
    those of several rank counts make one measured curve: the same :func:`_setting` and one run
    per rank count (a second would be dropped from the line or zigzag it). Runs of one rank
    count make no curve: each is shown on its own."""
    if len({_world_size(comparison) for _, comparison in runs}) < 2:
        return
    first, base = runs[0][0], _setting(runs[0][1])
    seen: dict[int, str] = {}
    for source, comparison in runs:
        setting = _setting(comparison)
        differs = [
            f"{key} {base[key]!r} against {value!r}" for key, value in setting.items() if value != base[key]
        ]
        if differs:
            raise ConfigError(f"{first} and {source} are not one scaling curve: {'; '.join(differs)}")
        world = _world_size(comparison)
        if world in seen:
            raise ConfigError(
                f"{seen[world]} and {source} both ran on {world} ranks: a scaling curve takes one "
                "run per rank count; give one of them"
            )
        seen[world] = source


def _measured_range(ranks: Sequence[int]) -> str:
    if not ranks:
        return "nothing measured"
    if len(ranks) == 1:
        return f"measured on {ranks[0]} rank{'s' if ranks[0] > 1 else ''}"
    return f"measured on {ranks[0]} to {ranks[-1]} ranks"


def _over_repeats(row: Mapping[Any, Any], name: str, unit: str, digits: int) -> str:
    """``95 % over repeats lo-hi unit`` from a :func:`job_table` row, or nothing with one repeat."""
    suffix = "_s" if unit == "s" else "_gbs"
    lo, hi = _number(row.get(f"{name}_lo{suffix}")), _number(row.get(f"{name}_hi{suffix}"))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    return f"95 % over repeats {lo:.{digits}f}-{hi:.{digits}f} {unit}"


def job_conclusions(table: pd.DataFrame) -> list[str]:
    """What :func:`job_table`'s rows show, one sentence per finding."""
    lines = []
    for row in table.to_dict(orient="records"):
        durable, rate = (
            _over_repeats(row, "time_to_durable", "s", 3),
            _over_repeats(row, "aggregate_write", "GB/s", 2),
        )
        text = (
            f"{row['strategy']}: all ranks' checkpoint durable in {row['time_to_durable_s']:.3f} s "
            f"(median{f'; {durable}' if durable else ''}), {row['aggregate_write_gbs']:.2f} GB/s "
            f"aggregate{f' ({rate})' if rate else ''}"
        )
        if math.isfinite(row["vs_floor"]):
            text += (
                f", {row['vs_floor']:.2f}x the {row['concurrent_floor_gbs']:.2f} GB/s every rank "
                "wrote raw at once in the same run between turns (no rank training)"
            )
        if math.isfinite(row["vs_floor_beside_training"]):
            text += (
                f", {row['vs_floor_beside_training']:.2f}x the {row['floor_beside_training_gbs']:.2f} "
                "GB/s they wrote raw beside training"
            )
        text += f"; stall over ranks median {row['stall_median_s']:.4f} s, max {row['stall_max_s']:.4f} s"
        if math.isfinite(row["overhead_pct"]):  # the job goes at its slowest rank's pace
            text += f"; overhead at the slowest rank ({row['slowest_rank']}) {row['overhead_pct']:+.1f} %"
        # A straggler only where a rank stalled longer than the median (never in a job of one).
        if not pd.isna(row["straggler_rank"]) and row["straggler_over_median_s"] > 0:
            text += (
                f"; straggler rank {int(row['straggler_rank'])} on {row['straggler_host']}, "
                f"{row['straggler_over_median_s']:+.4f} s over the median"
            )
        lines.append(text + ".")
    stalls = {
        str(row["strategy"]): float(row["stall_max_s"])
        for row in table.to_dict(orient="records")
        if math.isfinite(float(row["stall_max_s"]))
    }
    if len(stalls) > 1:
        best = min(stalls, key=lambda name: stalls[name])
        lines.append(f"Lowest stall on the slowest rank: {best} ({stalls[best]:.4f} s).")
    return lines


def scaling_conclusions(table: pd.DataFrame) -> list[str]:
    """What :func:`scaling_table`'s rows show: per strategy, from the fewest ranks measured to
    the most, how the aggregate rate, the floor, the stall and the overhead changed."""
    lines = []
    for strategy, rows in table.groupby("strategy", sort=False):
        rows = rows.sort_values("ranks")
        if rows["ranks"].nunique() < 2:
            continue
        low, high = rows.iloc[0], rows.iloc[-1]
        beside = (_number(low["floor_beside_training_gbs"]), _number(high["floor_beside_training_gbs"]))
        lines.append(
            f"{strategy}, measured on {int(low['ranks'])} to {int(high['ranks'])} ranks: aggregate "
            f"write {low['aggregate_write_gbs']:.2f} -> {high['aggregate_write_gbs']:.2f} GB/s "
            f"(concurrent raw-write floor {low['concurrent_floor_gbs']:.2f} -> "
            f"{high['concurrent_floor_gbs']:.2f} GB/s with the ranks idle"
            + (
                f", {beside[0]:.2f} -> {beside[1]:.2f} GB/s beside training"
                if all(math.isfinite(value) for value in beside)
                else ""
            )
            + f"); median stall {low['stall_median_s']:.4f} -> "
            f"{high['stall_median_s']:.4f} s; overhead at the slowest rank {low['overhead_pct']:+.1f} "
            f"-> {high['overhead_pct']:+.1f} %."
        )
    return lines
