"""What checkpointing costs the whole job, from every rank's records: :func:`job_summary`.

Pure: no processes, no clocks. Each rank of a bench on many ranks (:mod:`._ranks`) hands rank 0
one :data:`RankRecord`; this module turns the list into the ``ranks`` rows and the ``job``
section of the JSON document (schema in :mod:`._comparison`). Times across ranks are wall-clock
nanoseconds (each rank's event clock moved onto ``time.time_ns``), so a checkpoint's time to
durable spans ranks and, on a cluster, hosts (as exactly as their clocks agree).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._util import GB
from ._load import Load
from ._stats import t_interval

__all__ = ["RankRecord", "host_load", "job_summary", "job_text", "straggler"]

#: One rank's record, as it is gathered to rank 0::
#:
#:     {"rank": 1, "host": "node-a",
#:      "strategies": [{"strategy", "stall_s", "persist_s", "bytes", "write_gbs", "mean_step_s",
#:                      "overhead_pct", "checkpoints"}, ...],
#:      "checkpoints": [{"strategy", "repeat", "step", "start_ns", "persist_start_ns", "end_ns",
#:                       "bytes", "persist_s", "steps_beside"}, ...],  # steps_beside: its training
#:                                            # steps that overlapped the write (persist_start_ns on)
#:      "floor_writes": [{"repeat", "start_ns", "end_ns", "bytes"}, ...],  # its write's first byte
#:                                                                   # to its fsync's end
#:      "floor_beside_writes": [<as "checkpoints">, ...],  # the raw write beside training (host
#:                                                        # compute only; ._measure.RawWriteBeside)
#:      "floor_beside": {"writer_threads": 2, "writer_nice": 10},  # its writers, as nbckpt's
#:      "copy_floor": {"bytes", "copy_s", "copy_gbs", "copy_gbs_by_repeat"},  # as in one process
#:      "load": {<Load's fields>, "high"},  # this rank's comparison, as in one process
#:      "kept": [{"strategy", "repeat", "step", "digests": {key: sha256}}, ...],  # with --keep
#:      "collectives_s": [0.001, 0.12, ...],  # each of the bench's barriers and gathers, in order
#:      "gather_s": 0.01,  # rank 0 only: its gather of the records, added after it
#:      "steps_trained": 60}
RankRecord = Mapping[str, Any]
_BESIDE_KEYS = (
    "repeat",
    "step",
    "ranks_writing",
    "bytes",
    "aggregate_persist_gbs",
    "start_spread_s",
    "steps_beside",
)


def _number(value: Any) -> float:
    """A float, NaN for what is missing (JSON's null, pandas' NA)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def _aggregate(spans: Sequence[Mapping[str, Any]]) -> tuple[float, float, int, int, int]:
    """Over the spans of one checkpoint (or one floor write), one per rank that wrote: the time
    from the first start to the last end (s), the rate of all their bytes over it (GB/s), the
    bytes, and which rank started first and ended last."""
    first = min(spans, key=lambda span: int(span["start_ns"]))
    last = max(spans, key=lambda span: int(span["end_ns"]))
    seconds = (int(last["end_ns"]) - int(first["start_ns"])) / 1e9
    total = sum(int(span["bytes"]) for span in spans)
    rate = total / seconds / GB if seconds > 0 else math.nan
    return seconds, rate, total, int(first["rank"]), int(last["rank"])


def straggler(stalls: Mapping[int, float], hosts: Mapping[int, str]) -> dict[str, Any] | None:
    """The rank whose stall is the longest, its host, and by how much it exceeds the median
    over ranks (seconds and ratio); None when no rank stalled longer than the median (one rank,
    or every rank alike: nobody straggles)."""
    if not stalls or max(stalls.values()) <= 0:
        return None
    rank = max(stalls, key=lambda r: (stalls[r], -r))  # the lowest rank of a tie
    median = statistics.median(stalls.values())
    if stalls[rank] <= median:
        return None
    return {
        "rank": rank,
        "host": hosts.get(rank, ""),
        "stall_s": stalls[rank],
        "median_s": median,
        "over_median_s": stalls[rank] - median,
        "over_median_ratio": stalls[rank] / median if median > 0 else math.nan,
    }


def _distribution(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"median": math.nan, "p99": math.nan, "max": math.nan}
    return {
        "median": float(np.median(values)),
        "p99": float(np.percentile(values, 99)),
        "max": float(max(values)),
    }


def _checkpoints(
    records: Sequence[RankRecord], strategy: str | None, field: str = "checkpoints"
) -> list[dict[str, Any]]:
    """Each checkpoint of ``strategy`` (None: of every span) over the ranks' spans under ``field``."""
    spans: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for record in records:
        for span in record.get(field, []):
            if strategy is None or span["strategy"] == strategy:
                key = (int(span["repeat"]), int(span["step"]))
                spans.setdefault(key, []).append({**span, "rank": record["rank"]})
    rows = []
    for (repeat, step), group in sorted(spans.items()):
        seconds, rate, total, first, last = _aggregate(group)
        starts = [int(span["start_ns"]) for span in group]
        writes = [int(span["persist_start_ns"]) for span in group if span.get("persist_start_ns") is not None]
        writing_s = (max(int(span["end_ns"]) for span in group) - min(writes)) / 1e9 if writes else math.nan
        rows.append(
            {
                "repeat": repeat,
                "step": step,
                "ranks_writing": len(group),
                "bytes": total,
                "time_to_durable_s": seconds,
                "aggregate_write_gbs": rate,
                # the same bytes over the writes alone: the first rank's write start to the last commit
                "aggregate_persist_gbs": total / writing_s / GB if writing_s > 0 else math.nan,
                "first_rank": first,
                "last_rank": last,
                # how far apart the ranks began this save: small when they run in lockstep
                "start_spread_s": (max(starts) - min(starts)) / 1e9,
                # the fewest training steps any rank ran while it wrote this checkpoint
                "steps_beside": min(int(span.get("steps_beside", 0)) for span in group),
            }
        )
    return rows


def _over_repeats(checkpoints: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    """The 95 % interval of ``key`` over repeats, as the one-process figures have theirs: a
    t-interval of the log of each repeat's median over its checkpoints, in log space as times
    and rates are positive and spread by ratios (NaN with fewer than 2 repeats)."""
    by_repeat: dict[int, list[float]] = {}
    for row in checkpoints:
        if row[key] > 0:  # NaN too is left out
            by_repeat.setdefault(int(row["repeat"]), []).append(row[key])
    return _log_interval([float(np.median(values)) for values in by_repeat.values()])[1:]


def _log_interval(values: Sequence[float]) -> list[float]:
    """``[mean, lo, hi]`` of positive ``values`` (times, rates; others left out): the 95 %
    t-interval of their logs, back on their scale, as they spread by ratios. A geometric mean,
    and bounds that never fall below 0 as a t-interval of the rates themselves can (NaN bounds
    below 2 values)."""
    logs = [math.log(value) for value in values if value > 0]
    return [math.exp(value) for value in t_interval(logs)]


def _strategy_summary(
    records: Sequence[RankRecord], strategy: str, hosts: Mapping[int, str]
) -> dict[str, Any]:
    rows = {
        int(record["rank"]): row
        for record in records
        for row in record.get("strategies", [])
        if row["strategy"] == strategy
    }
    stalls = {rank: _number(row.get("stall_s")) for rank, row in rows.items()}
    stalls = {rank: value for rank, value in stalls.items() if not math.isnan(value)}
    overheads = {rank: _number(row.get("overhead_pct")) for rank, row in rows.items()}
    overheads = {rank: value for rank, value in overheads.items() if not math.isnan(value)}
    # The job trains at its slowest rank's pace: its overhead is the largest of any rank's.
    slowest = max(overheads, key=lambda r: (overheads[r], -r)) if overheads else None
    checkpoints = _checkpoints(records, strategy)
    durable = [row["time_to_durable_s"] for row in checkpoints]
    rates = [row["aggregate_write_gbs"] for row in checkpoints if not math.isnan(row["aggregate_write_gbs"])]
    writes = [
        row["aggregate_persist_gbs"] for row in checkpoints if not math.isnan(row["aggregate_persist_gbs"])
    ]
    return {
        "strategy": strategy,
        "overhead_pct": overheads[slowest] if slowest is not None else math.nan,
        "slowest_rank": slowest,
        "stall_s": _distribution(list(stalls.values())),
        "straggler": straggler(stalls, hosts),
        "time_to_durable_s": float(np.median(durable)) if durable else math.nan,
        "aggregate_write_gbs": float(np.median(rates)) if rates else math.nan,
        "aggregate_persist_gbs": float(np.median(writes)) if writes else math.nan,
        "time_to_durable_ci_s": _over_repeats(checkpoints, "time_to_durable_s"),
        "aggregate_write_ci_gbs": _over_repeats(checkpoints, "aggregate_write_gbs"),
        "bytes_per_checkpoint": int(np.median([row["bytes"] for row in checkpoints])) if checkpoints else 0,
        "checkpoints": checkpoints,
    }


def _floor(records: Sequence[RankRecord]) -> dict[str, Any]:
    """The concurrent raw write: every rank wrote its share at once, in each repeat."""
    by_repeat: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        for span in record.get("floor_writes", []):
            by_repeat.setdefault(int(span["repeat"]), []).append({**span, "rank": record["rank"]})
    rounds = [_aggregate(group) for _, group in sorted(by_repeat.items())]
    rates = [rate for _, rate, _, _, _ in rounds if not math.isnan(rate)]
    floors = {
        "concurrent_write_gbs": max(rates) if rates else math.nan,  # the fastest, as the one-rank floor
        "concurrent_write_gbs_by_repeat": [rate for _, rate, _, _, _ in rounds],
        "concurrent_write_gbs_interval": _log_interval(rates),
        "bytes": rounds[0][2] if rounds else 0,
        "ranks": len(records),
    }
    beside = _floor_beside(records)
    return floors if beside is None else {**floors, "beside_training": beside}


def _floor_beside(records: Sequence[RankRecord]) -> dict[str, Any] | None:
    """The raw write of every rank's share beside training (``._measure.RawWriteBeside``), as a
    strategy's persist is measured: per checkpoint, all ranks' bytes over the first rank's write
    start to the last fsync's end; None where it was not measured (idle compute, CUDA)."""
    checkpoints = [
        {key: row[key] for key in _BESIDE_KEYS}
        for row in _checkpoints(records, None, field="floor_beside_writes")
    ]
    if not checkpoints:
        return None
    rates = [
        row["aggregate_persist_gbs"] for row in checkpoints if math.isfinite(row["aggregate_persist_gbs"])
    ]
    writers = records[0].get("floor_beside", {})
    return {
        "write_gbs": float(np.median(rates)) if rates else math.nan,  # the median, as a strategy's
        "write_gbs_interval": _log_interval(rates),  # (mean, lo, hi) over checkpoints
        "writer_threads": writers.get("writer_threads"),
        "writer_nice": writers.get("writer_nice"),
        "checkpoints": checkpoints,
    }


def _floors_by_rank(records: Sequence[RankRecord]) -> list[dict[str, Any]]:
    """Each rank's floors, measured while every rank measured its own: its fastest raw write of
    its share while all ranks wrote at once, and its copy floor (as one process measures it)."""
    rows = []
    for record in records:
        rates = [
            int(span["bytes"]) / ((int(span["end_ns"]) - int(span["start_ns"])) / 1e9) / GB
            for span in record.get("floor_writes", [])
            if int(span["end_ns"]) > int(span["start_ns"])
        ]
        copy = record.get("copy_floor") or {}
        rows.append(
            {
                "rank": int(record["rank"]),
                "host": str(record.get("host", "")),
                "concurrent_write_gbs": max(rates) if rates else math.nan,
                "bytes": int(copy.get("bytes", 0)),
                "copy_s": _number(copy.get("copy_s")),
                "copy_gbs": _number(copy.get("copy_gbs")),
                "copy_gbs_by_repeat": [_number(rate) for rate in copy.get("copy_gbs_by_repeat", [])],
            }
        )
    return rows


def host_load(loads: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One host's load from its ranks' (each a :class:`~._load.Load` as a dict, over the same
    comparison): the busiest load-average reading, the ranks' CPU together as the job's own, and
    as other processes' only what was busy beyond all of the host's ranks (each rank counts the
    others among "other processes")."""
    ranks = [Load(**{name: load[name] for name in Load.__dataclass_fields__}) for load in loads]
    busy = statistics.median(load.other_cpu_cores + load.own_cores for load in ranks)
    own_cores = sum(load.own_cores for load in ranks)
    return Load(
        cpus=max(load.cpus for load in ranks),
        wall_s=max(load.wall_s for load in ranks),
        own_cpu_s=sum(load.own_cpu_s for load in ranks),
        other_cpu_cores=max(busy - own_cores, 0.0),
        steal_pct=max(load.steal_pct for load in ranks),
        loadavg_1m_start=max(load.loadavg_1m_start for load in ranks),
        loadavg_1m=max(load.loadavg_1m for load in ranks),
    ).to_dict()


def _load_by_host(records: Sequence[RankRecord], on_host: Mapping[str, list[int]]) -> dict[str, Any]:
    """Every host's load (:func:`host_load`) and its ranks; a host none of whose ranks recorded
    a load is left out."""
    loads = {int(record["rank"]): record["load"] for record in records if record.get("load")}
    by_host = {}
    for host, ranks in on_host.items():
        measured = [loads[rank] for rank in ranks if rank in loads]
        if measured:
            by_host[host] = {"ranks": list(ranks), **host_load(measured)}
    return by_host


def _coordination(records: Sequence[RankRecord]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The bench's own cost, and each rank's wait for the slowest rank at the turns' boundaries.

    Every rank passes the same collectives in the same order. A rank that arrives early at one
    waits there for the last to arrive: that is the job going at its slowest rank (the
    straggler's figures), not a cost of the bench's. The collective's own cost is what the last
    rank spent in it, the least time of any rank's. So the bench's coordination is the sum over
    collectives of that least time, plus rank 0's gather of the records, per step trained (the
    fewest steps of any rank); the rest of each rank's time in them is its turn wait.
    """
    spent = [[float(seconds) for seconds in record.get("collectives_s", [])] for record in records]
    # Only the collectives every rank recorded (all of them, unless a record was cut short).
    least = [min(each) for each in zip(*spent, strict=False)] if spent else []
    gather = sum(_number(record.get("gather_s", 0.0)) for record in records)  # rank 0's alone
    steps = min((int(record.get("steps_trained", 0)) for record in records), default=0)

    def per_step(seconds: float) -> float:
        return seconds / steps if steps > 0 else math.nan

    coordination = {
        "seconds": sum(least) + gather,
        "per_step_s": per_step(sum(least) + gather),
        "collectives": len(least),
        "gather_s": gather,
    }
    waits = []
    for record, own in zip(records, spent, strict=True):
        waited = sum(own[: len(least)]) - sum(least)
        waits.append(
            {
                "rank": int(record["rank"]),
                "collectives_s": sum(own),
                "seconds": waited,
                "per_step_s": per_step(waited),
            }
        )
    return coordination, waits


def job_summary(records: Sequence[RankRecord]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(ranks, job)`` of the JSON document from every rank's record (any order).

    ``ranks``: one row per rank and strategy. ``job``: the world size, the ranks on each host,
    the concurrent write floor with every rank's floors, every host's load, and per strategy its
    overhead at the slowest rank, the stall's distribution over ranks, the straggler and every
    checkpoint's time to durable (first start to last commit on any rank) and aggregate write
    rate (all ranks' bytes over that time); the bench's own coordination and each rank's turn
    wait (:func:`_coordination`).
    """
    ordered = sorted(records, key=lambda record: int(record["rank"]))
    hosts = {int(record["rank"]): str(record.get("host", "")) for record in ordered}
    rows = [
        {"rank": int(record["rank"]), "host": hosts[int(record["rank"])], **row}
        for record in ordered
        for row in record.get("strategies", [])
    ]
    strategies = list(dict.fromkeys(row["strategy"] for row in rows))
    on_host: dict[str, list[int]] = {}
    for rank, host in hosts.items():
        on_host.setdefault(host, []).append(rank)
    job = {
        "world_size": len(ordered),
        "hosts": on_host,
        "floors": {**_floor(ordered), "by_rank": _floors_by_rank(ordered)},
        "load_by_host": _load_by_host(ordered, on_host),
        "strategies": [_strategy_summary(ordered, name, hosts) for name in strategies],
    }
    job["coordination"], job["turn_wait"] = _coordination(ordered)
    kept = [{"rank": int(record["rank"]), **saved} for record in ordered for saved in record.get("kept", [])]
    if kept:  # --keep: what each rank's kept checkpoints hold, to check a restore against
        job["kept"] = kept
    return rows, job


def _copy_text(floors: Mapping[str, Any]) -> str:
    copies = [_number(row.get("copy_gbs")) for row in floors.get("by_rank", [])]
    copies = [rate for rate in copies if math.isfinite(rate)]
    return f"; copy floor per rank {min(copies):.1f}-{max(copies):.1f} GB/s" if copies else ""


def _repeats_text(interval: Sequence[Any] | None, unit: str, digits: int) -> str:
    """`` [lo, hi] unit over repeats``, or nothing where there is no interval (one repeat)."""
    lo, hi = (_number(value) for value in (interval or (math.nan, math.nan)))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return ""
    return f" [{lo:.{digits}f}, {hi:.{digits}f}] {unit} over repeats"


def _beside_text(floors: Mapping[str, Any]) -> str:
    beside = floors.get("beside_training")
    if not beside:
        return ""
    return (
        f", {_number(beside['write_gbs']):.2f} GB/s beside training (nbckpt's "
        f"{beside['writer_threads']} writer threads at nice {beside['writer_nice']})"
    )


def job_text(job: Mapping[str, Any]) -> list[str]:
    """The job's figures as lines under the results table: the concurrent floor, then per
    strategy that writes its time to durable, aggregate rate, overhead and straggler."""
    hosts = job.get("hosts", {})
    floors = job.get("floors", {})
    lines = [
        f"on {job.get('world_size', 0)} ranks, {len(hosts)} host(s); all ranks writing at once "
        f"raw: {_number(floors.get('concurrent_write_gbs')):.2f} GB/s aggregate between turns (no "
        f"rank training){_beside_text(floors)}{_copy_text(floors)}"
    ]
    lines += [
        f"host {host} (ranks {', '.join(map(str, load['ranks']))}): 1-minute load average "
        f"{_number(load['loadavg_1m']):.1f} on {load['cpus']} cores, other processes "
        f"{_number(load['other_cpu_cores']):.1f} cores"
        + ("; busy: expect wide intervals" if load["high"] else "")
        for host, load in job.get("load_by_host", {}).items()
    ]
    for row in job.get("strategies", []):
        if not row.get("checkpoints"):
            continue
        stall = row["stall_s"]
        text = (
            f"[{row['strategy']}] time to durable {_number(row['time_to_durable_s']):.3f} s"
            f"{_repeats_text(row.get('time_to_durable_ci_s'), 's', 3)}, aggregate write "
            f"{_number(row['aggregate_write_gbs']):.2f} GB/s"
            f"{_repeats_text(row.get('aggregate_write_ci_gbs'), 'GB/s', 2)}; stall over ranks "
            f"median {_number(stall['median']):.4f} s, p99 {_number(stall['p99']):.4f} s, max "
            f"{_number(stall['max']):.4f} s; overhead at the slowest rank "
            f"{_number(row['overhead_pct']):.1f} %"
        )
        late = row.get("straggler")
        if late is not None:
            text += (
                f"; straggler rank {late['rank']} on {late['host']}, "
                f"{_number(late['over_median_s']):+.4f} s over the median"
            )
        lines.append(text)
    return lines
