"""The checkpoint lab: pick a target, a workload and strategies, run them, watch the timeline grow.

    >>> from nbckpt.notebook import Lab
    >>> lab = Lab(directory="data/checkpoints/lab", preset="tiny", steps=20, every=5)
    >>> lab                       # in a notebook: the controls, a live timeline, the results
    >>> lab.run(); lab.wait()     # or click Run; lab.comparison holds the Comparison

One Lab is live per kernel. Creating another (re-running the cell, or ``%ckpt_bench``) stops
the previous one's run, waits for its saves in flight to commit (so its directory is free
again), closes its widgets and says so in one line; :meth:`Lab.close` does the same by hand.

The experiment (or probe) runs in a worker thread. Worker threads never touch a widget: they
put events, results and log lines on a queue, and one updater thread applies them every
``refresh_s`` seconds (the timeline in one ``batch_update``), so the notebook stays responsive
and the browser gets a few updates per second, not one per event.
"""

from __future__ import annotations

import functools
import html
import json
import os
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import check_count, is_url
from ..engine import Event

if TYPE_CHECKING:
    import argparse

    import plotly.graph_objects as go

    from ..bench import Comparison

__all__ = ["LOG_LINES", "SYNTHETIC", "TABLE_COLUMNS", "Lab", "StrategyChoice", "check_target",
           "devices", "live_lab"]

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Columns of :func:`nbckpt.bench.format_results` the results table shows, with headers.
TABLE_COLUMNS = {
    "strategy": "strategy", "repeats": "repeats", "checkpoints": "checkpoints",
    "overhead": "overhead", "overhead_95ci": "95 % interval", "mean_step_s": "mean step s",
    "stall_mean_s": "stall s", "stall_p95_s": "stall p95 s", "drag_s": "drag s",
    "persist_s": "persist s", "write_gbs": "write GB/s", "reduction_vs_torch_save": "vs torch-save",
}
#: Log lines the lab keeps (the oldest are dropped).
LOG_LINES = 500
# A quick probe: enough to see the write rate and the stream count that helps.
_PROBE_MB = 32.0
_PROBE_STREAMS = (1, 2, 4)

_live_lock = threading.Lock()
_live: Lab | None = None
# Closed labs whose run may still be ending (a Ctrl-C cut close() short): a new run waits for
# them, since they may still hold the directory it is about to lock.
_closing: list[Lab] = []


def live_lab() -> Lab | None:
    """The kernel's live Lab (the newest one created and not closed), or None."""
    return _live


def _make_live(lab: Lab | None) -> None:
    """Make ``lab`` the live Lab; close the previous one and say so in one line."""
    global _live
    with _live_lock:
        previous, _live = _live, lab
    if previous is None or previous is lab:
        return
    was_running = previous.running
    previous.close()
    if was_running:
        print("nbckpt: stopped the previous lab's run (its saves in flight committed) and "
              "closed it")
    else:
        print("nbckpt: closed the previous lab")


def devices() -> list[str]:
    """Devices a run can use here: cpu, and cuda when torch sees one."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def check_target(path: str) -> None:
    """Raise ConfigError when ``path`` obviously cannot hold checkpoints (URLs are not checked).

    Nothing is created: a lab that is only validated leaves no directory behind.
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


def _box(kind: str, text: str, *, pre: bool = False) -> str:
    colours = {"error": ("#cf222e", "#ffebe9"), "ok": ("#1a7f37", "#dafbe1"),
               "info": ("#0969da", "#ddf4ff")}
    fg, bg = colours[kind]
    body = f"<pre style='margin:0'>{html.escape(text)}</pre>" if pre else html.escape(text)
    return (
        f'<div class="nbckpt-{kind}" style="color:{fg};background:{bg};border:1px solid {fg};'
        f'border-radius:4px;padding:4px 8px;margin:2px 0">{body}</div>'
    )


def _message(exc: BaseException) -> str:
    """One line for an error that ended a run."""
    if isinstance(exc, ConfigError):
        text = f"Cannot run: {exc}"
    elif isinstance(exc, CheckpointError):
        text = f"Checkpoint failed: {exc}"
    elif isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        text = f"Storage error: {exc.strerror or exc}{where}"
    else:
        text = f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"
    return " ".join(text.split())


def _table(results: pd.DataFrame, device: str, notes: Sequence[str]) -> str:
    """The results as an HTML table: numbers right-aligned in tabular figures, notes under it."""
    from ..bench import format_results

    shown = format_results(results, device)
    columns = [c for c in TABLE_COLUMNS if c in shown.columns]
    cell = "padding:2px 8px;white-space:nowrap;text-align:{}"
    align = {c: "left" if c == "strategy" else "right" for c in columns}
    head = "".join(f'<th style="{cell.format(align[c])}">{html.escape(TABLE_COLUMNS[c])}</th>'
                   for c in columns)
    rows = "".join(
        "<tr>" + "".join(f'<td style="{cell.format(align[c])}">{html.escape(str(row[c]))}</td>'
                         for c in columns) + "</tr>"
        for row in shown.to_dict(orient="records")
    )
    notes_html = "".join(f'<div style="font-size:11px;line-height:1.4;margin-top:4px;'
                         f'color:#57606a;max-width:1000px">{html.escape(note)}</div>'
                         for note in notes)
    return (
        '<table class="nbckpt-results" style="border-collapse:collapse;'
        f'font-variant-numeric:tabular-nums"><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table>{notes_html}"
    )


def _log_html(lines: Sequence[str]) -> str:
    # column-reverse keeps the box scrolled to its end: the newest line stays in view.
    return (
        '<div class="nbckpt-log" style="display:flex;flex-direction:column-reverse;'
        'max-height:160px;overflow:auto;border:1px solid #ddd;padding:2px 6px">'
        # flex:none: a <pre> that may shrink would scroll itself, from its top
        f'<pre style="margin:0;font-size:12px;flex:none">{html.escape("".join(lines))}</pre></div>'
    )


# Plotly's widget registers the listeners of each view on the model it got in initialize(),
# so they outlive the view: once a cell's output is cleared (the cell runs again), every later
# update of the figure calls Plotly on a purged <div>, and ipywidgets logs "Error setting
# state: gd.data must be an array" for each. This wrapper hands plotly, while it renders, the
# view's own model, whose listeners anywidget removes with the view. And plotly measures its
# <div> once, when it draws it, usually before the notebook has laid it out (it then falls back
# to 700 px): a responsive chart measures again on a window resize, sent here when the width
# of the <div> changes.
_SCOPED_ESM = """\
const source = __PLOTLY_ESM__;
const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
const plotly = await import(url);
URL.revokeObjectURL(url);

export default () => {
  const base = typeof plotly.default === "function" ? plotly.default() : plotly.default;
  let rendering = null;
  return {
    initialize(context) {
      const model = context.model;
      const routed = {
        ...model,
        on: (name, callback) => (rendering ?? model).on(name, callback),
        off: (name, callback) => (rendering ?? model).off(name, callback),
      };
      return base.initialize?.({ ...context, model: routed });
    },
    render(context) {
      rendering = context.model;
      let cleanup;
      try {
        cleanup = base.render(context);
      } finally {
        rendering = null;
      }
      let width = 0;
      const observer = new ResizeObserver((entries) => {
        const now = Math.round(entries[entries.length - 1].contentRect.width);
        if (now > 0 && now !== width) {
          width = now;
          window.dispatchEvent(new Event("resize"));
        }
      });
      observer.observe(context.el);
      return () => {
        observer.disconnect();
        return typeof cleanup === "function" ? cleanup() : undefined;
      };
    },
  };
};
"""


@functools.cache
def _live_figure_class() -> type[go.FigureWidget]:
    """``go.FigureWidget`` whose views forget their listeners when they are removed."""
    import plotly.graph_objects as go

    esm = _SCOPED_ESM.replace("__PLOTLY_ESM__", json.dumps(str(go.FigureWidget._esm)))
    return type("LiveFigure", (go.FigureWidget,), {"_esm": esm, "__module__": __name__})


def _widgets_of(root: widgets.Widget) -> Iterator[widgets.Widget]:
    """``root``, its children and their layouts and styles (each one a comm of its own)."""
    yield root
    for name in ("layout", "style"):
        part = getattr(root, name, None)
        if isinstance(part, widgets.Widget):
            yield part
    for child in getattr(root, "children", ()):
        if isinstance(child, widgets.Widget):
            yield from _widgets_of(child)


class StrategyChoice:
    """A checkbox per strategy; ``value`` is the tuple of ticked ones, in the offered order."""

    def __init__(self, options: Sequence[str], value: Sequence[str]) -> None:
        self.options = tuple(options)
        self.boxes = {
            name: widgets.Checkbox(value=name in value, description=name, indent=False,
                                   layout=widgets.Layout(width="190px"))
            for name in self.options
        }
        self.widget = widgets.VBox([
            widgets.HTML("<b>strategies</b> <span style='color:#57606a'>(none, the baseline, "
                         "always runs)</span>"),
            widgets.GridBox(list(self.boxes.values()),
                            layout=widgets.Layout(grid_template_columns="repeat(2, 190px)")),
        ])

    @property
    def value(self) -> tuple[str, ...]:
        return tuple(name for name, box in self.boxes.items() if box.value)

    @value.setter
    def value(self, names: Sequence[str]) -> None:
        unknown = [name for name in names if name not in self.boxes]
        if unknown:
            raise ConfigError(f"unknown strategy {unknown[0]!r}; choose from {', '.join(self.options)}")
        for name, box in self.boxes.items():
            box.value = name in names

    @property
    def disabled(self) -> bool:
        return all(box.disabled for box in self.boxes.values())

    @disabled.setter
    def disabled(self, disabled: bool) -> None:
        for box in self.boxes.values():
            box.disabled = disabled


@dataclass(frozen=True)
class _Settings:
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


class Lab:
    """Interactive checkpoint lab: controls, progress, live timeline, results table and log.

    Every control is a public attribute (``path``, ``probe_button``, ``preset``, ``size_mb``,
    ``device``, ``strategies``, ``steps``, ``every``, ``repeats``, ``run_button``,
    ``stop_button``) so code and tests can set them and ``click()`` the buttons; :meth:`run`,
    :meth:`stop`, :meth:`probe`, :meth:`wait` and :meth:`close` do the same from Python.
    """

    def __init__(
        self,
        directory: str = "data/checkpoints/lab",
        preset: str = "tiny",
        strategies: Sequence[str] = ("torch-save", "nbckpt-async"),
        steps: int = 20,
        every: int = 5,
        device: str = "cpu",
        size_mb: float = 64.0,
        repeats: int | None = None,
        refresh_s: float = 0.25,
        *,
        compute_ms: float = 5.0,
        warmup: bool = True,
        json_path: str | None = None,
    ) -> None:
        """``repeats`` defaults to :data:`nbckpt.bench.DEFAULT_REPEATS`; ``compute_ms``
        (synthetic workload), ``warmup`` and ``json_path`` are ``nbckpt bench``'s options."""
        _make_live(None)  # first: a bad argument below must not leave the old run going unseen
        from ..bench import DEFAULT_REPEATS, PRESETS, STRATEGIES
        from ._figures import timeline_figure

        choices = {"preset": ([preset], [*PRESETS, SYNTHETIC]),
                   "strategy": (list(strategies), list(STRATEGIES)), "device": ([device], devices())}
        for what, (given, allowed) in choices.items():
            unknown = [value for value in given if value not in allowed]
            if unknown:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        self.refresh_s = refresh_s
        self.compute_ms = compute_ms
        self.warmup = warmup
        self.json_path = json_path
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
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
        self.figure = _live_figure_class()(
            timeline_figure(pd.DataFrame(columns=["kind", "start_s", "end_s"]))
        )
        self.figure.update_layout(title="Timeline (live): each strategy's latest run")
        self.figure._config = {**self.figure._config, "responsive": True}
        self._empty_height = self.figure.layout.height
        self.results = widgets.HTML()
        self.log = widgets.HTML(_log_html(()))
        self.widget = widgets.VBox([
            widgets.HBox([self.path, self.probe_button]),
            self.probe_summary,
            widgets.HBox([widgets.VBox([self.preset, self.size_mb, self.device, self.steps,
                                        self.every, self.repeats]), self.strategies.widget]),
            widgets.HBox([self.run_button, self.stop_button, self.progress]),
            self.message,
            self.figure,
            self.results,
            self.log,
        ])
        self.widget.add_class("nbckpt-lab")
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.probe_button.on_click(lambda _: self.probe())
        self.preset.observe(self._on_preset, names="value")
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._job = ""
        self._settings: _Settings | None = None
        self._origins: dict[str, int] = {}
        self._live_rows: dict[str, list[dict[str, Any]]] = {}
        self._finished: set[str] = set()  # strategies whose run ended: their next events restart
        self._results: dict[str, dict[str, Any]] = {}
        self._runs_done = 0
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
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
        if self.closed:
            return {"text/plain": "<closed nbckpt Lab: a newer one replaced it>"}
        return self.widget._repr_mimebundle_(**kwargs)

    # -- state --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """A run or probe is going on (or its last updates are being applied)."""
        return any(thread.is_alive() for thread in self._threads)

    @property
    def closed(self) -> bool:
        """Closed by :meth:`close` (or replaced by a newer Lab): it runs nothing any more."""
        return self._closed.is_set()

    def _on_preset(self, change: dict[str, Any]) -> None:
        self.size_mb.disabled = change["new"] != SYNTHETIC

    def _set_busy(self, busy: bool) -> None:
        for control in (self.run_button, self.probe_button, self.path, self.preset, self.size_mb,
                        self.device, self.strategies, self.steps, self.every, self.repeats):
            control.disabled = busy
        if not busy:
            self.size_mb.disabled = self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    def validate(self) -> list[str]:
        """The strategies to run; raises ConfigError (one line) for the first bad field."""
        return list(self._read_settings().names)

    def _read_settings(self) -> _Settings:
        check_target(self.path.value)
        steps = check_count(self.steps.value, "steps")
        every = check_count(self.every.value, "checkpoint interval (every)", maximum=steps)
        repeats = check_count(self.repeats.value, "repeats")
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        synthetic = self.preset.value == SYNTHETIC
        if synthetic and not self.size_mb.value > 0:
            raise ConfigError(f"size must be positive, not {self.size_mb.value}")
        return _Settings(
            directory=self.path.value, names=self.strategies.value, steps=steps, every=every,
            repeats=repeats, preset=None if synthetic else self.preset.value,
            size_mb=self.size_mb.value if synthetic else None, device=self.device.value,
        )

    # -- actions ------------------------------------------------------------------------------

    def run(self) -> bool:
        """Validate the fields and start the comparison in the background; False if it did not
        start (the reason is in ``lab.error`` and the lab's message line)."""
        with self._lock:
            if self.closed:
                self.error = "this lab is closed (a newer one replaced it): use the new one"
                return False
            if self.running:
                self.message.value = _box("info", "A run is already in progress; Stop it first.")
                return False
            try:
                settings = self._read_settings()
            except ConfigError as exc:
                self.error = " ".join(str(exc).split())
                self.message.value = _box("error", self.error)
                return False
            with _live_lock:
                closing = list(_closing)
            for old in closing:
                old.wait()
            self._reset(settings)
            names = ", ".join(settings.names)
            baseline = "" if "none" in settings.names else " and none (the baseline)"
            self.message.value = _box(
                "info", f"Running {names}{baseline}: {settings.repeats} repeat(s) ..."
            )
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
                self.probe_summary.value = _box("error", str(exc))
                return False
            self.probe_summary.value = _box("info", f"Probing {target} ...")
            self._start("probe", lambda: self._probe(target))
        return True

    def stop(self) -> None:
        """End the run after the current step; saves in flight still commit (none half-written)."""
        if self.running and not self._stop.is_set():
            self._stop.set()
            self._post("log", "stop requested: finishing the current step and saves in flight")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run (or probe) and its last update are done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.running

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
            for widget in [*_widgets_of(self.widget), self.figure]:
                widget.close()

    # -- worker side (never touches a widget) -------------------------------------------------

    def _post(self, kind: str, item: Any) -> None:
        self._queue.put((kind, item))

    def _start(self, name: str, job: Callable[[], None]) -> None:
        self._job = name
        self._stop.clear()
        self._queue = queue.Queue()
        self._set_busy(True)

        def work() -> None:
            try:
                job()
            except BaseException as exc:
                if not isinstance(exc, NbckptError | OSError):  # expected ones need no traceback
                    self._post("log", traceback.format_exc())
                self._post("error", exc)
            finally:
                self._post("finished", None)

        worker = threading.Thread(target=work, name="nbckpt-lab-worker", daemon=True)
        updater = threading.Thread(target=self._update_loop, args=(self._queue,),
                                   name="nbckpt-lab-updater", daemon=True)
        self._threads = [worker, updater]
        updater.start()
        worker.start()

    def _experiment(self, settings: _Settings) -> None:
        from ..bench import compare, make_workload

        workload = make_workload(settings.preset, settings.size_mb, settings.device,
                                 compute_ms=self.compute_ms)
        comparison = compare(
            workload, list(settings.names), settings.directory, steps=settings.steps,
            every=settings.every, device=settings.device, repeats=settings.repeats,
            warmup=self.warmup,
            on_event=lambda event: self._post("event", event),
            on_result=lambda name, metrics: self._post("result", (name, metrics)),
            stop=self._stop,
            progress=lambda line: self._post("log", line),
        )
        if self.json_path is not None:
            comparison.to_json(self.json_path)
            self._post("log", f"results written to {self.json_path}")
        self.stopped = self._stop.is_set()
        self.comparison = comparison
        self._post("done", comparison)

    def _probe(self, target: str) -> None:
        from ..bench import probe

        if not is_url(target):
            os.makedirs(target, exist_ok=True)  # the lab writes there anyway
        result = probe(target, size_mb=_PROBE_MB, streams=_PROBE_STREAMS)
        self._post("probe", result.summary())

    # -- updater side (the only thread that changes widgets while a job runs) -----------------

    def _update_loop(self, source: queue.Queue[tuple[str, Any]]) -> None:
        finished = False
        while not finished:
            batch: list[tuple[str, Any]] = []
            deadline = time.monotonic() + self.refresh_s
            while not finished:
                try:
                    kind, item = source.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                finished = kind == "finished"
                batch.append((kind, item))
            if self.closed:
                continue  # drain the queue; the widgets may be gone from the page
            try:
                self._apply(batch)
            except Exception:
                self.log_lines.append(traceback.format_exc())
                self.log.value = _log_html(self.log_lines)
        if not self.closed:
            self._set_busy(False)

    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """Apply a batch in the order it was posted (events of a new run follow its result)."""
        events: list[Event] = []
        logs = len(self.log_lines)
        table = False
        for kind, item in batch:
            if kind != "event" and events:
                self._extend_timeline(events)
                events = []
            if kind == "event":
                events.append(item)
            elif kind == "result":
                name, metrics = item
                self._results[name] = {"strategy": name, **metrics}
                self._finished.add(name)
                self._runs_done += 1
                table = True
            elif kind == "log":
                self.log_lines.append(item if item.endswith("\n") else item + "\n")
                logs = -1
            elif kind == "done":
                table = False
                self._show_comparison(item)
            elif kind == "probe":
                self.probe_summary.value = _box("ok", item, pre=True)
            elif kind == "error":
                self._show_error(item)
        if events:
            self._extend_timeline(events)
        if table and self._settings is not None:
            heading = (f"<b>Results so far</b>: each strategy's latest run, after "
                       f"{self._runs_done} of {self._settings.runs} runs; overhead comes at the end")
            rows = pd.DataFrame(list(self._results.values()))
            self.results.value = heading + _table(rows, self._settings.device, ())
        if logs != len(self.log_lines):
            self.log.value = _log_html(self.log_lines)

    def _reset(self, settings: _Settings) -> None:
        """A clean slate for a run: no timeline rows or lanes, results, error or log."""
        self._settings = settings
        self.error = None
        self.stopped = False
        self.comparison = None
        self._origins.clear()
        self._live_rows.clear()
        self._finished.clear()
        self._results.clear()
        self._runs_done = 0
        self._redraw(None)
        self.results.value = ""
        if "nbckpt-error" in self.probe_summary.value:
            self.probe_summary.value = ""
        self.log_lines.clear()
        self.log.value = _log_html(())
        self.progress.value = 0
        self.progress.max = settings.steps * settings.runs
        self.progress.bar_style = ""

    def _redraw(self, timeline: pd.DataFrame | None) -> None:
        """Replace the figure's bars and lanes with ``timeline`` (None: an empty figure)."""
        from ._figures import extend_timeline

        # Not one batch_update: inside one, reads return the values from before it, and
        # extend_timeline reads the lanes it adds to.
        self.figure.data = ()
        self.figure.update_layout(yaxis_categoryarray=(), height=self._empty_height)
        if timeline is not None and len(timeline):
            extend_timeline(self.figure, timeline, by_rank=False)

    def _extend_timeline(self, events: list[Event]) -> None:
        from ._figures import extend_timeline

        rows = []
        restarted = False
        for event in events:
            label = event.label
            if label in self._finished:  # a new run of this strategy: show it from its start
                self._finished.discard(label)
                self._live_rows[label] = []
                self._origins.pop(label, None)
                restarted = True
            origin = self._origins.setdefault(label, event.start_ns)
            row = {
                "strategy": label, "kind": event.kind, "step": event.step,
                "start_s": (event.start_ns - origin) / 1e9, "end_s": (event.end_ns - origin) / 1e9,
                "bytes": event.bytes,
            }
            self._live_rows.setdefault(label, []).append(row)
            rows.append(row)
        if restarted:
            self._redraw(pd.DataFrame([r for group in self._live_rows.values() for r in group]))
        else:
            extend_timeline(self.figure, pd.DataFrame(rows), by_rank=False)
        self.progress.value = min(
            self.progress.max, self.progress.value + sum(e.kind == "step" for e in events)
        )

    def _show_comparison(self, comparison: Comparison) -> None:
        from ..bench import OVERHEAD_DEFINITION
        from ._figures import select_repeat

        # the exact timeline of each strategy's last repeat, lanes in the table's order
        order = {name: i for i, name in enumerate(comparison.results["strategy"])}
        timeline = select_repeat(comparison.timeline)
        if len(timeline):
            timeline = timeline.sort_values("strategy", key=lambda s: s.map(order), kind="stable")
        self._redraw(timeline)
        self.figure.layout.title = "Timeline: each strategy's last repeat"
        self.results.value = "<b>Results</b>" + _table(
            comparison.results, comparison.device, [OVERHEAD_DEFINITION, *comparison.warnings]
        )
        done = int(comparison.timeline["kind"].eq("step").sum()) if len(comparison.timeline) else 0
        strategies = len(comparison.results)
        if self.stopped:
            self.message.value = _box("info", f"Stopped after {done} training steps; every "
                                              "checkpoint written so far is committed.")
            self.progress.bar_style = "warning"
        else:
            self.message.value = _box("ok", f"Done: {done} training steps, {strategies} "
                                            f"strategies x {comparison.repeats} repeat(s).")
            self.progress.value = self.progress.max
            self.progress.bar_style = "success"

    def _show_error(self, exc: BaseException) -> None:
        self.error = _message(exc)
        if self._job == "probe":  # a probe's error belongs next to the probe
            self.probe_summary.value = _box("error", self.error)
            return
        self.message.value = _box("error", self.error)
        self.progress.bar_style = "danger"
