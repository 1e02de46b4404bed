"""The checkpoint lab: pick a target, a workload and strategies, run them, watch the timeline grow.

    >>> lab = Lab(directory="data/checkpoints/lab", preset="tiny")  # steps and every: measured
    >>> lab                       # in a notebook: the controls, a live timeline, the results
    >>> lab.run(); lab.wait()     # or click Run; lab.comparison holds the Comparison
    >>> Lab(ranks=4)              # the same on 4 local ranks: torchrun as a child process

One Lab is live per kernel: creating another (re-running the cell, ``%ckpt_bench``) stops and
closes the previous one, saying so. A run goes on in a worker thread that never touches a
widget; one updater thread applies what it queues every ``refresh_s`` seconds.

With ``ranks`` above 1 the run is ``nbckpt bench`` on that many local ranks
(:func:`nbckpt.bench._internal.run_local_ranks`: one rank per GPU with ``device="cuda"``, else
CPU processes), every rank's events streamed into the live timeline as they happen (a pair of
lanes per strategy and rank). Stop, Kernel > Interrupt, closing the lab and a newer lab end
every rank at once (a run on many ranks keeps no partial results); a rank that dies is named in
one line. After the run the results show the job's figures: the aggregate write rate, the
stall over ranks and the straggler.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import pandas as pd

from .._errors import ConfigError, NbckptError
from .._util import check_count
from ._lab_html import job_html, log_html, results_html
from ._lab_run import check_target, error_line, route_interrupts, run_here, run_on_ranks
from ._live_figure import live_figure
from ._plotly_compat import set_config
from ._timeline_figures import events_frame, extend_timeline, rank_events, select_repeat, timeline_figure
from ._widget_parts import close_widgets, notice

if TYPE_CHECKING:
    import argparse

    import plotly.graph_objects as go

    from ..bench import Comparison
    from ..bench._internal import RankLaunch

__all__ = ["LOG_LINES", "Lab", "live_lab"]

_log = logging.getLogger("nbckpt")

#: The workload choice that means "a synthetic state of ``size_mb`` MiB" instead of a GPT preset.
SYNTHETIC = "synthetic"
#: Log lines the lab keeps (the oldest are dropped).
LOG_LINES = 500
_LIVE_TITLE = "Timeline (live): every run so far"

_WORKER = "nbckpt-lab-worker"
_live_lock = threading.Lock()
_live: Lab | None = None


def live_lab() -> Lab | None:
    """The kernel's live Lab (the newest one created and not closed), or None."""
    return _live


def devices() -> list[str]:
    """Devices a run can use here: cpu, and cuda when torch sees one."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _make_live(lab: Lab | None) -> None:
    """Make ``lab`` the live Lab; close the previous one and say so in one line."""
    global _live
    with _live_lock:
        previous, _live = _live, lab
    if previous is None or previous is lab:
        return
    was_running = previous.running
    previous.close()
    print(
        "nbckpt: stopped the previous lab's run (its saves in flight committed) and closed it"
        if was_running
        else "nbckpt: closed the previous lab"
    )


def _stop_at_exit() -> None:
    """At the kernel's exit (a shutdown or restart as a lab runs): its run ends after the
    current step, its saves in flight commit, and the exit waits for its threads. Left running,
    the interpreter's teardown came under its training step or save and aborted the process
    (``terminate called without an active exception``, SIGABRT and a core dump of the kernel: 3
    runs of 5). Registered after the engine's exit work, so it runs before it, though after
    the close at exit of a Checkpointer the run made (the run then records that error, not a
    clean stop; the engine's lock keeps a save from racing that close)."""
    with _live_lock:
        lab = _live
    if lab is not None and lab.running:
        lab.stop()
        lab.wait()


atexit.register(_stop_at_exit)


class Lab:
    """Interactive checkpoint lab: controls, progress, live timeline, results table and log.

    Every control is a public widget (``path``, ``steps``, ``run_button``, ...); ``widget`` is the
    whole lab, ``figure`` its timeline. A run leaves ``comparison``, ``error``, ``stopped``,
    ``interrupted`` and ``log_lines``.
    """

    def __init__(
        self,
        directory: str = "data/checkpoints/lab",
        *,
        preset: str = "tiny",
        strategies: Sequence[str] = ("torch-save", "nbckpt-async"),
        steps: int | None = None,
        every: int | None = None,
        device: str = "cpu",
        size_mb: float = 64.0,
        repeats: int | None = None,
        refresh_s: float = 0.25,
        compute_ms: float = 5.0,
        warmup: bool = True,
        json_path: str | None = None,
        ranks: int = 1,
    ) -> None:
        """``repeats`` defaults to :data:`nbckpt.bench.DEFAULT_REPEATS`; ``compute_ms``
        (synthetic workload), ``warmup`` and ``json_path`` are ``nbckpt bench``'s options;
        ``ranks``: 1 runs in this kernel, more run on that many local ranks under torchrun.
        ``every`` None (0 in its field): each run first times a few steps and a save to the
        target and checkpoints often enough, and no more, that a save never waits for the one
        before, as in a training job; ``steps`` None (0): a few such intervals."""
        from ..bench._internal import DEFAULT_REPEATS, PRESETS, STRATEGIES

        _make_live(None)  # first: a bad argument below must not leave the old run going unseen
        choices = {
            "preset": ([preset], [*PRESETS, SYNTHETIC]),
            "device": ([device], devices()),
            "strategy": (list(strategies), list(STRATEGIES)),
        }
        for what, (given, allowed) in choices.items():
            if unknown := [value for value in given if value not in allowed]:
                raise ConfigError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
        check_count(ranks, "ranks")
        self.refresh_s, self.compute_ms, self.warmup = refresh_s, compute_ms, warmup
        self.json_path = json_path
        self.comparison: Comparison | None = None
        self.error: str | None = None
        self.stopped = False
        self.interrupted = False  # stopped by Kernel > Interrupt (SIGINT), not by Stop
        self.log_lines: deque[str] = deque(maxlen=LOG_LINES)
        self._origin: int | None = None  # the live timeline's time 0: the run's first event
        self._lock = threading.Lock()
        self.closed = False  # by close() (or a newer Lab): it runs nothing any more
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._interrupt_noted = False  # set by the SIGINT handler; the updater acts on it
        self._runs = 1  # runs in the current comparison: the progress bar's steps are these x steps
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._displays: list[Any] = []  # IPython DisplayHandles of the outputs showing it
        self._launch: RankLaunch | None = None  # the run's torchrun, on many ranks
        self._by_rank = False  # the run's events have lanes per rank

        named = {"style": {"description_width": "90px"}}
        self.path = widgets.Text(directory, description="target", layout={"width": "420px"}, **named)
        self.preset = widgets.Dropdown(
            options=[*PRESETS, SYNTHETIC], value=preset, description="workload", **named
        )
        self.size_mb = widgets.BoundedFloatText(
            size_mb,
            min=0.001,
            max=1e7,
            step=16,
            description="size MiB",
            disabled=preset != SYNTHETIC,
            **named,
        )
        self.device = widgets.Dropdown(options=devices(), value=device, description="device", **named)
        self.strategies = widgets.SelectMultiple(
            options=list(STRATEGIES),
            value=tuple(strategies),
            rows=len(STRATEGIES),
            description="strategies",
            tooltip="Ctrl- or Shift-click for several; none, the baseline, always runs",
            **named,
        )
        self.steps = widgets.IntText(
            steps or 0, description="steps", tooltip="training steps per run; 0: a few intervals", **named
        )
        self.every = widgets.IntText(
            every or 0,
            description="every",
            tooltip="checkpoint every K steps; 0: measured first, so that saves never queue",
            **named,
        )
        self.repeats = widgets.IntText(
            DEFAULT_REPEATS if repeats is None else repeats,
            description="repeats",
            tooltip="each repeat runs every strategy once, interleaved",
            **named,
        )
        self.ranks = widgets.IntText(
            ranks,
            description="ranks",
            tooltip="1: in this kernel; more: local ranks under torchrun (one per GPU with cuda)",
            **named,
        )
        self.run_button = widgets.Button(description="Run", button_style="success", icon="play")
        self.stop_button = widgets.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.progress = widgets.IntProgress(0, min=0, max=1, description="progress", **named)
        self.message, self.results, self.log = widgets.HTML(), widgets.HTML(), widgets.HTML(log_html(()))
        self.figure = live_figure(timeline_figure(pd.DataFrame(columns=["kind", "start_s", "end_s"])))
        set_config(self.figure, responsive=True)
        self._empty_height = self.figure.layout.height
        self._redraw(None, _LIVE_TITLE)
        # After a run on many ranks: the stall over ranks, the straggler starred (made then, so
        # that a lab on one process holds one plotly figure).
        self.job_figure: go.FigureWidget | None = None
        self.job_box = widgets.Box()
        self.widget = widgets.VBox(
            [
                self.path,
                widgets.HBox(
                    [
                        widgets.VBox(
                            [
                                self.preset,
                                self.size_mb,
                                self.device,
                                self.steps,
                                self.every,
                                self.repeats,
                                self.ranks,
                            ]
                        ),
                        self.strategies,
                    ]
                ),
                widgets.HBox([self.run_button, self.stop_button, self.progress]),
                self.message,
                self.figure,
                self.results,
                self.job_box,
                self.log,
            ]
        )
        self.widget.add_class("nbckpt-lab")
        self.preset.observe(
            lambda change: setattr(self.size_mb, "disabled", change["new"] != SYNTHETIC), names="value"
        )
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        _make_live(self)  # closes one that another thread created meanwhile

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Lab:
        """A lab set up from ``nbckpt bench`` options (what ``%ckpt_bench`` shows)."""
        from ..bench._internal import strategy_names

        names = strategy_names(args.strategies)
        synthetic = args.size_mb is not None
        if synthetic and args.preset is not None:
            raise ConfigError("give --preset or --size-mb, not both")
        if getattr(args, "idle_compute", False):
            raise ConfigError(
                "the live lab does not take --idle-compute; run it with --static or nbckpt bench"
            )
        return cls(
            directory=args.dir,
            preset=SYNTHETIC if synthetic else args.preset or "tiny",
            strategies=names,
            steps=args.steps,
            every=args.every,
            device=args.device,
            repeats=args.repeats,
            compute_ms=args.compute_ms,
            warmup=not args.no_warmup,
            json_path=args.json,
            ranks=_one_rank_count(getattr(args, "ranks", None)),
            **({"size_mb": args.size_mb} if synthetic else {}),
        )

    @property
    def running(self) -> bool:
        """A run is going on (or its last updates are being applied)."""
        return any(thread.is_alive() for thread in self._threads)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._closed_bundle() if self.closed else self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        """Shown under a display id, so that :meth:`close` can put a static note in its place (a
        reloaded page would show a closed widget as "Error displaying widget: model not found")."""
        from IPython.display import display

        handle = display(self._repr_mimebundle_(), raw=True, display_id=not self.closed)  # type: ignore[no-untyped-call]
        if handle is not None:
            self._displays.append(handle)

    def _closed_bundle(self) -> dict[str, str]:
        text = "closed nbckpt Lab (replaced by a newer one, or closed): lab.comparison keeps its results"
        return {"text/plain": f"<{text}>", "text/html": notice("info", text) + self.results.value}

    # -- actions (main thread) ------------------------------------------------------------------

    def run(self) -> bool:
        """Validate the fields and start the comparison in the background; False if it did not
        start (the reason is in ``lab.error`` and the lab's message line)."""
        with self._lock:  # from two threads at once: one run starts, the other is told why not
            return self._start()

    def _start(self) -> bool:
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
        for thread in threading.enumerate():  # a closed lab's run that a Ctrl-C cut close() short
            if thread.name == _WORKER:  # may still hold the directory this one is about to lock
                thread.join()
        names = settings["strategies"]
        self.comparison, self.error, self.stopped, self.interrupted = None, None, False, False
        self._origin, self._interrupt_noted = None, False
        self.log_lines.clear()
        self._show_log()
        self._by_rank, self._launch = settings["ranks"] > 1, None
        self._redraw(None, _LIVE_TITLE)
        self.results.value = ""
        self._drop_job_figure()
        runs = (len(names) + ("none" not in names)) * settings["repeats"]
        self._runs = runs
        self.progress.value, self.progress.bar_style, self.progress.max = (
            0,
            "",
            (settings["steps"] or 1) * runs,
        )
        baseline = "" if "none" in names else " and none (the baseline)"
        first = " (first, a step and a save are timed for the interval)" if settings["every"] is None else ""
        where = f" on {settings['ranks']} ranks (torchrun)" if self._by_rank else ""
        self.message.value = notice(
            "info", f"Running {', '.join(names)}{baseline}{where}: {settings['repeats']} repeat(s){first} ..."
        )
        route_interrupts(self._note_interrupt)  # Kernel > Interrupt stops it, as Stop does
        self._stop.clear()
        self._queue = queue.Queue()
        self._set_busy(True)
        self._threads = [
            threading.Thread(target=self._work, args=(settings,), name=_WORKER, daemon=True),
            threading.Thread(
                target=self._update_loop, args=(self._queue,), name="nbckpt-lab-updater", daemon=True
            ),
        ]
        for thread in self._threads:
            thread.start()
        return True

    def stop(self) -> None:
        """End the run after the current step; saves in flight still commit (none half-written)."""
        self._end_run(interrupted=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the run and its last update are done; False on timeout. Ctrl-C (Kernel >
        Interrupt) while it waits stops the run, as Stop does, and is raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for thread in list(self._threads):
                if thread is not threading.current_thread():
                    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            self._end_run(interrupted=True)
            raise
        return not self.running

    def show(self, comparison: Comparison) -> None:
        """Show a comparison measured before (``Comparison.from_json`` of a ``nbckpt bench
        --json`` file): its timeline, results and notes, as after a run."""
        with self._lock:  # never beside a run another thread starts
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
        self.closed = True  # from here on the updater leaves the widgets alone
        self._stop.set()
        self._end_ranks()
        try:
            self.wait()
        finally:
            for handle in self._displays:  # first: no view of a closed model is ever drawn
                handle.update(self._closed_bundle(), raw=True)
            self._displays.clear()
            close_widgets(self.widget, self.figure)  # the job's figure is in the widget

    def _read_settings(self) -> dict[str, Any]:
        """The run's arguments, read from the controls once (the worker never reads a widget)."""
        check_target(self.path.value)
        from ..bench._internal import DEFAULT_STEPS

        # 0: measured first (the fields' defaults); anything else must make a run that saves
        steps = None if self.steps.value == 0 else check_count(self.steps.value, "steps")
        every = (
            None
            if self.every.value == 0
            else check_count(self.every.value, "checkpoint interval (every)", maximum=steps or DEFAULT_STEPS)
        )
        repeats = check_count(self.repeats.value, "repeats")
        ranks = check_count(self.ranks.value, "ranks")
        if not self.strategies.value:
            raise ConfigError("select at least one strategy")
        synthetic = self.preset.value == SYNTHETIC
        preset, size_mb = (None, self.size_mb.value) if synthetic else (self.preset.value, None)
        return {
            "strategies": list(self.strategies.value),
            "directory": self.path.value,
            "steps": steps,
            "every": every,
            "repeats": repeats,
            "workload": (preset, size_mb, self.device.value),
            "ranks": ranks,
        }

    def _set_busy(self, busy: bool) -> None:
        for control in (
            self.run_button,
            self.path,
            self.preset,
            self.device,
            self.strategies,
            self.steps,
            self.every,
            self.repeats,
            self.ranks,
        ):
            control.disabled = busy
        self.size_mb.disabled = busy or self.preset.value != SYNTHETIC
        self.stop_button.disabled = not busy

    # -- stopping: Stop, Kernel > Interrupt, close ------------------------------------------------

    def _end_run(self, *, interrupted: bool) -> None:
        """Stop, or Kernel > Interrupt (``interrupted``): the run ends after the current step."""
        self._interrupt_noted = False
        if self.running and not self._stop.is_set():
            self.interrupted = interrupted  # before the stop: the run's end reads it
            self._stop.set()
            self._end_ranks()
            why = "interrupted (Kernel > Interrupt)" if interrupted else "stop requested"
            how = "ending every rank" if self._by_rank else "finishing the current step and saves in flight"
            self._post("log", f"{why}: {how}")

    def _note_interrupt(self) -> None:
        self._interrupt_noted = True  # by the SIGINT handler: no lock; the updater stops the run

    def _end_ranks(self) -> None:
        """Have torchrun end every rank now (the worker waits for them); after the stop is set, so
        that a launch starting meanwhile sees it (:meth:`_started`)."""
        if (launch := self._launch) is not None:
            launch.terminate()

    def _started(self, launch: RankLaunch) -> None:
        self._launch = launch
        if self._stop.is_set():  # stopped while torchrun was being started
            launch.terminate()

    # -- the worker (never touches a widget) ----------------------------------------------------

    def _post(self, kind: str, item: Any) -> None:
        self._queue.put((kind, item))

    def _work(self, settings: dict[str, Any]) -> None:
        from ..bench._internal import ComparisonInterrupted

        try:
            if settings["ranks"] > 1:
                comparison = run_on_ranks(
                    settings, self.compute_ms, self.warmup, self._post, self.json_path, on_start=self._started
                )
            else:
                comparison = run_here(
                    settings, self.compute_ms, self.warmup, self._post, self.json_path, stop=self._stop
                )
            self.stopped, self.comparison = self._stop.is_set(), comparison
            self._post("done", comparison)
        except ComparisonInterrupted as exc:  # the ranks ended by Stop, Interrupt or close
            self.stopped = True
            self._post("stopped", exc)
        except BaseException as exc:
            if not isinstance(exc, NbckptError | OSError):  # expected ones need no traceback
                self._post("log", traceback.format_exc())
            self._post("error", exc)
        finally:
            self._post("finished", None)

    # -- the updater (the only thread that changes widgets while a run goes on) -----------------

    def _update_loop(self, source: queue.Queue[tuple[str, Any]]) -> None:
        finished = False
        while not finished:
            time.sleep(self.refresh_s)  # one update per refresh_s, with all that came meanwhile
            if self._interrupt_noted:
                self._end_run(interrupted=True)
            batch: list[tuple[str, Any]] = []
            while not finished and not source.empty():
                batch.append(source.get())
                finished = batch[-1][0] == "finished"
            if self.closed:  # drain the queue; the widgets may be gone from the page
                for kind, item in batch:
                    if kind == "error":
                        _log.warning("nbckpt: the closed lab's run failed: %s", error_line(item))
                continue
            try:
                self._apply(batch)
            except Exception as exc:  # the widgets may be what failed: say so outside them too
                _log.warning("nbckpt: the lab could not show an update: %s: %s", type(exc).__name__, exc)
                self.log_lines.append(traceback.format_exc())
                self._show_log()
        if not self.closed:
            self._set_busy(False)

    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """Show a batch of updates (a run's events all come before its end)."""
        for steps in (item for kind, item in batch if kind == "steps"):  # measured: before its events
            self.progress.max = steps * self._runs
        if events := [item for kind, item in batch if kind == "event"]:
            self._origin = min(event.start_ns for event in events) if self._origin is None else self._origin
            extend_timeline(self.figure, events_frame(events, self._origin), by_rank=self._by_rank)
            steps = sum(event.kind == "step" and event.rank == 0 for event in events)  # rank 0's
            self.progress.value = min(self.progress.max, self.progress.value + steps)
        for kind, item in batch:
            if kind == "log":
                self.log_lines.append(item if item.endswith("\n") else item + "\n")

            elif kind == "done":
                self._show_comparison(item)
            elif kind == "stopped":
                how = "Interrupted (Kernel > Interrupt)" if self.interrupted else "Stopped"
                self.message.value = notice(
                    "info", f"{how}: {item}; a run on many ranks keeps no partial results."
                )
                self.progress.bar_style = "warning"
            elif kind == "error":
                self.error = error_line(item)
                self.message.value = notice("error", self.error)
                self.progress.bar_style = "danger"
        if any(kind == "log" for kind, _ in batch):
            self._show_log()

    def _show_log(self) -> None:
        self.log.value = log_html(self.log_lines)

    def _redraw(self, timeline: pd.DataFrame | None, title: str, *, by_rank: bool = False) -> None:
        """Replace the timeline's bars and lanes with ``timeline`` (None: an empty figure)."""
        # Not one batch_update: inside one, reads return the values from before it, and
        # extend_timeline reads the lanes it adds to.
        self.figure.data = ()
        self.figure.update_layout(title=title, yaxis_categoryarray=(), height=self._empty_height)
        if timeline is not None and len(timeline):
            extend_timeline(self.figure, timeline, by_rank=by_rank)

    def _show_comparison(self, comparison: Comparison) -> None:
        # the exact timeline of each strategy's last repeat (on every rank), in the table's order
        order = {name: i for i, name in enumerate(comparison.results["strategy"])}
        on_ranks = bool(comparison.job)
        timeline = select_repeat(rank_events(comparison.rank_timeline) if on_ranks else comparison.timeline)
        if len(timeline):
            keys = ["strategy", "rank"] if on_ranks else ["strategy"]
            timeline = timeline.sort_values(
                keys, key=lambda s: s.map(order) if s.name == "strategy" else s, kind="stable"
            )
        self._redraw(timeline, "Timeline: each strategy's last repeat", by_rank=on_ranks)
        self.results.value = results_html(comparison)
        self._drop_job_figure()
        if on_ranks:
            self._show_job(comparison)
        done = int(comparison.timeline["kind"].eq("step").sum()) if len(comparison.timeline) else 0
        if self.stopped:
            how = "Interrupted (Kernel > Interrupt)" if self.interrupted else "Stopped"
            self.message.value = notice(
                "info", f"{how} after {done} training steps; every checkpoint written so far is committed."
            )
            self.progress.bar_style = "warning"
        else:
            ranks = f" on each of {comparison.job['world_size']} ranks" if on_ranks else ""
            self.message.value = notice(
                "ok",
                f"Done: {done} training steps{ranks}, {len(comparison.results)}"
                f" strategies x {comparison.repeats} repeat(s).",
            )
            self.progress.value, self.progress.bar_style = self.progress.max, "success"

    def _show_job(self, comparison: Comparison) -> None:
        """The job's table under the results, and the stall over ranks with its straggler."""
        from ..analysis import job_table, rank_rows
        from ._rank_figures import rank_stall_figure

        self.results.value += job_html(comparison)
        self.job_figure = live_figure(rank_stall_figure(rank_rows(comparison), job_table(comparison)))
        self.job_box.children = (self.job_figure,)

    def _drop_job_figure(self) -> None:
        if self.job_figure is not None:
            self.job_box.children = ()
            close_widgets(self.job_figure)
            self.job_figure = None


def _one_rank_count(ranks: int | str | None) -> int:
    """``--ranks`` as a lab takes it: ``%ckpt_bench``'s N, or ``nbckpt bench``'s sweep (a text,
    "1,2,4") only when it names one size; absent: 1."""
    if ranks is None:
        return 1
    if isinstance(ranks, str):
        sizes = [size.strip() for size in ranks.split(",") if size.strip()]
        if len(sizes) != 1 or not sizes[0].isdigit():
            raise ConfigError(f"a lab runs one rank count at a time, not --ranks {ranks}")
        return int(sizes[0])
    return ranks
