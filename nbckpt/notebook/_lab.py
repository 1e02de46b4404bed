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
and the browser gets a few updates per second, not one per event. What the widgets show is
:class:`~._lab_view.LabView`'s part. Kernel > Interrupt stops a run as Stop does
(:mod:`._lab_interrupt`); a closed lab's output becomes a static note with its results, so a
reloaded page shows no view of a widget that is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, NbckptError
from .._util import is_url, writable_directory
from ..engine import Event
from ._lab_interrupt import route_interrupts
from ._lab_view import SYNTHETIC, LabView, RunSettings, check_target
from ._lab_widgets import error_line, log_html, notice, widgets_of

if TYPE_CHECKING:
    import argparse

    from ..bench import Comparison

__all__ = ["Lab", "live_lab"]

_log = logging.getLogger("nbckpt")

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


class Lab(LabView):
    """Interactive checkpoint lab: controls, progress, live timeline, results table and log.

    Code and tests can set the controls and ``click()`` the buttons; :meth:`run`, :meth:`stop`,
    :meth:`probe`, :meth:`wait` and :meth:`close` do the same from Python.
    """

    def __init__(
        self,
        directory: str = "data/checkpoints/lab",
        *,
        preset: str = "tiny",
        strategies: Sequence[str] = ("torch-save", "nbckpt-async"),
        steps: int = 20,
        every: int = 5,
        device: str = "cpu",
        size_mb: float = 64.0,
        repeats: int | None = None,
        refresh_s: float = 0.25,
        compute_ms: float = 5.0,
        warmup: bool = True,
        json_path: str | None = None,
    ) -> None:
        """``repeats`` defaults to :data:`nbckpt.bench.DEFAULT_REPEATS`; ``compute_ms``
        (synthetic workload), ``warmup`` and ``json_path`` are ``nbckpt bench``'s options."""
        _make_live(None)  # first: a bad argument below must not leave the old run going unseen
        super().__init__(directory=directory, preset=preset, strategies=strategies, steps=steps,
                         every=every, device=device, size_mb=size_mb, repeats=repeats)
        self.refresh_s = refresh_s
        self.compute_ms = compute_ms
        self.warmup = warmup
        self.json_path = json_path
        self.run_button.on_click(lambda _: self.run())
        self.stop_button.on_click(lambda _: self.stop())
        self.probe_button.on_click(lambda _: self.probe())
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
        if self.closed:
            return self._closed_bundle()
        return self.widget._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        """Shown under a display id, so that :meth:`close` can put a static note in its place:
        a view of a closed widget would read "Error displaying widget: model not found" once the
        page is reloaded."""
        from IPython.display import display

        bundle = self._repr_mimebundle_()
        handle = display(bundle, raw=True, display_id=not self.closed)  # type: ignore[no-untyped-call]
        if handle is not None:
            self._displays.append(handle)

    def _closed_bundle(self) -> dict[str, str]:
        """What a closed lab shows: a note and its last results table, as static HTML."""
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
            names = ", ".join(settings.names)
            baseline = "" if "none" in settings.names else " and none (the baseline)"
            self.message.value = notice(
                "info", f"Running {names}{baseline}: {settings.repeats} repeat(s) ..."
            )
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
            if self.closed:
                raise ConfigError("this lab is closed (a newer one replaced it): use the new one")
            if self.running:
                raise ConfigError("a run is in progress: stop it, or wait for it, first")
            self.error = None
            self.stopped = self.interrupted = False
            self._timeline.clear()
            self.comparison = comparison
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
            for widget in [*widgets_of(self.widget), self.figure]:
                widget.close()

    def _request_stop(self, why: str, *, interrupted: bool = False) -> None:
        if self._job != "run" or not self.running or self._stop.is_set():
            return
        self.interrupted = interrupted  # before the stop: the run's end reads it
        self._stop.set()
        self._post("log", f"{why}: finishing the current step and saves in flight")

    def _note_interrupt(self) -> None:
        """Called by the SIGINT handler, between two bytecodes of the main thread: a plain
        assignment (no lock); the updater thread stops the run."""
        self._interrupt_noted = True

    def _interrupt(self) -> None:
        self._interrupt_noted = False
        self._request_stop("interrupted (Kernel > Interrupt)", interrupted=True)

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

        worker = threading.Thread(target=work, name="nbckpt-lab-worker", daemon=True)
        updater = threading.Thread(target=self._update_loop, args=(self._queue,),
                                   name="nbckpt-lab-updater", daemon=True)
        self._threads = [worker, updater]
        updater.start()
        worker.start()

    def _experiment(self, settings: RunSettings) -> None:
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
            writable_directory(target, "target")  # the lab writes there anyway
        result = probe(target, size_mb=_PROBE_MB, streams=_PROBE_STREAMS)
        self._post("probe", result.summary())

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
                    kind, item = source.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                finished = kind == "finished"
                batch.append((kind, item))
            if self.closed:  # drain the queue; the widgets may be gone from the page
                for kind, item in batch:
                    if kind == "error":
                        _log.warning("nbckpt: the closed lab's %s failed: %s", self._job, error_line(item))
                continue
            try:
                self._apply(batch)
            except Exception as exc:
                # the widgets may be what failed: say so outside them too
                _log.warning("nbckpt: the lab could not show an update: %s: %s", type(exc).__name__, exc)
                self.log_lines.append(traceback.format_exc())
                self.log.value = log_html(self.log_lines)
        if not self.closed:
            self._set_busy(False)

    def _apply(self, batch: list[tuple[str, Any]]) -> None:
        """Apply a batch in the order it was posted (events of a new run follow its result)."""
        events: list[Event] = []
        logs = len(self.log_lines)
        table = False
        for kind, item in batch:
            if kind != "event" and events:
                self._show_events(events)
                events = []
            if kind == "event":
                events.append(item)
            elif kind == "result":
                self._add_result(*item)
                table = True
            elif kind == "log":
                self.log_lines.append(item if item.endswith("\n") else item + "\n")
                logs = -1
            elif kind == "done":
                table = False
                self._show_comparison(item)
            elif kind == "probe":
                self.probe_summary.value = notice("ok", item, pre=True)
            elif kind == "error":
                self._show_error(item, probe=self._job == "probe")
        if events:
            self._show_events(events)
        if table:
            self._show_results_so_far()
        if logs != len(self.log_lines):
            self.log.value = log_html(self.log_lines)
