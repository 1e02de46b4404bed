"""What ``nbckpt report`` says before it measures: how long the report will take, how busy the
machine is, and, when the time is over the budget or the load would make the intervals mean
little, a shorter run (fewer repeats, then fewer steps), said in one line; ``--full`` insists.

A loaded machine (load 6-15 on 2 cores) made the report run past 10 minutes while its progress
lines said 16.9 and its warning came at the end: the user learns it now, before any of it runs.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._util import format_duration

__all__ = ["Plan", "notebook_defaults", "plan_report"]

#: The small preset (25.2M parameters, 303 MB checkpoints): 12 steps of 8 strategies in 3
#: repeats took about 5 minutes on 2 quiet cores (the Makefile's ``make report``), floors included:
#: seconds per step of one strategy's run; other sizes scale by their parameters.
_S_PER_SMALL_RUN_STEP = 300.0 / (12 * 8 * 3)
_BYTES_PER_PARAM = 12  # fp32 weights and Adam's two moments: what a checkpoint holds
_MIN_REPEATS = 2  # the overhead interval needs two


@dataclass(frozen=True)
class Plan:
    """The parameters to run with, and the lines to say first."""

    parameters: dict[str, Any]
    lines: list[str]


def notebook_defaults(source: Path) -> dict[str, Any]:
    """The report notebook's parameters as its first cell sets them (values papermill shows as text)."""
    import papermill

    defaults: dict[str, Any] = {}
    for name, info in papermill.inspect_notebook(str(source)).items():
        try:
            defaults[name] = ast.literal_eval(str(info.get("default")))
        except (ValueError, SyntaxError):
            defaults[name] = info.get("default")
    return defaults


def _mparams(settings: Mapping[str, Any]) -> float:
    """Millions of parameters the run trains (a synthetic state: its size as if it were a model's)."""
    from ..bench._internal import PRESETS

    size_mb = settings.get("size_mb")
    if isinstance(size_mb, (int, float)) and size_mb > 0:
        return float(size_mb) * 2**20 / _BYTES_PER_PARAM / 1e6
    config = PRESETS[str(settings.get("preset"))] if settings.get("preset") in PRESETS else PRESETS["small"]
    return (12 * config.n_layer * config.d_model**2 + config.vocab * config.d_model) / 1e6


def _minutes(settings: Mapping[str, Any], slowdown: float) -> float:
    strategies = len([s for s in str(settings.get("strategies", "")).split(",") if s.strip()]) or 1
    run_steps = int(settings["steps"]) * int(settings["repeats"]) * strategies
    scale = _mparams(settings) / _mparams({"preset": "small"})
    return run_steps * scale * _S_PER_SMALL_RUN_STEP * slowdown / 60


def _shorter(settings: dict[str, Any], slowdown: float, max_minutes: float, busy: bool) -> dict[str, Any]:
    """Fewer repeats (not under two), then fewer steps (whole checkpoints, at least two), until
    the estimate fits ``max_minutes``; on a busy machine the least of both."""
    every = int(settings["every"])
    short = dict(settings)
    short["repeats"] = min(int(settings["repeats"]), _MIN_REPEATS)
    floor = min(int(settings["steps"]), 2 * every)
    if busy:
        short["steps"] = floor
        return short
    while short["steps"] > floor and _minutes(short, slowdown) > max_minutes:
        short["steps"] = max(floor, short["steps"] - every)
    return short


def plan_report(
    given: Mapping[str, Any],
    defaults: Mapping[str, Any],
    *,
    load_1m: float,
    cores: int,
    max_minutes: float,
    full: bool,
) -> Plan:
    """The parameters to run (``given`` over the notebook's ``defaults``) and what to say first.

    The estimate scales the quiet machine's time by the share of the cores the measurement
    gets: ``(load + 1) / cores`` once the others' load reaches the cores. Other processes that
    keep every core busy (a load at least the cores) widen the intervals until they mean little.
    """
    settings = {**defaults, **given}
    if not all(isinstance(settings.get(k), int) for k in ("steps", "every", "repeats")):
        return Plan(dict(given), [])  # a notebook without these: nothing to estimate
    slowdown = max(1.0, (load_1m + 1) / max(cores, 1))
    minutes = _minutes(settings, slowdown)
    busy = load_1m >= cores
    lines = [
        f"report: about {format_duration(minutes * 60)} ({settings['repeats']} repeats of "
        f"{settings['steps']} steps); 1-minute load {load_1m:.1f} on {cores} cores"
    ]
    if busy:
        lines.append(
            "report: other processes keep every core busy: the intervals will be too wide to "
            "mean much; run it when the machine is quieter"
        )
    if full or not (busy or minutes > max_minutes):
        return Plan(dict(given), lines)
    short = _shorter(settings, slowdown, max_minutes, busy)
    if (short["repeats"], short["steps"]) == (settings["repeats"], settings["steps"]):
        return Plan(dict(given), lines)
    why = "the machine is busy" if busy else f"over the {max_minutes:g} min budget"
    lines.append(
        f"report: shortened to {short['repeats']} repeats of {short['steps']} steps (about "
        f"{format_duration(_minutes(short, slowdown) * 60)}; {why}); --full runs as asked, Ctrl-C stops"
    )
    return Plan({**given, "repeats": short["repeats"], "steps": short["steps"]}, lines)
