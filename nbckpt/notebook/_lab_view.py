"""What the lab shows: its controls and layout, the settings read from them, progress, the live
timeline, results, errors and the log.

Only the main thread (between runs) and the lab's updater thread change these widgets.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from .._errors import ConfigError
from .._util import check_count, is_url
from ..engine import Event
from ._lab_timeline import LabTimeline
from ._lab_widgets import StrategyChoice, error_line, log_html, notice, results_table
from ._timeline_figures import select_repeat

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from ..bench import Comparison

__all__ = ["LOG_LINES", "SYNTHETIC", "LabView", "RunSettings", "check_target", "devices"]

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Log lines the lab keeps (the oldest are dropped).
LOG_LINES = 500


def devices() -> list[str]:
    """Devices a run can use here: cpu, and cuda when torch sees one."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def check_target(path: str) -> None:
    """Raise ConfigError when ``path`` obviously cannot hold checkpoints (URLs are not checked).

    Unlike ``_util.writable_directory`` nothing is created: a lab that is only validated leaves
    no directory behind.
    """
    if not path.strip():
        raise ConfigError("the target path is empty")
    if is_url(path):
        return
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"target {path} is not usable: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"target {path} is not writable ({existing} is read-only for this user)")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What one run uses, read from the controls once (workers never read a widget)."""

    directory: str
    names: tuple[str, ...]
    steps: int
    every: int
    repeats: int
    preset: str | None
    size_mb: float | None
    device: str

    @property
    def runs(self) -> int:
        return (len(self.names) + ("none" not in self.names)) * self.repeats


class LabView:
    """The lab's widgets. Every control is a public attribute (``path``, ``probe_button``,
    ``preset``, ``size_mb``, ``device``, ``strategies``, ``steps``, ``every``, ``repeats``,
    ``run_button``, ``stop_button``); ``widget`` is the whole lab."""

    def __init__(
        self,
        *,
        directory: str,
        preset: str,
        strategies: Sequence[str],
        steps: int,
        every: int,
        device: str,
        size_mb: float,
        repeats: int | None,
    ) -> None:
        from ..bench._internal import DEFAULT_REPEATS, PRESETS, STRATEGIES

        choices = {"preset": ([preset], [*PRESETS, SYNTHETIC]),
                   "strategy": (list(strategies), list(STRATEGIES)), "device": ([device], devices())}
        for what, (given, allowed) in choices.items():
            unknown = [value for value in given if value not in allowed]
            if unknown:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
        self.interrupted = False  # stopped by Kernel > Interrupt (SIGINT), not by Stop
        self.log_lines: deque[str] = deque(maxlen=LOG_LINES)
        style = {"description_width": "90px"}
        self.path = widgets.Text(value=directory, description="target", style=style,
                                 layout=widgets.Layout(width="420px"))
        self.probe_button = widgets.Button(description="Probe", icon="tachometer",
                                           tooltip="measure the target's write bandwidth")
        self.probe_summary = widgets.HTML()
        self.preset = widgets.Dropdown(options=[*PRESETS, SYNTHETIC], value=preset,
                                       description="workload", style=style)
        self.size_mb = widgets.BoundedFloatText(value=size_mb, min=0.001, max=1e7, step=16,
                                                description="size MiB", style=style,
                                                disabled=preset != SYNTHETIC)
        self.device = widgets.Dropdown(options=devices(), value=device, description="device",
                                       style=style)
        self.strategies = StrategyChoice(list(STRATEGIES), strategies)
        self.steps = widgets.IntText(value=steps, description="steps", style=style)
        self.every = widgets.IntText(value=every, description="every", style=style,
                                     tooltip="checkpoint every K steps")
        self.repeats = widgets.IntText(value=DEFAULT_REPEATS if repeats is None else repeats,
                                       description="repeats", style=style,
                                       tooltip="each repeat runs every strategy once, interleaved")
        self.run_button = widgets.Button(description="Run", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          disabled=True)
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress",
                                            style=style)
        self.message = widgets.HTML()
        self._timeline = LabTimeline()
        self.results = widgets.HTML()
        self.log = widgets.HTML(log_html(()))
        self.widget = widgets.VBox([
            widgets.HBox([self.path, self.probe_button]),
            self.probe_summary,
            widgets.HBox([widgets.VBox([self.preset, self.size_mb, self.device, self.steps,
                                        self.every, self.repeats]), self.strategies.widget]),
            widgets.HBox([self.run_button, self.stop_button, self.progress]),
            self.message,
            self._timeline.figure,
            self.results,
            self.log,
        ])
        self.widget.add_class("nbckpt-lab")
        self.preset.observe(self._on_preset, names="value")
        self._settings: RunSettings | None = None
        self._results: dict[str, dict[str, Any]] = {}  # each strategy's latest run
        self._runs_done = 0

    @property
    def figure(self) -> go.FigureWidget:
        """The live timeline."""
        return self._timeline.figure

    def validate(self) -> list[str]:
        """The strategies to run; raises ConfigError (one line) for the first bad field."""
        return list(self._read_settings().names)

    def _on_preset(self, change: dict[str, Any]) -> None:
        self.size_mb.disabled = change["new"] != SYNTHETIC

    def _set_busy(self, busy: bool) -> None:
        for control in (self.run_button, self.probe_button, self.path, self.preset, self.size_mb,
                        self.device, self.strategies, self.steps, self.every, self.repeats):
            control.disabled = busy
        if not busy:
            self.size_mb.disabled = self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    def _read_settings(self) -> RunSettings:
        check_target(self.path.value)
        steps = check_count(self.steps.value, "steps")
        every = check_count(self.every.value, "checkpoint interval (every)", maximum=steps)
        repeats = check_count(self.repeats.value, "repeats")
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        synthetic = self.preset.value == SYNTHETIC
        if synthetic and not self.size_mb.value > 0:
            raise ConfigError(f"size must be positive, not {self.size_mb.value}")
        return RunSettings(
            directory=self.path.value, names=self.strategies.value, steps=steps, every=every,
            repeats=repeats, preset=None if synthetic else self.preset.value,
            size_mb=self.size_mb.value if synthetic else None, device=self.device.value,
        )

    def _reset(self, settings: RunSettings) -> None:
        """A clean slate for a run: no timeline rows or lanes, results, error or log."""
        self._settings = settings
        self.error = None
        self.stopped = False
        self.interrupted = False
        self.comparison = None
        self._timeline.clear()
        self._results.clear()
        self._runs_done = 0
        self.results.value = ""
        if "nbckpt-error" in self.probe_summary.value:
            self.probe_summary.value = ""
        self.log_lines.clear()
        self.log.value = log_html(())
        self.progress.value = 0
        self.progress.max = settings.steps * settings.runs
        self.progress.bar_style = ""

    def _show_events(self, events: list[Event]) -> None:
        self._timeline.extend(events)
        self.progress.value = min(
            self.progress.max, self.progress.value + sum(e.kind == "step" for e in events)
        )

    def _add_result(self, name: str, metrics: dict[str, Any]) -> None:
        """One strategy's run ended (its next events start its lanes again)."""
        self._results[name] = {"strategy": name, **metrics}
        self._timeline.finish(name)
        self._runs_done += 1

    def _show_results_so_far(self) -> None:
        if self._settings is None:
            return
        from ..bench import STALL_DEFINITION

        heading = (f"<b>Results so far</b>: each strategy's latest run, after "
                   f"{self._runs_done} of {self._settings.runs} runs; overhead comes at the end")
        rows = pd.DataFrame(list(self._results.values()))
        self.results.value = heading + results_table(rows, self._settings.device, [STALL_DEFINITION])

    def _show_comparison(self, comparison: Comparison) -> None:
        from ..bench import OVERHEAD_DEFINITION, STALL_DEFINITION

        # the exact timeline of each strategy's last repeat, lanes in the table's order
        order = {name: i for i, name in enumerate(comparison.results["strategy"])}
        timeline = select_repeat(comparison.timeline)
        if len(timeline):
            timeline = timeline.sort_values("strategy", key=lambda s: s.map(order), kind="stable")
        self._timeline.redraw(timeline)
        self.figure.layout.title = "Timeline: each strategy's last repeat"
        self.results.value = "<b>Results</b>" + results_table(
            comparison.results, comparison.device,
            [OVERHEAD_DEFINITION, STALL_DEFINITION, comparison.floors.describe(),
             *comparison.warnings],
            method=True,
        )
        done = int(comparison.timeline["kind"].eq("step").sum()) if len(comparison.timeline) else 0
        strategies = len(comparison.results)
        if self.stopped:
            how = "Interrupted (Kernel > Interrupt)" if self.interrupted else "Stopped"
            self.message.value = notice("info", f"{how} after {done} training steps; every "
                                                "checkpoint written so far is committed.")
            self.progress.bar_style = "warning"
        else:
            self.message.value = notice("ok", f"Done: {done} training steps, {strategies} "
                                              f"strategies x {comparison.repeats} repeat(s).")
            self.progress.value = self.progress.max
            self.progress.bar_style = "success"

    def _show_error(self, exc: BaseException, *, probe: bool) -> None:
        self.error = error_line(exc)
        if probe:  # a probe's error belongs next to the probe
            self.probe_summary.value = notice("error", self.error)
            return
        self.message.value = notice("error", self.error)
        self.progress.bar_style = "danger"
