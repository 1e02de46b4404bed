"""The report's conclusions: every sentence computed from the numbers of one comparison,
naming its assumptions (the advisor's parameters) and saying when async loses and why."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._util import format_bytes
from ..bench._internal import interval_text, measurable, overhead_text
from ._costs import measured_drag
from ._interval import Overhead, compare_modes, table_order
from ._reference import _load as published  # read-only here: no copy

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["conclusions"]

Row = Mapping[str, Any]


def _num(value: Any) -> float:
    """A measured number as float; NaN where it was not measured (None, NaN, text)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def _finite(value: Any) -> bool:
    return not math.isnan(_num(value))


def _size(nbytes: Any) -> str:
    return format_bytes(_num(nbytes)) if _finite(nbytes) else "an unmeasured size"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _times(factor: float) -> str:
    return f"{factor:.1f}x" if factor < 100 else f"{factor:.0f}x"


def _ci(row: Row) -> tuple[float, float]:
    """A row's overhead interval ``(lo, hi)``; NaNs where it has none."""
    interval = row.get("overhead_ci_pct")
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        return _num(interval[0]), _num(interval[1])
    return math.nan, math.nan


def _overheads(run: _Run) -> dict[str, Overhead]:
    """Each strategy's overhead as the results table shows it, for the advisor's sentences."""
    return {name: (_num(row.get("overhead_pct")), *_ci(row)) for name, row in run.rows.items()}


def _overhead(row: Row) -> str:
    """The overhead and its interval as every table writes them (:func:`overhead_text`)."""
    return f"{overhead_text(row)}, 95 % interval {interval_text(row.get('overhead_ci_pct'))}"


@dataclass(frozen=True)
class _Run:
    """What every sentence reads: the complete rows by strategy, the one concluded about (its
    name ``focus``, its ``row``), the floors, the environment, the published anchors."""

    rows: Mapping[str, Row]
    focus: str
    row: Row
    floors: Mapping[str, Any]
    env: Mapping[str, Any]
    device: str
    anchors: Mapping[str, Any]


def conclusions(
    results: pd.DataFrame,
    floors: Mapping[str, Any],
    *,
    advice: pd.DataFrame | None = None,
    timeline: pd.DataFrame | None = None,
    environment: Mapping[str, Any] | None = None,
    assumptions: Mapping[str, Any] | None = None,
    probe: pd.DataFrame | None = None,
    load: Mapping[str, Any] | None = None,
) -> list[str]:
    """Sentences stating what the measurements show, each computed from the numbers given.

    ``results`` is ``Comparison.results``, ``floors`` ``Floors.to_dict()``, ``advice``
    :func:`advise`'s table, ``timeline`` ``Comparison.timeline`` (to split the stall),
    ``environment`` :func:`nbckpt.bench.environment` plus ``device``, ``assumptions`` the report's
    advisor parameters, ``probe`` the probe's ``to_pandas()``, ``load`` ``Comparison.load``.
    Partial rows (a stopped run), and sentences whose inputs were not measured, are left out.
    """
    records = [{str(k): v for k, v in r.items()} for r in results.to_dict(orient="records")]
    partial = [str(r["strategy"]) for r in records if bool(r.get("partial", False))]
    rows = {str(r["strategy"]): r for r in records if not bool(r.get("partial", False))}
    lines = (
        [
            f"Left out of these conclusions because their runs were stopped before the end "
            f"(partial): {', '.join(partial)}."
        ]
        if partial
        else []
    )
    focus = next((name for name in ("nbckpt-async", "nbckpt-async-overlap") if name in rows), None)
    if focus is None:
        return [
            *lines,
            "No asynchronous nbckpt strategy was measured to the end, so there is "
            "nothing to conclude about asynchronous checkpointing; add nbckpt-async to the "
            "strategies.",
        ]
    env = dict(environment or {})
    run = _Run(rows, focus, rows[focus], floors, env, str(env.get("device", "cpu")), published()["anchors"])
    lines.append(_stall_sentence(run))
    lines.extend(_copy_floor_sentence(run, timeline))
    lines.extend(_write_sentences(run, probe, load))
    lines.extend(_overhead_sentences(run))
    lines.extend(_published_sentences(run))
    overlap = rows.get("nbckpt-async-overlap")
    if focus == "nbckpt-async" and overlap is not None and _finite(overlap["stall_mean_s"]):
        lines.append(
            f"With overlap=True the save returns before the copy and the loop waits only "
            f"before its next optimizer update: {_ms(float(overlap['stall_mean_s']))} of stall per "
            f"checkpoint, and an overhead of {_overhead(overlap)}; the copy still runs on "
            f"this machine's cores, so overlap hides the wait, not the work."
        )
    lines.extend(_incremental_sentence(run))
    if advice is not None and not advice.empty:
        lines.extend(_advice_sentences(run, advice, assumptions or {}))
    return lines


# incremental=True pays where it leaves more than this share of the state unwritten.
_INCREMENTAL_PAYS = 0.5


def _incremental_sentence(run: _Run) -> list[str]:
    """Whether ``incremental=True`` pays on this workload: the bytes nbckpt-incremental did not
    write, against the focus strategy's, and the stall each cost."""
    row = run.rows.get("nbckpt-incremental")
    ours = _num(run.row.get("written_mb"))
    theirs = _num(row.get("written_mb")) if row is not None else math.nan
    if row is None or math.isnan(ours) or math.isnan(theirs) or ours <= 0:
        return []
    skipped = 1 - theirs / ours
    measured = (
        f"nbckpt-incremental wrote {theirs:.2f} MB a checkpoint against {ours:.2f} MB for {run.focus} "
        f"({100 * skipped:.0f} % not written), with a stall of {_ms(_num(row['stall_mean_s']))} against "
        f"{_ms(_num(run.row['stall_mean_s']))}"
    )
    if skipped > _INCREMENTAL_PAYS:
        slower = _num(row["stall_mean_s"]) / _num(run.row["stall_mean_s"])
        cost = (
            f" Its stall was {_times(slower)} the stall without it (the fingerprints): it pays where "
            f"writes or storage, not the stall, are the limit."
            if slower > 1.2
            else ""
        )
        return [
            f"incremental=True pays here: {measured}; the files it did not write are shared with "
            f"the step before, and every step still restores whole.{cost}"
        ]
    return [
        f"incremental=True does not pay here: {measured}; most of the state changes between saves, "
        f"so leave it off (it fingerprints what torch's version counter cannot clear at every save)."
    ]


def _stall_sentence(run: _Run) -> str:
    row, torch_save = run.row, run.rows.get("torch-save")
    stall = float(row["stall_mean_s"])
    save, wait = _num(row.get("save_stall_s")), _num(row.get("wait_s"))
    parts = (
        f" (save stall {_ms(save)} + wait for the earlier save {_ms(wait)})"
        if _finite(save) and wait > 0
        else ""
    )
    text = (
        f"{run.focus}'s stall (the time the training loop was blocked) was {_ms(stall)} per "
        f"checkpoint of {_size(run.floors.get('bytes'))}{parts} (p95 {_ms(float(row['stall_p95_s']))})"
    )
    if torch_save is not None and _finite(torch_save["stall_mean_s"]) and stall > 0:
        theirs = float(torch_save["stall_mean_s"])
        if theirs >= stall:
            text += f", {_times(theirs / stall)} less than torch-save's ({_ms(theirs)})"
        else:
            text += (
                f", {_times(stall / theirs)} more than torch-save's ({_ms(theirs)}): here the "
                f"synchronous write was cheaper than the asynchronous stall"
            )
    return text + "."


def _copy_floor_sentence(run: _Run, timeline: pd.DataFrame | None) -> list[str]:
    """The save stall against the copy floor: below it is a measurement problem, never praise;
    an overlapped copy runs behind the loop and has no such bound."""
    row = run.row
    copy_s = _num(run.floors.get("copy_s"))
    save = _num(row.get("save_stall_s", row.get("stall_mean_s")))
    if not (copy_s > 0 and save > 0) or run.focus.endswith("-overlap"):
        return []
    ratio = save / copy_s
    floor = f"the copy floor ({_ms(copy_s)} to copy the same bytes into preallocated memory)"
    if ratio < 1:
        return [
            f"Its save stall, {_ms(save)}, is {_times(ratio)} {floor}: below what the hardware "
            f"allows, which is a measurement problem (the floor and the runs met different "
            f"moments of a shared machine; the floor is the fastest of its rounds before "
            f"each repeat), not a result."
        ]
    text = f"Its save stall is {_times(ratio)} {floor}"
    if ratio <= 1.5:
        return [text + ": save() takes little more than the copy itself."]
    checkpoints = _num(row.get("checkpoints")) * _num(row.get("repeats", 1))
    if timeline is None or timeline.empty or not checkpoints > 0:
        return [text + "."]
    events = timeline[timeline["strategy"] == run.focus] if "strategy" in timeline else timeline
    stage = events.loc[events["kind"] == "stage", "duration_s"]
    if stage.empty:
        return [text + "."]
    per_checkpoint = float(stage.sum()) / checkpoints
    return [
        text + f". Per checkpoint the copy into the staging buffers took {_ms(per_checkpoint)}; "
        f"the other {_ms(max(save - per_checkpoint, 0.0))} of the save stall was spent on the rest "
        f"of save(): flattening the state and planning its files, the retention and host-memory "
        f"checks, taking a staging slot and handing the write to the background thread (the "
        f"wait for the earlier save is counted apart)."
    ]


def _write_sentences(run: _Run, probe: pd.DataFrame | None, load: Mapping[str, Any] | None) -> list[str]:
    """The background write against the floor, and the floor against the probe."""
    lines: list[str] = []
    row, floors = run.row, run.floors
    floor = _num(floors.get("write_gbs"))
    if not floor > 0:
        return lines
    rounds = [_num(v) for v in floors.get("write_gbs_rounds") or [] if _finite(v)]
    if _finite(row.get("write_gbs")):
        lines.append(
            f"Its background writes ran at {float(row['write_gbs']):.2f} GB/s, "
            f"{100 * float(row['write_gbs']) / floor:.0f}% of the raw fsync'd write floor of the "
            f"target ({floor:.2f} GB/s, {floors.get('write_streams', 1)} stream(s), best of "
            f"{len(rounds) or 1} rounds), taking {_ms(float(row['persist_s']))} per checkpoint while "
            f"training went on."
        )
    above = [
        f"{name} ({_num(r.get('write_gbs')):.2f} GB/s)"
        for name, r in run.rows.items()
        if _num(r.get("write_gbs")) > floor
    ]
    if above:
        spread = (
            f"its rounds ranged {min(rounds):.2f}-{max(rounds):.2f} GB/s"
            if rounds
            else "it was measured once"
        )
        if load is not None and isinstance(load.get("floors"), Mapping):
            spread += (
                f"; other processes used {_num(load['floors'].get('other_cpu_cores')):.2f} "
                f"cores while the floor was measured and "
                f"{_num(load.get('other_cpu_cores')):.2f} on average over the runs"
            )
        lines.append(
            f"Above the floor, which is a measurement problem, not a result: {', '.join(above)}. "
            f"Both the floor and these writes end with fsync, so the page cache alone does not "
            f"explain it; the floor is the fastest of its rounds measured before each repeat "
            f"({spread}), and a short write can finish inside the device's or the hypervisor's "
            f"write-back cache (a burst), so on this machine rates within that spread are not different."
        )
    if probe is not None and {"streams", "write_gbs"} <= set(probe.columns):
        by_streams = dict(zip(probe["streams"].astype(int), probe["write_gbs"].map(_num), strict=True))
        floor_by = {int(k): _num(v) for k, v in (floors.get("write_gbs_by_streams") or {}).items()}
        pairs = "; ".join(
            f"{k} stream(s): probe {by_streams[k]:.2f}, floor {floor_by[k]:.2f} GB/s"
            for k in sorted(set(by_streams) & set(floor_by))
        )
        if pairs:
            lines.append(
                f"The storage probe and the write floor measure the same way (parallel threads, 4 MiB "
                f"writes, each file ended by fsync, fastest round), the probe on "
                f"{_size(probe['bytes'].iloc[0] if 'bytes' in probe.columns else None)} per stream count, "
                f"the floor on "
                f"{_size(floors.get('sample_bytes'))}, at different moments: {pairs}. The strategies "
                f"are measured against the floor."
            )
    return lines


def _overhead_sentences(run: _Run) -> list[str]:
    """Overhead with its interval, and on CPU runs when and why async loses."""
    row, focus = run.row, run.focus
    if not _finite(row.get("overhead_pct")):
        return []
    sync = [
        run.rows[name]
        for name in ("torch-save", "nbckpt-sync", "dcp-sync")
        if name in run.rows and _finite(run.rows[name].get("overhead_pct"))
    ]
    lines = [
        f"Overhead against training without checkpoints (the none run of the same repeat): "
        f"with {focus} {_overhead(row)}"
        + "".join(f", with {r['strategy']} {_overhead(r)}" for r in sync)
        + f"; {row.get('overhead_method', '')}, overhead as defined under the table."
    ]
    if run.device != "cpu":
        return lines
    cpus, threads = _num(run.env.get("cpus")), _num(run.env.get("torch_threads"))
    losing = [r for r in sync if _ci(row)[0] > _ci(r)[1]]
    if losing:
        drag = measured_drag(row)
        cpu = _num(row.get("cpu_per_checkpoint_s"))
        text = (
            f"On this CPU run {focus} cost measurably more than {losing[0]['strategy']}: its "
            f"background write runs on the same {cpus:.0f} cores as training "
            f"({threads:.0f} torch thread(s) for training)"
        )
        if _finite(cpu):
            text += f", takes about {cpu:.2f} CPU seconds per checkpoint from them"
        if drag > 0:
            text += f" and slowed the steps by {_ms(drag)} per checkpoint beyond its stall"
        text += (
            ". A GPU node trains on the GPU and leaves its host cores to the write; "
            "`--threads 1` (report parameter torch_threads = 1) leaves a core free here to "
            "imitate that"
        )
        if threads < cpus:
            text += (
                f", and this run already left {cpus - threads:.0f} core(s) free, so the "
                f"write still competed with training for memory bandwidth or the other work "
                f"on this machine"
            )
        lines.append(text + ".")
    elif sync and all(_ci(row)[1] < _ci(r)[0] for r in sync):
        lines.append(
            f"On this CPU run {focus} cost measurably less than "
            f"{' and '.join(str(r['strategy']) for r in sync)}, with {threads:.0f} torch thread(s) "
            f"for training on {cpus:.0f} cores: the background write found room beside training."
        )
    return lines


def _published_sentences(run: _Run) -> list[str]:
    """Measured figures beside published ones that compare the same thing, each labelled."""
    lines: list[str] = []
    rows, anchors = run.rows, run.anchors
    dcp_sync = rows.get("dcp-sync")
    base = _num(dcp_sync.get("stall_mean_s")) if dcp_sync is not None else math.nan
    measured = [
        f"{name} {_ms(float(rows[name]['stall_mean_s']))} "
        f"({_times(base / float(rows[name]['stall_mean_s']))} less)"
        for name in ("dcp-async", "dcp-async-stager", run.focus)
        if name in rows and _num(rows[name].get("stall_mean_s")) > 0
    ]
    if base > 0 and measured:
        values = anchors["pytorch_ibm_7b"]["values"]
        lines.append(
            f"Like for like with PyTorch/IBM's figure (synchronous DCP against async_save, "
            f"{values['sync_downtime']['value']} s to {values['async_downtime']['value']} s, "
            f"{values['reduction_factor']['value']}x, for a 7B model on GPUs), this run "
            f"measured dcp-sync at {_ms(base)} per checkpoint against {', '.join(measured)}, "
            f"on {_size(run.floors.get('bytes'))} on {run.device}: the published figure comes from "
            f"multi-GB states on GPUs, where the synchronous write dominates more than here."
        )
    elif not base > 0:
        lines.append(
            "No published figure compares against torch.save; run dcp-sync and "
            "dcp-async to set this run beside PyTorch/IBM's sync-against-async DCP figure."
        )
    torch_save = rows.get("torch-save")
    if torch_save is not None:
        mine, theirs = _num(run.row.get("overhead_pct")), _num(torch_save.get("overhead_pct"))
        text = (
            f"Pure Storage's post says that with async checkpointing on FlashBlade checkpoint "
            f'overhead drops significantly, "{anchors["pure_storage_flashblade"]["quote"]}", '
            f"with no model, GPU count or baseline given"
        )
        if measurable(torch_save.get("overhead_ci_pct")) and theirs > 0 and _finite(mine):
            if measurable(run.row.get("overhead_ci_pct")):
                text += (
                    f"; here {run.focus}'s overhead was {100.0 * (1.0 - mine / theirs):.0f} % "
                    f"lower than torch-save's ({mine:+.1f} % against {theirs:+.1f} %)"
                )
            else:
                text += (
                    f"; here torch-save's overhead was {theirs:+.1f} % and {run.focus}'s not "
                    f"measurably different from zero"
                )
        lines.append(text + ".")
    return lines


def _advice_sentences(run: _Run, advice: pd.DataFrame, assumptions: Mapping[str, Any]) -> list[str]:
    """The advisor's numbers with every assumption they rest on named."""
    by_name = {str(r["strategy"]): r for r in advice.to_dict(orient="records")}
    best = by_name.get(run.focus)
    if best is None:
        return []
    given: dict[Any, Any] = {**advice.attrs, **assumptions}
    source = str(given.get("mtbf_source", "given"))
    text = (
        f"Assuming a job of {int(given.get('gpus', 0)):,} GPUs with a job MTBF of "
        f"{float(best['job_mtbf_h']):.1f} h ({source}) and "
        f"{_num(given.get('restore_s', best['restore_s'])):g} s to restore after a failure (report "
        f"parameters gpus, job_mtbf_hours, restore_s), and "
        f"taking the costs measured here on {run.device} as one rank's, the advisor puts a "
        f"{run.focus} checkpoint every {float(best['interval_s']):.0f} s, "
        f"losing {float(best['waste_pct']):.3f} % of the time, "
        f"{float(best['gpu_hours_lost_per_day']):.1f} GPU-hours a day: "
        f"{float(best['checkpoint_pct']):.3f} % stalls, {float(best['drag_pct']):.3f} % drag of "
        f"the background write, {float(best['rework_pct']):.3f} % rework and "
        f"{float(best['restore_pct']):.3f} % restores; the storage is busy with these "
        f"checkpoints {float(best['storage_duty_pct']):.1f} % of the time"
    )
    table = _overheads(run)
    slow = by_name.get("torch-save")
    if slow is not None:
        saved = float(slow["gpu_hours_lost_per_day"]) - float(best["gpu_hours_lost_per_day"])
        text += f"; torch-save every {float(slow['interval_s']):.0f} s loses {float(slow['waste_pct']):.3f} %"
        shown = table_order(table.get(run.focus), table.get("torch-save"))
        if shown == (0 if saved == 0 else -1 if saved > 0 else 1):
            text += f", {abs(saved):.1f} GPU-hours a day {'more' if saved >= 0 else 'less'}"
        else:  # a conclusion says only what its own table shows
            text += (
                f", but the measured overheads ({_overhead(run.row)} against "
                f"{_overhead(run.rows['torch-save'])}) "
                f"{'do not differ measurably' if shown == 0 else 'rank them the other way'}, "
                f"so this run does not say which of the two loses less"
            )
    if run.device == "cpu":
        text += (
            ". Costs measured on a CPU stand in for a GPU rank's only roughly: "
            "take the numbers as an illustration of the method"
        )
    return [text + ".", *compare_modes(advice, table)]
