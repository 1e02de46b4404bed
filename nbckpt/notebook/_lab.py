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

Longer than 400 lines: one job (the lab widget and the life of its runs) whose parts each keep a
promise the tests hold it to: Kernel > Interrupt reaching a run behind an idle kernel, a re-run
cell stopping the old run before the new one takes the directory, widgets changed only from the
updater thread, a live timeline that restarts a strategy's lanes for its next repeat.
"""

from __future__ import annotations

import html
import logging
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import check_count, is_url, writable_directory
from ..engine import Event
from ._live_figure import live_figure
from ._timeline_figures import events_frame, extend_timeline, select_repeat, timeline_figure
from ._widget_parts import close_widgets, notice

if TYPE_CHECKING:
    import argparse

    from ..bench import Comparison

__all__ = ["Lab", "live_lab"]

_log = logging.getLogger("nbckpt")

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Log lines the lab keeps (the oldest are dropped).
LOG_LINES = 500
#: Columns of ``format_results`` the results table shows, as keys of ``SHOWN_COLUMNS`` (the
#: headers of every other nbckpt table); the text ones align left, the numbers right.
_COLUMNS = ("strategy", "repeats", "checkpoints", "overhead", "overhead_95ci", "per_repeat",
            "rests_on", "mean_step_s", "stall_mean_s", "save_stall_s", "wait_s", "stall_p95_s",
            "drag", "persist_s", "write_gbs", "reduction_vs_torch_save", "floor_check")
_TEXT_COLUMNS = ("strategy", "rests_on", "floor_check")
# A quick probe: enough to see the write rate and the stream count that helps.
_PROBE_MB, _PROBE_STREAMS = 32.0, (1, 2, 4)

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


def _check_target(path: str) -> None:
    """ConfigError when ``path`` cannot hold checkpoints (URLs are not checked). Nothing is
    created: a lab that is only validated leaves no directory behind."""
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


def _error_line(exc: BaseException) -> str:
    """One line for an error that ended a run."""
    if isinstance(exc, ConfigError):
        text = f"Cannot run: {exc}"
    elif isinstance(exc, CheckpointError):
        text = f"Checkpoint failed: {exc}"
    elif isinstance(exc, OSError):
        text = f"Storage error: {exc.strerror or exc}{f' ({exc.filename})' if exc.filename else ''}"
    else:
        text = f"Unexpected error: {type(exc).__name__}: {exc} (details in the log)"
    return " ".join(text.split())


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


# Kernel > Interrupt is a SIGINT. While a cell runs, ipykernel makes it a KeyboardInterrupt
# (Lab.wait catches it); while the kernel is idle it ignores it, so a run in the lab's threads
# would never hear of it. The handler below (installed once) tells the lab that ran last, then
# calls the one it replaced. ipykernel swaps handlers around each message it handles and puts
# back ``kernel.saved_sigint_handler`` after it: inside one (a cell, a click), ours goes there.
_previous_sigint: Any = signal.SIG_IGN
_interrupted: weakref.WeakMethod[Callable[[], None]] | None = None


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if (note := _interrupted() if _interrupted is not None else None) is not None:
        note()
    if callable(_previous_sigint):
        _previous_sigint(signum, frame)


def _route_interrupts(note: Callable[[], None]) -> None:
    """Every SIGINT from now on calls ``note`` (a bound method, held weakly) first. It must take
    no lock: a signal handler runs between two bytecodes of the main thread, which may hold any.
    Only the main thread can do this; where SIGINT ends the process, nothing changes."""
    global _previous_sigint, _interrupted
    _interrupted = weakref.WeakMethod(note)
    if threading.current_thread() is not threading.main_thread():
        return
    from IPython import get_ipython

    kernel: Any = getattr(get_ipython(), "kernel", None)  # type: ignore[no-untyped-call]
    inside = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
              and hasattr(kernel, "saved_sigint_handler"))
    current = kernel.saved_sigint_handler if inside else signal.getsignal(signal.SIGINT)
    if current is _on_sigint or current in (signal.SIG_DFL, None):
        return
    _previous_sigint = current
    if inside:
        kernel.saved_sigint_handler = _on_sigint
    else:
        signal.signal(signal.SIGINT, _on_sigint)


@dataclass(frozen=True, kw_only=True)
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


class Lab:
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
        from ..bench import DEFAULT_REPEATS, PRESETS, STRATEGIES

        _make_live(None)  # first: a bad argument below must not leave the old run going unseen
        choices = {"preset": ([preset], [*PRESETS, SYNTHETIC]), "device": ([device], devices()),
                   "strategy": (list(strategies), list(STRATEGIES))}
        for what, (given, allowed) in choices.items():
            if unknown := [value for value in given if value not in allowed]:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        self.refresh_s, self.compute_ms, self.warmup = refresh_s, compute_ms, warmup
        self.json_path = json_path
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
        self.interrupted = False  # stopped by Kernel > Interrupt (SIGINT), not by Stop
        self.log_lines: deque[str] = deque(maxlen=LOG_LINES)
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
        self._settings: _Settings | None = None
        self._results: dict[str, dict[str, Any]] = {}  # each strategy's latest run, for the table
        self._lanes: dict[str, tuple[int, list[pd.DataFrame]]] = {}  # the timeline's origin, rows
        self._finished: set[str] = set()  # strategies whose run ended: their next events restart
        self._runs_done = 0
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._job = ""
        self._interrupt_noted = False  # set by the SIGINT handler; the updater acts on it
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
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

    @property
    def running(self) -> bool:
        """A run or probe is going on (or its last updates are being applied)."""
        return any(thread.is_alive() for thread in self._threads)

    @property
    def closed(self) -> bool:
        """Closed by :meth:`close` (or replaced by a newer Lab): it runs nothing any more."""
        return self._closed.is_set()

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
            _route_interrupts(self._note_interrupt)  # Kernel > Interrupt stops it, as Stop does
            self._start("run", lambda: self._experiment(settings))
        return True

    def probe(self) -> bool:
        """Measure the target's write bandwidth in the background; False if the path is bad."""
        with self._lock:
            if self.closed or self.running:
                return False
            target = self.path.value
            try:
                _check_target(target)
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

    def stop(self) -> None:
        """End the run after the current step; saves in flight still commit (none half-written)."""
        self._request_stop("stop requested")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run (or probe) and its last update are done; False on timeout.
        Ctrl-C (Kernel > Interrupt) while it waits stops the run, as Stop does, and is raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for thread in list(self._threads):
                if thread is not threading.current_thread():
                    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self._interrupt()
            raise
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
            for handle in self._displays:  # first: no view of a closed model is ever drawn
                handle.update(self._closed_bundle(), raw=True)
            self._displays.clear()
            close_widgets(self.widget, self.figure)

    def _request_stop(self, why: str, *, interrupted: bool = False) -> None:
        if self._job != "run" or not self.running or self._stop.is_set():
            return
        self.interrupted = interrupted  # before the stop: the run's end reads it
        self._stop.set()
        self._post("log", f"{why}: finishing the current step and saves in flight")

    def _note_interrupt(self) -> None:
        self._interrupt_noted = True  # by the SIGINT handler: no lock; the updater stops the run

    def _interrupt(self) -> None:
        self._interrupt_noted = False
        self._request_stop("interrupted (Kernel > Interrupt)", interrupted=True)

    # -- main thread, between runs --------------------------------------------------------------

    def _read_settings(self) -> _Settings:
        _check_target(self.path.value)
        steps = check_count(self.steps.value, "steps")
        every = check_count(self.every.value, "checkpoint interval (every)", maximum=steps)
        repeats = check_count(self.repeats.value, "repeats")
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        synthetic = self.preset.value == SYNTHETIC
        if synthetic and not self.size_mb.value > 0:
            raise ConfigError(f"size must be positive, not {self.size_mb.value}")
        return _Settings(directory=self.path.value, names=tuple(self.strategies.value), steps=steps,
                         every=every, repeats=repeats, preset=None if synthetic else self.preset.value,
                         size_mb=self.size_mb.value if synthetic else None, device=self.device.value)

    def _reset(self, settings: _Settings) -> None:
        """No timeline rows or lanes, results, error or log: a clean slate for a run."""
        self._settings, self.comparison, self.error = settings, None, None
        self.stopped = self.interrupted = False
        self._results.clear()
        self._lanes.clear()
        self._finished.clear()
        self._runs_done = 0
        self._redraw(None)
        self.results.value = ""
        if "nbckpt-error" in self.probe_summary.value:
            self.probe_summary.value = ""
        self.log_lines.clear()
        self.log.value = _log_html(())
        self.progress.value, self.progress.bar_style = 0, ""
        self.progress.max = settings.steps * settings.runs

    def _set_busy(self, busy: bool) -> None:
        for control in (self.run_button, self.probe_button, self.path, self.preset, self.size_mb,
                        self.device, self.strategies, self.steps, self.every, self.repeats):
            control.disabled = busy
        self.size_mb.disabled = busy or self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    # -- worker side (never touches a widget) -------------------------------------------------

    def _post(self, kind: str, item: Any) -> None:
        self._queue.put((kind, item))

    def _start(self, name: str, job: Callable[[], None]) -> None:
        self._job = name
        self._stop.clear()
        self._interrupt_noted = False
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

        updater = threading.Thread(target=self._update_loop, args=(self._queue,),
                                   name="nbckpt-lab-updater", daemon=True)
        worker = threading.Thread(target=work, name="nbckpt-lab-worker", daemon=True)
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
            warmup=self.warmup, stop=self._stop, progress=lambda line: self._post("log", line),
            on_event=lambda event: self._post("event", event),
            on_result=lambda name, metrics: self._post("result", (name, metrics)),
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
            writable_directory(target, "target")  # the lab writes there anyway
        self._post("probe", probe(target, size_mb=_PROBE_MB, streams=_PROBE_STREAMS).summary())

    # -- updater side (the only thread that changes widgets while a job runs) -----------------

    def _update_loop(self, source: queue.Queue[tuple[str, Any]]) -> None:
        finished = False
        while not finished:
            if self._interrupt_noted:
                self._interrupt()
            batch: list[tuple[str, Any]] = []
            deadline = time.monotonic() + self.refresh_s
            while not finished:
                try:
                    batch.append(source.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
                finished = batch[-1][0] == "finished"
            if self.closed:  # drain the queue; the widgets may be gone from the page
                for kind, item in batch:
                    if kind == "error":
                        _log.warning("nbckpt: the closed lab's %s failed: %s", self._job, _error_line(item))
                continue
            try:
                self._apply(batch)
            except Exception as exc:  # the widgets may be what failed: say so outside them too
                _log.warning("nbckpt: the lab could not show an update: %s: %s", type(exc).__name__, exc)
                self.log_lines.append(traceback.format_exc())
                self.log.value = _log_html(self.log_lines)
        if not self.closed:
            self._set_busy(False)

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
                self.error = _error_line(item)
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
