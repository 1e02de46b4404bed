"""The checkpoint lab: pick a target, a workload and strategies, run them, watch the timeline grow.

    >>> from nbckpt.widgets import Lab
    >>> lab = Lab(directory="data/checkpoints/lab", preset="tiny", steps=20, every=5)
    >>> lab                       # in a notebook: the controls, a live timeline, the results
    >>> lab.run(); lab.wait()     # or click Run; lab.comparison holds the Comparison

The experiment (or probe) runs in a worker thread. Worker threads never touch a widget: they
put events, results and log lines on a queue, and one updater thread applies them every
``refresh_s`` seconds (the timeline in one ``batch_update``), so the notebook stays responsive
and the browser gets a few updates per second, not one per event.
"""

from __future__ import annotations

import html
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from ._dcp import is_url
from ._errors import CheckpointError, ConfigError, NbckptError
from ._timeline import Event

if TYPE_CHECKING:
    import argparse

    from .experiment import Comparison

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Results columns the live table shows (all of them are in ``lab.comparison.results``).
TABLE_COLUMNS = [
    "strategy", "checkpoints", "mean_step_s", "stall_mean_s", "stall_p95_s", "overhead_pct",
    "persist_s", "write_gbs", "reduction_vs_torch_save",
]
# A quick probe: enough to see the write rate and the stream count that helps.
_PROBE_MB = 32.0
_PROBE_STREAMS = (1, 2, 4)


def devices() -> list[str]:
    """Devices a run can use here: cpu, and cuda when torch sees one."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def check_target(path: str) -> None:
    """Raise ConfigError when ``path`` obviously cannot hold checkpoints (URLs are not checked)."""
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
        return f"Cannot run: {exc}"
    if isinstance(exc, CheckpointError):
        return f"Checkpoint failed: {exc}"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"Storage error: {exc.strerror or exc}{where}"
    return f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"


@dataclass
class _Batch:
    """What the updater applies in one go."""

    events: list[Event] = field(default_factory=list)
    results: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    actions: list[Callable[[], None]] = field(default_factory=list)
    finished: bool = False


class Lab:
    """Interactive checkpoint lab: controls, progress, live timeline, results table and log.

    Every control is a public attribute (``path``, ``probe_button``, ``preset``, ``size_mb``,
    ``device``, ``strategies``, ``steps``, ``every``, ``run_button``, ``stop_button``) so code
    and tests can set them and ``click()`` the buttons; :meth:`run`, :meth:`stop`, :meth:`probe`
    and :meth:`wait` do the same from Python.
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
        refresh_s: float = 0.25,
    ) -> None:
        from .plots import timeline_figure
        from .strategies import STRATEGIES
        from .workloads import PRESETS

        choices = {"preset": ([preset], [*PRESETS, SYNTHETIC]),
                   "strategy": (list(strategies), list(STRATEGIES)), "device": ([device], devices())}
        for what, (given, allowed) in choices.items():
            unknown = [value for value in given if value not in allowed]
            if unknown:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        self.refresh_s = refresh_s
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
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
        self.strategies = widgets.SelectMultiple(options=list(STRATEGIES),
                                                 value=tuple(strategies), rows=len(STRATEGIES),
                                                 description="strategies", style=style)
        self.steps = widgets.IntText(value=steps, description="steps", style=style)
        self.every = widgets.IntText(value=every, description="every", style=style,
                                     tooltip="checkpoint every K steps")
        self.run_button = widgets.Button(description="Run", button_style="success", icon="play")
        self.stop_button = widgets.Button(description="Stop", button_style="danger", icon="stop",
                                          disabled=True)
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="progress",
                                            style=style)
        self.message = widgets.HTML()
        self.figure = timeline_figure(pd.DataFrame(columns=["kind", "start_s", "end_s"]),
                                      widget=True)
        self.figure.update_layout(title="Timeline (live)")
        self.results = widgets.HTML()
        self.log = widgets.Output(layout=widgets.Layout(max_height="160px", overflow="auto",
                                                        border="1px solid #ddd"))
        self.widget = widgets.VBox([
            widgets.HBox([self.path, self.probe_button]),
            self.probe_summary,
            widgets.HBox([widgets.VBox([self.preset, self.size_mb, self.device, self.steps,
                                        self.every]), self.strategies]),
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
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._job = ""
        self._origins: dict[str, int] = {}
        self._rows: list[dict[str, Any]] = []

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Lab:
        """A lab set up from ``nbckpt bench`` options (what ``%ckpt_bench`` shows)."""
        names = [name.strip() for name in args.strategies.split(",") if name.strip()]
        synthetic = args.size_mb is not None
        return cls(directory=args.dir, preset=SYNTHETIC if synthetic else args.preset or "tiny",
                   strategies=names, steps=args.steps, every=args.every, device=args.device,
                   **({"size_mb": args.size_mb} if synthetic else {}))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # -- state --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _on_preset(self, change: dict[str, Any]) -> None:
        self.size_mb.disabled = change["new"] != SYNTHETIC

    def _set_busy(self, busy: bool) -> None:
        for control in (self.run_button, self.probe_button, self.path, self.preset, self.size_mb,
                        self.device, self.strategies, self.steps, self.every):
            control.disabled = busy
        if not busy:
            self.size_mb.disabled = self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    def validate(self) -> list[str]:
        """The strategies to run; raises ConfigError (one line) for the first bad field."""
        check_target(self.path.value)
        if self.steps.value <= 0:
            raise ConfigError(f"steps must be a positive integer, not {self.steps.value}")
        if not 1 <= self.every.value <= self.steps.value:
            raise ConfigError(
                f"checkpoint interval must be between 1 and steps ({self.steps.value}), "
                f"not {self.every.value}"
            )
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        if self.preset.value == SYNTHETIC and not self.size_mb.value > 0:
            raise ConfigError(f"size must be positive, not {self.size_mb.value}")
        return list(self.strategies.value)

    # -- actions ------------------------------------------------------------------------------

    def run(self) -> bool:
        """Validate the fields and start the comparison in the background; False if invalid."""
        if self.running:
            self.message.value = _box("info", "A run is already in progress; Stop it first.")
            return False
        try:
            names = self.validate()
        except ConfigError as exc:
            self.error = str(exc)
            self.message.value = _box("error", str(exc))
            return False
        self.error = None
        self.stopped = False
        self.comparison = None
        self._origins.clear()
        self._rows.clear()
        self.figure.data = ()
        self.results.value = ""
        self.progress.value = 0
        self.progress.max = self.steps.value * len(names)
        self.progress.bar_style = ""
        self.message.value = _box("info", f"Running {', '.join(names)} ...")
        options = {
            "preset": None if self.preset.value == SYNTHETIC else self.preset.value,
            "size_mb": self.size_mb.value if self.preset.value == SYNTHETIC else None,
            "device": self.device.value,
        }
        self._start("run", lambda: self._experiment(names, options))
        return True

    def probe(self) -> bool:
        """Measure the target's write bandwidth in the background; False if the path is bad."""
        if self.running:
            return False
        try:
            check_target(self.path.value)
        except ConfigError as exc:
            self.probe_summary.value = _box("error", str(exc))
            return False
        self.probe_summary.value = _box("info", f"Probing {self.path.value} ...")
        self._start("probe", self._probe)
        return True

    def stop(self) -> None:
        """End the run after the current step; saves in flight still commit (none half-written)."""
        if self.running:
            self._stop.set()
            self._post("log", "stop requested: finishing the current step and saves in flight")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run (or probe) and its last update are done; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.running

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

    def _experiment(self, names: list[str], options: dict[str, Any]) -> None:
        from .experiment import compare
        from .workloads import make_workload

        workload = make_workload(**options)
        comparison = compare(
            workload, names, self.path.value, steps=self.steps.value, every=self.every.value,
            device=options["device"],
            on_event=lambda event: self._post("event", event),
            on_result=lambda name, metrics: self._post("result", (name, metrics)),
            stop=self._stop,
            progress=lambda line: self._post("log", line),
        )
        self._post("done", comparison)

    def _probe(self) -> None:
        from .storage import probe

        target = self.path.value
        if "://" not in target:
            os.makedirs(target, exist_ok=True)  # the lab writes there anyway
        result = probe(target, size_mb=_PROBE_MB, streams=_PROBE_STREAMS)
        self._post("probe", result.summary())

    # -- updater side (the only thread that changes widgets while a job runs) -----------------

    def _update_loop(self, source: queue.Queue[tuple[str, Any]]) -> None:
        finished = False
        while not finished:
            batch = _Batch()
            deadline = time.monotonic() + self.refresh_s
            while not batch.finished:
                try:
                    kind, item = source.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                self._collect(batch, kind, item)
            finished = batch.finished
            try:
                self._apply(batch)
            except Exception:
                self.log.append_stdout(traceback.format_exc())
        self._set_busy(False)

    def _collect(self, batch: _Batch, kind: str, item: Any) -> None:
        if kind == "event":
            batch.events.append(item)
        elif kind == "result":
            batch.results.append(item)
        elif kind == "log":
            batch.logs.append(item if item.endswith("\n") else item + "\n")
        elif kind == "done":
            batch.actions.append(lambda: self._show_comparison(item))
        elif kind == "probe":
            batch.actions.append(
                lambda: setattr(self.probe_summary, "value", _box("ok", item, pre=True))
            )
        elif kind == "error":
            batch.actions.append(lambda: self._show_error(item))
        elif kind == "finished":
            batch.finished = True

    def _apply(self, batch: _Batch) -> None:
        if batch.logs:
            self.log.append_stdout("".join(batch.logs))
        if batch.events:
            self._extend_timeline(batch.events)
        for name, metrics in batch.results:
            self._rows.append({"strategy": name, **metrics})
            self._show_table(pd.DataFrame(self._rows))
        for action in batch.actions:
            action()

    def _extend_timeline(self, events: list[Event]) -> None:
        from .plots import extend_timeline

        rows = []
        for event in events:
            origin = self._origins.setdefault(event.label, event.start_ns)
            rows.append({
                "strategy": event.label, "kind": event.kind, "step": event.step,
                "start_s": (event.start_ns - origin) / 1e9, "end_s": (event.end_ns - origin) / 1e9,
                "bytes": event.bytes,
            })
        extend_timeline(self.figure, pd.DataFrame(rows))
        self.progress.value = min(
            self.progress.max, self.progress.value + sum(e.kind == "step" for e in events)
        )

    def _show_table(self, df: pd.DataFrame) -> None:
        columns = [c for c in TABLE_COLUMNS if c in df.columns]
        table = df[columns].to_html(index=False, float_format=lambda v: f"{v:.4g}",
                                    classes="nbckpt-results", border=0, na_rep="")
        self.results.value = f"<b>Results</b>{table}"

    def _show_comparison(self, comparison: Comparison) -> None:
        from .plots import extend_timeline

        self.comparison = comparison
        self.stopped = self._stop.is_set()
        with self.figure.batch_update():  # the exact timeline replaces the live approximation
            self.figure.data = ()
            extend_timeline(self.figure, comparison.timeline)
        self._show_table(comparison.results)
        done = int(comparison.timeline["kind"].eq("step").sum()) if len(comparison.timeline) else 0
        if self.stopped:
            self.message.value = _box("info", f"Stopped after {done} training steps; every "
                                              "checkpoint written so far is committed.")
            self.progress.bar_style = "warning"
        else:
            self.message.value = _box("ok", f"Done: {done} training steps, "
                                            f"{len(comparison.results)} strategies.")
            self.progress.value = self.progress.max
            self.progress.bar_style = "success"

    def _show_error(self, exc: BaseException) -> None:
        self.error = _message(exc)
        self.message.value = _box("error", self.error)
        self.progress.bar_style = "danger"
        if self._job == "probe":
            self.probe_summary.value = _box("error", self.error)
