"""The report's conclusions: every sentence computed from the numbers of one comparison,
naming its assumptions (the advisor's parameters) and saying when async loses and why."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._util import format_bytes

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["conclusions"]


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
    """``100.0 MB`` for a measured byte count; what it says when the count was not measured."""
    number = _num(nbytes)
    return format_bytes(number) if _finite(number) else "an unmeasured size"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _times(factor: float) -> str:
    return f"{factor:.1f}x" if factor < 100 else f"{factor:.0f}x"


def _interval(row: Mapping[str, Any]) -> tuple[float, float]:
    """A row's overhead interval ``(lo, hi)``; NaNs where it has none."""
    interval = row.get("overhead_ci_pct")
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        return _num(interval[0]), _num(interval[1])
    return math.nan, math.nan


def _overhead_phrase(row: Mapping[str, Any]) -> str:
    """``+12.3 % (95 % interval +8.0 to +16.6 %)``; where the interval contains 0, ``+1.5 %, no
    measurable difference (95 % interval -2.0 to +5.0 %)``: the estimate always, the words only
    beside an interval that contains 0."""
    from ..bench._internal import measurable

    lo, hi = _interval(row)
    span = (f"95 % interval {lo:+.1f} to {hi:+.1f} %" if _finite(lo) and _finite(hi)
            else "no interval")
    words = "" if measurable(row.get("overhead_ci_pct")) else ", no measurable difference"
    return f"{_num(row['overhead_pct']):+.1f} %{words} ({span})"


def _lower(row: Mapping[str, Any]) -> float:
    return _interval(row)[0]


def _upper(row: Mapping[str, Any]) -> float:
    return _interval(row)[1]


def conclusions(
    results: pd.DataFrame,
    floors: Mapping[str, Any],
    *,
    advice: pd.DataFrame | None = None,
    timeline: pd.DataFrame | None = None,
    published: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
    assumptions: Mapping[str, Any] | None = None,
    probe: pd.DataFrame | None = None,
    load: Mapping[str, Any] | None = None,
) -> list[str]:
    """Sentences stating what the measurements show, each computed from the numbers given.

    ``results`` has ``Comparison.results``' columns, ``floors`` the keys of ``Floors.to_dict()``,
    ``advice`` those of :func:`nbckpt.analysis.advise`, ``timeline`` those of
    ``Comparison.timeline`` (to split the stall into copy and wait), ``environment`` those of
    :func:`nbckpt.bench.environment` plus ``device``, ``assumptions`` the report's advisor
    parameters (``gpus``, ``mtbf_hours``, ``restore_s``, ``gpus_per_node``), ``probe`` the
    probe's ``to_pandas()`` table and ``load`` ``Comparison.load``. Partial rows (a stopped run)
    are left out. A sentence whose inputs were not measured is left out.
    """
    from ._reference import load_published

    reference = dict(published) if published is not None else load_published()
    anchors = reference["anchors"]
    env = dict(environment or {})
    device = str(env.get("device", "cpu"))
    records: list[dict[str, Any]] = [
        {str(key): value for key, value in record.items()}
        for record in results.to_dict(orient="records")
    ]
    partial = [str(r["strategy"]) for r in records if bool(r.get("partial", False))]
    rows = {str(r["strategy"]): r for r in records if not bool(r.get("partial", False))}
    lines: list[str] = []
    if partial:
        lines.append(f"Left out of these conclusions because their runs were stopped before the "
                     f"end (partial): {', '.join(partial)}.")
    focus = next((name for name in ("nbckpt-async", "nbckpt-async-overlap") if name in rows), None)
    if focus is None:
        return [*lines, "No asynchronous nbckpt strategy was measured to the end, so there is "
                "nothing to conclude about asynchronous checkpointing; add nbckpt-async to the "
                "strategies."]
    row = rows[focus]
    stall = float(row["stall_mean_s"])
    torch_save = rows.get("torch-save")
    size = _size(floors.get("bytes"))

    text = (f"{focus}'s stall (the time the training loop was blocked) was {_ms(stall)} per "
            f"checkpoint of {size}{_parts(row)} (p95 {_ms(float(row['stall_p95_s']))})")
    if torch_save is not None and _finite(torch_save["stall_mean_s"]) and stall > 0:
        reduction = float(torch_save["stall_mean_s"]) / stall
        if reduction >= 1:
            text += f", {_times(reduction)} less than torch-save's ({_ms(torch_save['stall_mean_s'])})"
        else:
            text += (f", {_times(1 / reduction)} more than torch-save's "
                     f"({_ms(torch_save['stall_mean_s'])}): here the synchronous write was "
                     f"cheaper than the asynchronous stall")
    lines.append(text + ".")
    floor_line = _copy_floor_sentence(row, focus, floors=floors, timeline=timeline)
    if floor_line:
        lines.append(floor_line)

    lines.extend(_write_sentences(rows, focus, floors=floors, probe=probe, load=load))
    lines.extend(_overhead_sentences(rows, focus, env=env, device=device))
    lines.extend(_published_sentences(rows, focus, anchors=anchors, size=size, device=device))

    overlap = rows.get("nbckpt-async-overlap")
    if focus == "nbckpt-async" and overlap is not None and _finite(overlap["stall_mean_s"]):
        lines.append(
            f"With overlap=True the save returns before the copy and the loop waits only "
            f"before its next optimizer update: {_ms(float(overlap['stall_mean_s']))} of stall per "
            f"checkpoint, and an overhead of {_overhead_phrase(overlap)}; the copy still runs on "
            f"this machine's cores, so overlap hides the wait, not the work."
        )

    if advice is not None and not advice.empty:
        lines.extend(_advice_sentences(advice, focus, assumptions=assumptions, device=device,
                                       anchors=anchors))
    return lines


def _write_sentences(rows: Mapping[str, Mapping[str, Any]], focus: str, *, floors: Mapping[str, Any],
                     probe: pd.DataFrame | None, load: Mapping[str, Any] | None) -> list[str]:
    """The background write against the floor, and the floor against the probe."""
    lines: list[str] = []
    row = rows[focus]
    floor = _num(floors.get("write_gbs"))
    streams = floors.get("write_streams", 1)
    rounds = [_num(v) for v in floors.get("write_gbs_rounds") or [] if _finite(v)]
    if _finite(row.get("write_gbs")) and floor > 0:
        lines.append(
            f"Its background writes ran at {float(row['write_gbs']):.2f} GB/s, "
            f"{100 * float(row['write_gbs']) / floor:.0f}% of the raw fsync'd write floor of the "
            f"target ({floor:.2f} GB/s, {streams} stream(s), best of {len(rounds) or 1} rounds), "
            f"taking {_ms(float(row['persist_s']))} per checkpoint while training went on."
        )
    if floor > 0:
        above = [(name, _num(r.get("write_gbs"))) for name, r in rows.items()
                 if _finite(r.get("write_gbs")) and _num(r.get("write_gbs")) > floor]
        if above:
            spread = (f"its rounds ranged {min(rounds):.2f}-{max(rounds):.2f} GB/s" if rounds
                      else "it was measured once")
            loads = ""
            if load is not None and isinstance(load.get("floors"), Mapping):
                loads = (f"; other processes used {_num(load['floors'].get('other_cpu_cores')):.2f} "
                         f"cores while the floor was measured and "
                         f"{_num(load.get('other_cpu_cores')):.2f} on average over the runs")
            names = ", ".join(f"{name} ({gbs:.2f} GB/s)" for name, gbs in above)
            lines.append(
                f"Above the floor, which is a measurement problem, not a result: {names}. Both "
                f"the floor and these writes end with fsync, so the page cache alone does not "
                f"explain it; the floor is the fastest of its rounds measured before each repeat "
                f"({spread}{loads}), and a short write can finish inside the device's or the "
                f"hypervisor's write-back cache (a burst), so on this machine rates within about "
                f"{_spread_pct(rounds):.0f} % of each other are not different."
            )
    if probe is not None and not probe.empty and {"streams", "write_gbs"} <= set(probe.columns) \
            and floor > 0:
        by_streams = {int(s): _num(g) for s, g in zip(probe["streams"], probe["write_gbs"], strict=True)}
        floor_by = {int(k): _num(v) for k, v in (floors.get("write_gbs_by_streams") or {}).items()}
        shared = sorted(set(by_streams) & set(floor_by))
        if shared:
            pairs = "; ".join(f"{k} stream(s): probe {by_streams[k]:.2f}, floor {floor_by[k]:.2f} GB/s"
                              for k in shared)
            size = _size(probe["bytes"].iloc[0] if "bytes" in probe.columns else None)
            lines.append(
                f"The storage probe and the write floor measure the same way (files written by "
                f"parallel threads in 4 MiB writes, each ended by fsync, fastest round counts); "
                f"the probe wrote {size} per stream count, the floor "
                f"{_size(floors.get('sample_bytes'))}, at different moments: {pairs}. "
                f"The floor is the one the strategies are measured against."
            )
    return lines


def _measured_drag(row: Mapping[str, Any]) -> bool:
    """A drag whose interval lies above 0 (older results without an interval: a positive one)."""
    from ..bench._internal import measurable

    interval = row.get("drag_ci_s")
    if isinstance(interval, (list, tuple)) and len(interval) == 2:
        return measurable(interval) and _num(interval[0]) > 0
    return _num(row.get("drag_s")) > 0


def _spread_pct(rounds: list[float]) -> float:
    if len(rounds) < 2 or min(rounds) <= 0:
        return 10.0
    return max(10.0, 100.0 * (max(rounds) / min(rounds) - 1.0))


def _overhead_sentences(rows: Mapping[str, Mapping[str, Any]], focus: str, *,
                        env: Mapping[str, Any], device: str) -> list[str]:
    """Overhead with its interval, and on CPU runs when and why async loses."""
    lines: list[str] = []
    row = rows[focus]
    if not _finite(row.get("overhead_pct")):
        return lines
    method = str(row.get("overhead_method", ""))
    names = [name for name in ("torch-save", "nbckpt-sync", "dcp-sync") if name in rows
             and _finite(rows[name].get("overhead_pct"))]
    text = (f"Overhead against training without checkpoints (the none run of the same repeat): "
            f"with {focus} {_overhead_phrase(row)}")
    for name in names:
        text += f", with {name} {_overhead_phrase(rows[name])}"
    lines.append(text + f"; {method}, overhead as defined under the table.")
    sync = [rows[name] for name in names]
    losing = [r for r in sync if _lower(row) > _upper(r)]
    cpus = _num(env.get("cpus"))
    threads = _num(env.get("torch_threads"))
    if device == "cpu" and losing:
        other = losing[0]
        drag, cpu = _num(row.get("drag_s")), _num(row.get("cpu_per_checkpoint_s"))
        text = (f"On this CPU run {focus} cost measurably more than {other['strategy']}: its "
                f"background write runs on the same {cpus:.0f} cores as training "
                f"({threads:.0f} torch thread(s) for training)")
        if _finite(cpu):
            text += f", takes about {cpu:.2f} CPU seconds per checkpoint from them"
        if _finite(drag) and _measured_drag(row):
            text += f" and slowed the steps by {_ms(drag)} per checkpoint beyond its stall"
        text += (". A GPU node trains on the GPU and leaves its host cores to the write; "
                 "`--threads 1` (report parameter torch_threads = 1) leaves a core free here to "
                 "imitate that")
        if _finite(threads) and _finite(cpus) and threads < cpus:
            text += (f", and this run already left {cpus - threads:.0f} core(s) free, so the "
                     f"write still competed with training for memory bandwidth or the other work "
                     f"on this machine")
        lines.append(text + ".")
    elif device == "cpu" and sync and all(_upper(row) < _lower(r) for r in sync):
        lines.append(
            f"On this CPU run {focus} cost measurably less than "
            f"{' and '.join(str(r['strategy']) for r in sync)}, with {threads:.0f} torch thread(s) "
            f"for training on {cpus:.0f} cores: the background write found room beside training."
        )
    return lines


def _published_sentences(rows: Mapping[str, Mapping[str, Any]], focus: str, *,
                         anchors: Mapping[str, Any], size: str, device: str) -> list[str]:
    """Measured figures beside published ones that compare the same thing, each labelled."""
    lines: list[str] = []
    ibm = anchors.get("pytorch_ibm_7b")
    dcp_sync = rows.get("dcp-sync")
    if ibm is not None and dcp_sync is not None and _num(dcp_sync.get("stall_mean_s")) > 0:
        values = ibm["values"]
        base = float(dcp_sync["stall_mean_s"])
        measured = [
            f"{name} {_ms(float(rows[name]['stall_mean_s']))} "
            f"({_times(base / float(rows[name]['stall_mean_s']))} less)"
            for name in ("dcp-async", "dcp-async-stager", focus)
            if name in rows and _num(rows[name].get("stall_mean_s")) > 0
        ]
        if measured:
            lines.append(
                f"Like for like with PyTorch/IBM's figure (synchronous DCP against async_save, "
                f"{values['sync_downtime']['value']} s to {values['async_downtime']['value']} s, "
                f"{values['reduction_factor']['value']}x, for a 7B model on GPUs), this run "
                f"measured dcp-sync at {_ms(base)} per checkpoint against {', '.join(measured)}, "
                f"on {size} on {device}: the published figure comes from multi-GB "
                f"states on GPUs, where the synchronous write dominates more than here."
            )
    else:
        lines.append("No published figure compares against torch.save; run dcp-sync and "
                     "dcp-async to set this run beside PyTorch/IBM's sync-against-async DCP figure.")
    pure = anchors.get("pure_storage_flashblade")
    torch_save = rows.get("torch-save")
    if pure is not None and torch_save is not None:
        from ..bench._internal import measurable

        quote = pure.get("quote", "")
        mine, theirs = _num(rows[focus].get("overhead_pct")), _num(torch_save.get("overhead_pct"))
        text = (f"Pure Storage's post says that with async checkpointing on FlashBlade checkpoint "
                f"overhead drops significantly, \"{quote}\", with no model, GPU count or "
                f"baseline given")
        if measurable(torch_save.get("overhead_ci_pct")) and theirs > 0 and _finite(mine):
            if measurable(rows[focus].get("overhead_ci_pct")):
                text += (f"; here {focus}'s overhead was {100.0 * (1.0 - mine / theirs):.0f} % "
                         f"lower than torch-save's ({mine:+.1f} % against {theirs:+.1f} %)")
            else:
                text += (f"; here torch-save's overhead was {theirs:+.1f} % and {focus}'s not "
                         f"measurably different from zero")
        lines.append(text + ".")
    byte = anchors.get("bytecheckpoint")
    if byte is not None:
        factor = byte["values"]["reduction_factor"]["value"]
        lines.append(f"ByteCheckpoint's {factor}x fewer stalls is against other open-source "
                     f"checkpointing systems, not async against sync of one system, so it has no "
                     f"counterpart in this run.")
    return lines


def _advice_sentences(advice: pd.DataFrame, focus: str, *, assumptions: Mapping[str, Any] | None,
                      device: str, anchors: Mapping[str, Any]) -> list[str]:
    """The advisor's numbers with every assumption they rest on named."""
    from ._interval import compare_modes

    by_name = {str(r["strategy"]): r for r in advice.to_dict(orient="records")}
    best = by_name.get(focus)
    if best is None:
        return []
    given = dict(advice.attrs)
    given.update(assumptions or {})
    gpus = int(given.get("gpus", 0))
    mtbf = _num(given.get("mtbf_hours"))
    per_node = int(given.get("gpus_per_node", 8))
    restore = _num(given.get("restore_s", best.get("restore_s", 0.0)))
    llama = anchors.get("llama3_interruptions")
    source = ""
    if llama is not None:
        values = llama["values"]
        source = (f"; Llama 3's report gives {values['unexpected_interruptions']['value']} "
                  f"interruptions in {values['days']['value']} days on "
                  f"{values['gpus']['value']:,} GPUs, about 6,335 h per 8-GPU node")
    text = (
        f"Assuming a job of {gpus:,} GPUs ({per_node} per node) with a node MTBF of {mtbf:g} h "
        f"and {restore:g} s to restore after a failure (report parameters gpus, mtbf_hours, "
        f"restore_s{source}), and taking the costs measured here on {device} as one rank's, the "
        f"advisor puts a {focus} checkpoint every {float(best['interval_s']):.0f} s "
        f"(job MTBF {float(best['cluster_mtbf_h']):.1f} h), losing {float(best['waste_pct']):.3f} % "
        f"of the time, {float(best['gpu_hours_lost_per_day']):.1f} GPU-hours a day: "
        f"{float(best['checkpoint_pct']):.3f} % stalls, {float(best['drag_pct']):.3f} % drag of "
        f"the background write, {float(best['rework_pct']):.3f} % rework and "
        f"{float(best['restore_pct']):.3f} % restores; the storage is busy with these "
        f"checkpoints {float(best['storage_duty_pct']):.1f} % of the time"
    )
    slow = by_name.get("torch-save")
    if slow is not None:
        saved = float(slow["gpu_hours_lost_per_day"]) - float(best["gpu_hours_lost_per_day"])
        text += (f"; torch-save every {float(slow['interval_s']):.0f} s loses "
                 f"{float(slow['waste_pct']):.3f} %, {abs(saved):.1f} GPU-hours a day "
                 f"{'more' if saved >= 0 else 'less'}")
    if device == "cpu":
        text += (". Costs measured on a CPU stand in for a GPU rank's only roughly: "
                 "take the numbers as an illustration of the method")
    return [text + ".", *compare_modes(advice)]


def _parts(row: Mapping[str, Any]) -> str:
    """`` (save stall 3.0 ms + wait for the earlier save 130.0 ms)`` where a wait was measured."""
    save, wait = _num(row.get("save_stall_s")), _num(row.get("wait_s"))
    if not (_finite(save) and _finite(wait)) or wait <= 0:
        return ""
    return f" (save stall {_ms(save)} + wait for the earlier save {_ms(wait)})"


def _copy_floor_sentence(row: Mapping[str, Any], focus: str, *, floors: Mapping[str, Any],
                         timeline: pd.DataFrame | None) -> str:
    """The save stall against the copy floor: a stall below the floor is a measurement problem,
    never praise; an overlapped copy runs behind the loop and has no such bound."""
    copy_s = _num(floors.get("copy_s"))
    save = _num(row.get("save_stall_s", row.get("stall_mean_s")))
    if not (copy_s > 0 and save > 0) or focus.endswith("-overlap"):
        return ""
    ratio = save / copy_s
    floor = f"the copy floor ({_ms(copy_s)} to copy the same bytes into preallocated memory)"
    if ratio < 1:
        return (f"Its save stall, {_ms(save)}, is {_times(ratio)} {floor}: below what the hardware "
                f"allows, which is a measurement problem (the floor and the runs met different "
                f"moments of a shared machine; the floor is the fastest of its rounds before "
                f"each repeat), not a result.")
    text = f"Its save stall is {_times(ratio)} {floor}"
    if ratio <= 1.5:
        return text + ": save() takes little more than the copy itself."
    stage = _stage_time(timeline, focus, _num(row.get("checkpoints")) * _num(row.get("repeats", 1)))
    if stage is None:
        return text + "."
    return (text + f". Per checkpoint the copy into the staging buffers took {_ms(stage)}; the "
            f"other {_ms(max(save - stage, 0.0))} of the save stall was spent elsewhere in save().")


def _stage_time(timeline: pd.DataFrame | None, strategy: str, checkpoints: float) -> float | None:
    """Mean staging (copy) seconds per checkpoint of ``strategy`` (None: unknown)."""
    if timeline is None or timeline.empty or not checkpoints > 0:
        return None
    events = timeline[timeline["strategy"] == strategy] if "strategy" in timeline else timeline
    stage = events.loc[events["kind"] == "stage", "duration_s"]
    if stage.empty:
        return None
    return float(stage.sum()) / checkpoints
