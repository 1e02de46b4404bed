"""The checkpoint lab: pick a target, a workload and strategies, run them, watch the timeline grow.

    >>> from nbckpt.notebook import Lab
    >>> lab = Lab(directory="data/checkpoints/lab", preset="tiny", steps=20, every=5)
    >>> lab                       # in a notebook: the controls, a live timeline, the results
    >>> lab.run(); lab.wait()     # or click Run; lab.comparison holds the Comparison

One Lab is live per kernel: creating another (re-running the cell, ``%ckpt_bench``) stops the
previous one's run, waits for its saves in flight to commit, closes it and says so in one line.
The run (or probe) goes on in a worker thread that never touches a widget: it queues events,
results and log lines, and one updater thread applies them every ``refresh_s`` seconds. Kernel >
Interrupt stops a run as Stop does; a closed lab's output becomes a static note with its results.

One job, the widget (its controls, the kernel's one live Lab, and how updates show: a live
timeline that restarts a strategy's lanes for its next repeat, the results table, the log).
Running a job, Stop and Kernel > Interrupt are :mod:`._lab_run`'s.
"""

from __future__ import annotations

import html
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from .._errors import ConfigError
from .._util import check_count
from ..engine import Event
from ._lab_run import LabRun, Settings, check_target, error_line, route_interrupts
from ._live_figure import live_figure
from ._timeline_figures import events_frame, extend_timeline, select_repeat, timeline_figure
from ._widget_parts import close_widgets, notice

if TYPE_CHECKING:
    import argparse

    from ..bench import Comparison

__all__ = ["Lab", "live_lab"]

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Columns of ``format_results`` the results table shows, as keys of ``SHOWN_COLUMNS`` (the
#: headers of every other nbckpt table); the text ones align left, the numbers right.
_COLUMNS = ("strategy", "repeats", "checkpoints", "overhead", "overhead_95ci", "per_repeat",
            "rests_on", "mean_step_s", "stall_mean_s", "save_stall_s", "wait_s", "stall_p95_s",
            "drag", "persist_s", "write_gbs", "reduction_vs_torch_save", "floor_check")
_TEXT_COLUMNS = ("strategy", "rests_on", "floor_check")

_live_lock = threading.Lock()
_live: Lab | None = None
# Closed labs whose run may still be ending (a Ctrl-C cut close() short): a new run waits for
# them, since they may still hold the directory it is about to lock.
_closing: list[Lab] = []


def live_lab() -> Lab | None:
    """The kernel's live Lab (the newest one created and not closed), or None."""
    return _live


def devices() -> list[str]:
    """Devices a run can use here: cpu, and cuda when torch sees one."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _results_html(results: pd.DataFrame, device: str, notes: Sequence[str], *,
                  method: bool = False) -> str:
    """The results as an HTML table (numbers right-aligned in tabular figures), the notes under
    it and, with ``method``, how overhead and its interval are computed (folded)."""
    from ..bench import OVERHEAD_METHOD, SHOWN_COLUMNS, format_results

    shown = format_results(results, device)
    columns = [SHOWN_COLUMNS[key] for key in _COLUMNS if SHOWN_COLUMNS[key] in shown.columns]
    style = {c: "padding:2px 8px;white-space:nowrap;text-align:"
             + ("left" if c in {SHOWN_COLUMNS[key] for key in _TEXT_COLUMNS} else "right") for c in columns}
    head = "".join(f'<th style="{style[c]}">{html.escape(c)}</th>' for c in columns)
    rows = "".join("<tr>" + "".join(f'<td style="{style[c]}">{html.escape(str(row[c]))}</td>'
                                    for c in columns) + "</tr>" for row in shown.to_dict("records"))
    note = "font-size:11px;line-height:1.4;margin-top:4px;color:#57606a;max-width:1000px"
    notes_html = "".join(f'<div style="{note}">{html.escape(text)}</div>' for text in notes)
    if method:
        notes_html += (f'<details class="nbckpt-method" style="{note}"><summary>How overhead and its '
                       f'interval are computed</summary><pre style="white-space:pre-wrap">'
                       f"{html.escape(OVERHEAD_METHOD.strip())}</pre></details>")
    return ('<table class="nbckpt-results" style="border-collapse:collapse;font-variant-numeric:'
            f'tabular-nums"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{notes_html}')


def _log_html(lines: Sequence[str]) -> str:
    # column-reverse keeps the box scrolled to its end, the newest line in view; flex:none: a
    # <pre> that may shrink would scroll itself, from its top
    return ('<div class="nbckpt-log" style="display:flex;flex-direction:column-reverse;'
            'max-height:160px;overflow:auto;border:1px solid #ddd;padding:2px 6px"><pre style="'
            f'margin:0;font-size:12px;flex:none">{html.escape("".join(lines))}</pre></div>')

def _make_live(lab: Lab | None) -> None:
    """Make ``lab`` the live Lab; close the previous one and say so in one line."""
    global _live
    with _live_lock:
        previous, _live = _live, lab
    if previous is None or previous is lab:
        return
    was_running = previous.running
    previous.close()
    print("nbckpt: stopped the previous lab's run (its saves in flight committed) and closed it"
          if was_running else "nbckpt: closed the previous lab")


class Lab(LabRun):
    """Interactive checkpoint lab: controls, progress, live timeline, results table and log.

    Every control is a public widget (``path``, ``probe_button``, ``preset``, ``size_mb``,
    ``device``, ``strategies``, ``steps``, ``every``, ``repeats``, ``run_button``,
    ``stop_button``); ``widget`` is the whole lab, ``figure`` its timeline. Code and tests set
    the controls and ``click()`` the buttons; :meth:`run`, :meth:`stop`, :meth:`probe`,
    :meth:`wait` and :meth:`close` do the same from Python. Only the main thread (between runs)
    and the updater thread change the widgets.
    """

    def __init__(self, directory: str = "data/checkpoints/lab", *, preset: str = "tiny",
                 strategies: Sequence[str] = ("torch-save", "nbckpt-async"), steps: int = 20,
                 every: int = 5, device: str = "cpu", size_mb: float = 64.0, repeats: int | None = None,
                 refresh_s: float = 0.25, compute_ms: float = 5.0, warmup: bool = True,
                 json_path: str | None = None) -> None:
        """``repeats`` defaults to :data:`nbckpt.bench.DEFAULT_REPEATS`; ``compute_ms``
        (synthetic workload), ``warmup`` and ``json_path`` are ``nbckpt bench``'s options."""
        from ..bench._internal import DEFAULT_REPEATS, PRESETS, STRATEGIES

        _make_live(None)  # first: a bad argument below must not leave the old run going unseen
        choices = {"preset": ([preset], [*PRESETS, SYNTHETIC]), "device": ([device], devices()),
                   "strategy": (list(strategies), list(STRATEGIES))}
        for what, (given, allowed) in choices.items():
            if unknown := [value for value in given if value not in allowed]:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        super().__init__(refresh_s=refresh_s, compute_ms=compute_ms, warmup=warmup, json_path=json_path)
        named = {"style": {"description_width": "90px"}}
        self.path = widgets.Text(directory, description="target", layout={"width": "420px"}, **named)
        self.probe_button = widgets.Button(description="Probe", icon="tachometer",
                                           tooltip="measure the target's write bandwidth")
        self.preset = widgets.Dropdown(options=[*PRESETS, SYNTHETIC], value=preset, description="workload",
                                       **named)
        self.size_mb = widgets.BoundedFloatText(size_mb, min=0.001, max=1e7, step=16, description="size MiB",
                                                disabled=preset != SYNTHETIC, **named)
        self.device = widgets.Dropdown(options=devices(), value=device, description="device", **named)
        self.strategies = widgets.SelectMultiple(
            options=list(STRATEGIES), value=tuple(strategies), rows=len(STRATEGIES), description="strategies",
            tooltip="Ctrl- or Shift-click for several; none, the baseline, always runs", **named)
        self.steps = widgets.IntText(steps, description="steps", **named)
        self.every = widgets.IntText(every, description="every", tooltip="checkpoint every K steps", **named)
        self.repeats = widgets.IntText(DEFAULT_REPEATS if repeats is None else repeats, description="repeats",
                                       tooltip="each repeat runs every strategy once, interleaved", **named)
        self.run_button = widgets.Button(description="Run", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          disabled=True)
        self.progress = widgets.IntProgress(0, min=0, max=1, description="progress", **named)
        self.probe_summary, self.message, self.results = widgets.HTML(), widgets.HTML(), widgets.HTML()
        self.log = widgets.HTML(_log_html(()))
        self.figure = live_figure(timeline_figure(pd.DataFrame(columns=["kind", "start_s", "end_s"])))
        self.figure.update_layout(title="Timeline (live): each strategy's latest run")
        self.figure._config = {**self.figure._config, "responsive": True}
        self._empty_height = self.figure.layout.height
        self.widget = widgets.VBox([
            widgets.HBox([self.path, self.probe_button]), self.probe_summary,
            widgets.HBox([widgets.VBox([self.preset, self.size_mb, self.device, self.steps,
                                        self.every, self.repeats]), self.strategies]),
            widgets.HBox([self.run_button, self.stop_button, self.progress]),
            self.message, self.figure, self.results, self.log,
        ])
        self.widget.add_class("nbckpt-lab")
        self.preset.observe(lambda change: setattr(self.size_mb, "disabled", change["new"] != SYNTHETIC),
                            names="value")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.probe_button.on_click(lambda _: self.probe())
        self._displays: list[Any] = []  # IPython DisplayHandles of the outputs showing it
        _make_live(self)  # closes one that another thread created meanwhile

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Lab:
        """A lab set up from ``nbckpt bench`` options (what ``%ckpt_bench`` shows)."""
        names = [name.strip() for name in args.strategies.split(",") if name.strip()]
        synthetic = args.size_mb is not None
        if synthetic and args.preset is not None:
            raise ConfigError("give --preset or --size-mb, not both")
        return cls(directory=args.dir, preset=SYNTHETIC if synthetic else args.preset or "tiny",
                   strategies=names, steps=args.steps, every=args.every, device=args.device,
                   repeats=args.repeats, compute_ms=args.compute_ms, warmup=not args.no_warmup,
                   json_path=args.json, **({"size_mb": args.size_mb} if synthetic else {}))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._closed_bundle() if self.closed else self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        """Shown under a display id, so that :meth:`close` can put a static note in its place:
        a view of a closed widget would read "Error displaying widget: model not found" once the
        page is reloaded."""
        from IPython.display import display

        handle = display(self._repr_mimebundle_(), raw=True, display_id=not self.closed)  # type: ignore[no-untyped-call]
        if handle is not None:
            self._displays.append(handle)

    def _closed_bundle(self) -> dict[str, str]:
        text = "closed nbckpt Lab (replaced by a newer one, or closed): lab.comparison keeps its results"
        return {"text/plain": f"<{text}>", "text/html": notice("info", text) + self.results.value}


    # -- actions ------------------------------------------------------------------------------

    def run(self) -> bool:
        """Validate the fields and start the comparison in the background; False if it did not
        start (the reason is in ``lab.error`` and the lab's message line)."""
        with self._lock:
            if self.closed:
                self.error = "this lab is closed (a newer one replaced it): use the new one"
                return False
            if self.running:
                self.message.value = notice("info", "A run is already in progress; Stop it first.")
                return False
            try:
                settings = self._read_settings()
            except ConfigError as exc:
                self.error = " ".join(str(exc).split())
                self.message.value = notice("error", self.error)
                return False
            with _live_lock:
                closing = list(_closing)
            for old in closing:
                old.wait()
            self._reset(settings)
            baseline = "" if "none" in settings.names else " and none (the baseline)"
            self.message.value = notice("info", f"Running {', '.join(settings.names)}{baseline}: "
                                                f"{settings.repeats} repeat(s) ...")
            route_interrupts(self._note_interrupt)  # Kernel > Interrupt stops it, as Stop does
            self._start("run", lambda: self._experiment(settings))
        return True

    def probe(self) -> bool:
        """Measure the target's write bandwidth in the background; False if the path is bad."""
        with self._lock:
            if self.closed or self.running:
                return False
            target = self.path.value
            try:
                check_target(target)
            except ConfigError as exc:
                self.probe_summary.value = notice("error", str(exc))
                return False
            self.probe_summary.value = notice("info", f"Probing {target} ...")
            self._start("probe", lambda: self._probe(target))
        return True

    def show(self, comparison: Comparison) -> None:
        """Show a comparison measured before, here or elsewhere (``Comparison.from_json`` of a
        ``nbckpt bench --json`` file): its timeline, results and notes, as after a run."""
        with self._lock:
            if self.closed or self.running:
                raise ConfigError("this lab is closed or running: show it in a new lab, or wait")
            self.error, self.stopped, self.interrupted, self.comparison = None, False, False, comparison
            self._show_comparison(comparison)


    def close(self) -> None:
        """Stop the run, wait until its saves in flight have committed and its directory is
        free, and close the widgets. A closed lab runs nothing; create a new one."""
        global _live
        with _live_lock:
            if _live is self:
                _live = None
            if self not in _closing:
                _closing.append(self)
        self._closed.set()  # from here on the updater leaves the widgets alone
        self._stop.set()
        try:
            self.wait()
            with _live_lock:
                if self in _closing:
                    _closing.remove(self)
        finally:
            for handle in self._displays:  # first: no view of a closed model is ever drawn
                handle.update(self._closed_bundle(), raw=True)
            self._displays.clear()
            close_widgets(self.widget, self.figure)

    # -- main thread, between runs --------------------------------------------------------------

    def _read_settings(self) -> Settings:
        check_target(self.path.value)
        steps = check_count(self.steps.value, "steps")
        every = check_count(self.every.value, "checkpoint interval (every)", maximum=steps)
        repeats = check_count(self.repeats.value, "repeats")
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        synthetic = self.preset.value == SYNTHETIC
        if synthetic and not self.size_mb.value > 0:
            raise ConfigError(f"size must be positive, not {self.size_mb.value}")
        return Settings(directory=self.path.value, names=tuple(self.strategies.value), steps=steps,
                        every=every, repeats=repeats, preset=None if synthetic else self.preset.value,
                        size_mb=self.size_mb.value if synthetic else None, device=self.device.value)

    def _reset(self, settings: Settings) -> None:
        """No timeline rows or lanes, results, error or log: a clean slate for a run."""
        self._begin(settings)
        self._redraw(None)
        self.results.value = ""
        if "nbckpt-error" in self.probe_summary.value:
            self.probe_summary.value = ""
        self._show_log()
        self.progress.value, self.progress.bar_style = 0, ""
        self.progress.max = settings.steps * settings.runs

    def _set_busy(self, busy: bool) -> None:
        for control in (self.run_button, self.probe_button, self.path, self.preset, self.size_mb,
                        self.device, self.strategies, self.steps, self.every, self.repeats):
            control.disabled = busy
        self.size_mb.disabled = busy or self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """Apply a batch in the order it was posted (events of a new run follow its result)."""
        events: list[Event] = []
        logs, table = len(self.log_lines), False
        for kind, item in batch:
            if kind != "event" and events:
                self._show_events(events)
                events = []
            if kind == "event":
                events.append(item)
            elif kind == "result":  # a strategy's run ended: its next events start its lanes again
                self._results[item[0]] = {"strategy": item[0], **item[1]}
                self._finished.add(item[0])
                self._runs_done += 1
                table = True
            elif kind == "log":
                self.log_lines.append(item if item.endswith("\n") else item + "\n")
                logs = -1  # at its length limit the log's length does not change
            elif kind == "done":
                table = False
                self._show_comparison(item)
            elif kind == "probe":
                self.probe_summary.value = notice("ok", item, pre=True)
            elif kind == "error":
                self.error = error_line(item)
                if self._job == "probe":  # a probe's error belongs next to the probe
                    self.probe_summary.value = notice("error", self.error)
                else:
                    self.message.value = notice("error", self.error)
                    self.progress.bar_style = "danger"
        if events:
            self._show_events(events)
        if table and self._settings is not None:
            from ..bench import STALL_DEFINITION

            table_html = _results_html(pd.DataFrame(list(self._results.values())), self._settings.device,
                                       [STALL_DEFINITION])
            self.results.value = (f"<b>Results so far</b>: each strategy's latest run, after "
                                  f"{self._runs_done} of {self._settings.runs} runs; overhead comes at "
                                  f"the end{table_html}")
        if logs != len(self.log_lines):
            self._show_log()

    def _show_log(self) -> None:
        self.log.value = _log_html(self.log_lines)

    def _redraw(self, timeline: pd.DataFrame | None) -> None:
        """Replace the timeline's bars and lanes with ``timeline`` (None: an empty figure)."""
        # Not one batch_update: inside one, reads return the values from before it, and
        # extend_timeline reads the lanes it adds to.
        self.figure.data = ()
        self.figure.update_layout(yaxis_categoryarray=(), height=self._empty_height)
        if timeline is not None and len(timeline):
            extend_timeline(self.figure, timeline, by_rank=False)

    def _show_events(self, events: list[Event]) -> None:
        by_strategy: dict[str, list[Event]] = {}
        for event in events:
            by_strategy.setdefault(event.label, []).append(event)
        restarted, frames = False, []
        for name, group in by_strategy.items():
            if name in self._finished:  # a new run of this strategy: show it from its start
                self._finished.discard(name)
                del self._lanes[name]
                restarted = True
            origin, rows = self._lanes.setdefault(name, (group[0].start_ns, []))
            rows.append(events_frame(group, origin))
            frames.append(rows[-1])
        if restarted:
            self._redraw(pd.concat([f for _, rows in self._lanes.values() for f in rows], ignore_index=True))
        else:
            extend_timeline(self.figure, pd.concat(frames, ignore_index=True), by_rank=False)
        steps = sum(event.kind == "step" for event in events)
        self.progress.value = min(self.progress.max, self.progress.value + steps)

    def _show_comparison(self, comparison: Comparison) -> None:
        from ..bench import OVERHEAD_DEFINITION, STALL_DEFINITION

        # the exact timeline of each strategy's last repeat, lanes in the table's order
        order = {name: i for i, name in enumerate(comparison.results["strategy"])}
        timeline = select_repeat(comparison.timeline)
        if len(timeline):
            timeline = timeline.sort_values("strategy", key=lambda s: s.map(order), kind="stable")
        self._redraw(timeline)
        self.figure.layout.title = "Timeline: each strategy's last repeat"
        self.results.value = "<b>Results</b>" + _results_html(
            comparison.results, comparison.device,
            [OVERHEAD_DEFINITION, STALL_DEFINITION, comparison.floors.describe(), *comparison.warnings],
            method=True)
        done = int(comparison.timeline["kind"].eq("step").sum()) if len(comparison.timeline) else 0
        if self.stopped:
            how = "Interrupted (Kernel > Interrupt)" if self.interrupted else "Stopped"
            self.message.value = notice("info", f"{how} after {done} training steps; every "
                                                "checkpoint written so far is committed.")
            self.progress.bar_style = "warning"
        else:
            self.message.value = notice("ok", f"Done: {done} training steps, {len(comparison.results)}"
                                              f" strategies x {comparison.repeats} repeat(s).")
            self.progress.value, self.progress.bar_style = self.progress.max, "success"
