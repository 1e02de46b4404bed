"""Autosave for notebooks: named variables saved in the background as cells end, on a time budget,
and a final save when the work is about to be lost.

    %ckpt_autosave model opt --every 10min --step step
    Autosave(["model", "opt"], every_s="10min", step="step").start()    # the same, from Python
    %ckpt_autosave model opt --mtbf 8h    # as often as a SaveSchedule advises (schedule=...)

- **After a cell** (``post_run_cell``), once ``every`` has passed: an async save, so the next cell
  waits only for the host copy. With a save to the directory still in flight it is skipped (the
  next cell tries again): autosaves never queue up behind a slow disk. With a save schedule
  (``--mtbf``, ``schedule=SaveSchedule(...)``) in place of ``every``: the first cell saves (it
  measures what a save costs), then the interval Young/Daly advises for the recent saves' costs.
- **A cell that ended with KeyboardInterrupt**: at once, whatever the budget (an interrupted cell
  is often the step before a restart).
- **Kernel shutdown or restart**: the process exits normally and runs ``atexit`` on the main
  thread, where a final synchronous save runs, bounded by ``timeout_s``. The hook is registered
  again after each cell so that it runs before the Checkpointers' own close (newest first).
  Jupyter's manager sends SIGTERM after half its ``shutdown_wait_time`` (5 s) and SIGKILL at
  the end: raise ``KernelManager.shutdown_wait_time`` for states that take longer to write.
- **SIGTERM**: :meth:`~nbckpt.Checkpointer.save_on_signal` makes the same bounded final save.

A final save writes only when a cell ran since the last autosave; one that does not commit never
counts. Nothing runs on SIGKILL or a crash: the last committed autosave is what is left then.
Steps come from the user's variable (also saved, so ``%ckpt_restore`` brings it back) or else
one past the newest step; a step already there that this session did not save is never replaced.
Every failure is one line on the ``nbckpt`` logger, counted in the status; none fails the cell.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import operator
import signal
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from .._errors import ConfigError
from .._util import check_path, format_duration, parse_duration
from ..engine import Checkpointer, SaveHandle, SaveRecord, SaveSchedule
from ..engine._internal import Pacer, check_signals
from ._cell import one_line, reraise
from ._session import Save, Session, variables

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionResult, InteractiveShell

__all__ = ["Autosave", "command"]

_log = logging.getLogger("nbckpt")
_ACTIVE: weakref.WeakKeyDictionary[Any, Autosave] = weakref.WeakKeyDictionary()
_HOOKS = ("pre_run_cell", "post_run_cell")

StepSource = str | Callable[[], int] | None


def _session_of(shell: InteractiveShell) -> Session:
    """The session of the shell's nbckpt extension (loaded now if it is not): autosaves share its
    Checkpointers, show in ``%ckpt_status``, and their problems reach the notebook."""
    magics = shell.magics_manager.registry.get("CheckpointMagics")
    if magics is None:
        shell.run_line_magic("load_ext", "nbckpt")
        magics = shell.magics_manager.registry.get("CheckpointMagics")
    session = getattr(magics, "session", None)
    if not isinstance(session, Session):
        raise ConfigError("the nbckpt extension did not load (try %load_ext nbckpt)")
    return session


def _shell_or_current(shell: InteractiveShell | None) -> InteractiveShell | None:
    if shell is not None:
        return shell
    from IPython import get_ipython

    current: InteractiveShell | None = get_ipython()  # type: ignore[no-untyped-call]
    return current


class Autosave:
    """Autosave of ``names`` (notebook variables) into ``directory`` (default: ``%ckpt_config``'s)
    every ``every_s`` (seconds or ``"10min"``; default 10 min), or as often as ``schedule`` (a
    :class:`~nbckpt.SaveSchedule`) advises for the measured save costs; ``step``: a variable's
    name or a function giving the step (None: one past the newest); ``timeout_s`` bounds the
    final save; ``clock``: the seconds the interval is measured on (``time.monotonic``; a test
    gives a clock it moves on, and may set :attr:`clock` later). One per shell: :meth:`start`
    replaces the one running.
    """

    def __init__(
        self,
        names: Sequence[str] | str,
        *,
        every_s: float | str | None = None,
        schedule: SaveSchedule | None = None,
        directory: str | None = None,
        step: StepSource = None,
        shell: InteractiveShell | None = None,
        timeout_s: float | str = 20.0,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(names, str):
            names = names.split()
        if not isinstance(names, Sequence) or not names or not all(isinstance(name, str) for name in names):
            raise ConfigError(
                "Autosave wants the names of notebook variables, e.g. "
                f"Autosave(['model', 'opt']), not {repr(names)[:80]}"
            )
        self.signals = check_signals(signals)  # not when start() installs them
        if not callable(clock):
            raise ConfigError(f"clock must be a function giving seconds, not {clock!r}")
        if directory is not None:
            check_path(directory, "directory")
        found = _shell_or_current(shell)
        if found is None:
            raise ConfigError("Autosave needs an IPython shell: run it in a notebook or IPython")
        self.shell: InteractiveShell = found
        self.names = tuple(names)
        if schedule is not None and not isinstance(schedule, SaveSchedule):
            raise ConfigError(f"schedule must be a SaveSchedule (of an mtbf or gpus), not {schedule!r}")
        if schedule is not None and every_s is not None:
            raise ConfigError("Autosave saves every every_s or as its schedule says, not both")
        self.every_s = parse_duration(600.0 if every_s is None else every_s, "every")
        self._pacer = Pacer(schedule) if schedule is not None else None
        self.timeout_s = parse_duration(timeout_s, "timeout")
        if step is not None and not isinstance(step, str) and not callable(step):
            raise ConfigError(f"step must be a variable's name or a function, not {step!r}")
        self.step = step
        variables(self._namespace, self._saved_names)  # a typo fails now, not ten minutes later
        self.session = _session_of(self.shell)
        self.directory = directory or self.session.defaults.directory
        self.key = self.session.key(self.directory)
        self.running = False
        self.last: Save | None = None  # the newest autosave (None before the first)
        self.clock = clock
        self._last_at = clock()  # when it started: the budget runs from here
        self._last_wall: float | None = None
        self._cells = 0  # cells run since start(); see _pre_run_cell
        self._cells_saved = 0  # ... when the newest autosave took the state
        self._armed: Checkpointer | None = None  # the Checkpointer the signal handler saves with
        self._disarm: Callable[[], None] | None = None
        self.failures = 0  # autosaves that failed or were refused since start()
        self.last_error: str | None = None  # the newest failure's line, and when it came
        self._error_wall: float | None = None

    @classmethod
    def active(cls, shell: InteractiveShell | None = None) -> Autosave | None:
        """The shell's running autosave, if any."""
        shell = _shell_or_current(shell)
        return _ACTIVE.get(shell) if shell is not None else None

    @property
    def _namespace(self) -> dict[str, Any]:
        namespace: dict[str, Any] = self.shell.user_ns
        return namespace

    @property
    def _saved_names(self) -> tuple[str, ...]:
        """The variables saved: ``names``, and the step variable (a restore brings it back)."""
        if isinstance(self.step, str) and self.step not in self.names:
            return (*self.names, self.step)
        return self.names

    # -- lifetime -------------------------------------------------------------------------------

    def start(self) -> Autosave:
        """Open the directory (a bad one fails here, in one line), replace the shell's running
        autosave, and hook into cells, signals and the exit."""
        if self.running:
            return self
        self.session.checkpointer(self.directory)
        previous = _ACTIVE.get(self.shell)
        if previous is not None:
            previous.stop()
        _ACTIVE[self.shell] = self
        for event in _HOOKS:
            self.shell.events.register(event, getattr(self, f"_{event}"))
        self.running = True
        self._last_at = self.clock()
        self._arm()
        return self

    def stop(self) -> None:
        """Unhook everything; saves in flight go on (``%ckpt_wait`` waits for them)."""
        if self.running:
            self._unhook()
            atexit.unregister(self._at_exit)

    def _unhook(self) -> None:
        self.running = False
        for event in _HOOKS:
            callback = getattr(self, f"_{event}")
            if callback in self.shell.events.callbacks[event]:
                self.shell.events.unregister(event, callback)
        if self._disarm is not None:
            self._disarm()
        self._armed = self._disarm = None
        if _ACTIVE.get(self.shell) is self:
            del _ACTIVE[self.shell]

    def _arm(self) -> None:
        """Point the signal handler at the directory's current Checkpointer (the session opens a
        new one when an option changes) and put the exit hook last in line, so that it runs first."""
        ckpt = self.session.opened(self.directory)  # one closed under the session is reopened
        if ckpt is not self._armed:
            if self._disarm is not None:
                self._disarm()
            self._disarm = ckpt.save_on_signal(self._snapshot, signals=self.signals, timeout_s=self.timeout_s)
            self._armed = ckpt
        atexit.unregister(self._at_exit)
        atexit.register(self._at_exit)

    # -- the triggers ---------------------------------------------------------------------------

    def _pre_run_cell(self, info: Any) -> None:
        self._cells += 1  # a cell may change the state: a final save has something new to write

    def _post_run_cell(self, result: ExecutionResult) -> None:
        interrupted = isinstance(result.error_in_exec, KeyboardInterrupt)
        # Never a traceback under the user's cell: IPython prints one for a hook that raises.
        try:
            if interrupted or self._due():
                self._save(interrupted=interrupted)
            self._arm()
        except KeyboardInterrupt:
            self._report("interrupted while staging; the next cell tries again")
        except Exception as exc:  # UsageError, ConfigError, CheckpointFailed, a step function's own
            self._report(one_line(exc))

    def _due(self) -> bool:
        if self._pacer is not None:  # asked at each cell's end: a cell is no training step to count
            records = self.session.opened(self.directory).records
            persisting = bool(self.session.in_flight(self.key))
            if not self._pacer.decide(self.clock(), records, None, persisting)[0]:
                return False
        elif self.clock() - self._last_at < self.every_s:
            return False
        # A save in flight (an autosave or the user's): skip rather than stall the next cell.
        return not self.session.in_flight(self.key)

    def _at_exit(self) -> None:
        """The final save when the kernel shuts down or restarts (atexit, on the main thread)."""
        ckpt = self._armed
        if not self.running or ckpt is None:
            return
        self._unhook()  # this is the final save: a signal must not start another one
        if signal.SIGTERM in self.signals:
            # Jupyter sends SIGTERM half-way through its shutdown wait; the save is bounded already.
            signal.signal(signal.SIGTERM, self._late_signal)
        ckpt.final_save(self._take_final, timeout_s=self.timeout_s, reason="kernel exit")

    def _late_signal(self, signum: int, frame: Any) -> None:
        _log.warning(
            "nbckpt: %s during the final save at exit: it goes on (at most %s)",
            signal.Signals(signum).name,
            format_duration(self.timeout_s),
        )

    def _snapshot(self) -> tuple[Mapping[str, Any], int] | None:
        """The final save of a signal (runs in the handler, on the main thread)."""
        if not self.running:
            return None  # stopped, but a handler installed on top of ours still chains to it
        return self._take_final()

    def _take_final(self) -> tuple[Mapping[str, Any], int] | None:
        if self._cells == self._cells_saved:
            return None  # nothing ran since the last autosave took the state
        state, step = self._take()
        # Taken: a second way out (a signal whose previous handler raises SystemExit, then the
        # exit hook) finds nothing new.
        self._cells_saved = self._cells
        return state, self.session.next_step(self.directory) if step is None else step

    # -- saving ---------------------------------------------------------------------------------

    def _take(self) -> tuple[dict[str, Any], int | None]:
        """The variables now and the user's step (None: the session numbers it)."""
        state = variables(self._namespace, self._saved_names)
        if self.step is None:
            return state, None
        value = self.step() if callable(self.step) else state[self.step]
        try:
            step = -1 if isinstance(value, bool) else operator.index(value)
        except TypeError:
            step = -1
        if step < 0:
            source = f"variable {self.step!r}" if isinstance(self.step, str) else "function's value"
            raise ConfigError(f"the step {source} is {value!r}, not a non-negative integer")
        # ours first: listing the directory is I/O, and a step this session saved needs none
        if not self._ours(step) and step in self.session.opened(self.directory).steps():
            raise ConfigError(
                f"step {step} is already in {self.directory} and was not saved in this "
                "session: it is not replaced (autosaves go on once the step moves on)"
            )
        return state, step

    def _unchanged(self, step: int) -> bool:
        """The user's step has not moved since the newest autosave, which did not fail."""
        last = self.last.handle if self.last is not None else None
        return last is not None and last.step == step and last.error is None

    def _ours(self, step: int) -> bool:
        return any(save.key == self.key and save.handle.step == step for save in self.session.saves)

    def _save(self, *, interrupted: bool) -> None:
        state, step = self._take()
        if not interrupted and step is not None and self._unchanged(step):
            return  # a cell that only looked (a plot, a status): the step it saved is still it
        before, self._cells_saved = self._cells_saved, self._cells
        try:  # marked as taken first: a signal's final save during this one has nothing new
            # After a cell there is no line of the user's for a warning to point at (it would
            # show the kernel's): the engine's warnings (steps set aside, fewer slots) go to the log.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                save = self.session.save(
                    state,
                    names=self._saved_names,
                    mode="autosave",
                    directory=self.directory,
                    step=step,
                    overwrite=step is not None and self._ours(step),
                )
        except BaseException:
            self._cells_saved = before
            raise
        finally:
            for record in caught:
                _log.warning("%s", record.message)
        self.last, self._last_at, self._last_wall = save, self.clock(), time.time()
        if self._pacer is not None:
            self._pacer.saved(self._last_at)
        handle = save.handle
        handle.committed.add_done_callback(lambda done: self._committed(handle, done))
        if interrupted:
            print(
                f"nbckpt: autosaving step {handle.step} of the interrupted cell to "
                f"{save.directory} (in the background)"
            )

    def _committed(self, handle: SaveHandle, done: Future[SaveRecord]) -> None:
        """On the persist thread: a failed autosave is told now, not ten minutes later."""
        error = done.exception()
        if error is not None:
            handle.reported = True  # told here: the next save does not raise it again
            self._report(f"step {handle.step} failed: {one_line(error)}")

    def _report(self, problem: str) -> None:
        """A failure: counted, kept for the status, and logged each time (under the cell)."""
        self.failures += 1
        self.last_error, self._error_wall = problem, time.time()
        _log.warning("nbckpt: autosave to %s: %s", self.directory, problem)

    # -- what it shows --------------------------------------------------------------------------

    def status(self) -> str:
        """What is autosaved, where and how often; the last save and when the next one is due."""
        what = " ".join(self.names) + (f" (step from {self.step!r})" if isinstance(self.step, str) else "")
        head = f"{what} to {self.directory} {self._pace()}"
        if not self.running:
            return f"nbckpt: stopped autosaving {head}"
        last = "none yet" if not self.failures else "none saved yet"
        if self.last is not None and self._last_wall is not None:
            handle = self.last.handle
            phase = "failed" if handle.error is not None else handle.phase
            last = f"step {handle.step} at {_clock(self._last_wall)} ({phase})"
        if self.failures and self._error_wall is not None:
            last += (
                f"\n  failed: {self.failures} time(s), the last at {_clock(self._error_wall)}: "
                f"{self.last_error}"
            )
        wait = self._last_at + self._interval_s() - self.clock()
        due = f"the first cell to end after {_clock(time.time() + wait)}" if wait > 0 else "the next cell"
        return (
            f"nbckpt: autosaving {head}\n  last: {last}\n  next: {due}; at once when a cell is "
            f"interrupted; a final save on kernel shutdown and SIGTERM (within "
            f"{format_duration(self.timeout_s)})"
        )

    def _interval_s(self) -> float:
        """Seconds from one autosave to the next (a schedule's before its first decision: none)."""
        if self._pacer is None:
            return self.every_s
        return self._pacer.interval.seconds if self._pacer.interval is not None else 0.0

    def _pace(self) -> str:
        if self._pacer is None:
            return f"every {format_duration(self.every_s)}"
        if self._pacer.interval is None:
            return f"by a save schedule for {self._pacer.schedule.source} (the first save measures the costs)"
        return f"by a save schedule: {self._pacer.interval.reason}"

    def __repr__(self) -> str:
        return self.status()


def _clock(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


def command(shell: InteractiveShell, args: argparse.Namespace) -> None:
    """``%ckpt_autosave``: start (replacing the running one), stop (``--off``) or show it."""
    running = Autosave.active(shell)
    given = {
        "--every": args.every,
        "--mtbf": args.mtbf,
        "--step": args.step,
        "-d": args.dir,
        "--timeout": args.timeout,
    }
    options = [flag for flag, value in given.items() if value is not None]
    if args.off and (args.names or options):
        raise UsageError("--off takes no variables or options: %ckpt_autosave --off")
    if not args.names and options:
        raise UsageError(f"name the variables to autosave: %ckpt_autosave model opt {options[0]} ...")
    if args.off:
        if running is not None:
            running.stop()
        print(
            f"nbckpt: stopped autosaving {' '.join(running.names)}"
            if running
            else "nbckpt: no autosave to stop"
        )
        return
    if not args.names:
        print(
            running.status()
            if running
            else "nbckpt: no autosave running; start one with %ckpt_autosave model opt --every 10min"
        )
        return
    if args.every is not None and args.mtbf is not None:
        raise UsageError("save every --every or as the schedule of --mtbf says, not both")
    schedule = SaveSchedule(args.mtbf) if args.mtbf is not None else None
    timing = {"every_s": args.every, "timeout_s": args.timeout}  # their defaults are Autosave's
    try:
        autosave = Autosave(
            args.names,
            shell=shell,
            directory=args.dir,
            step=args.step,
            schedule=schedule,
            **{name: value for name, value in timing.items() if value is not None},
        ).start()
    except ConfigError as exc:
        reraise(exc)
    if running is not None:
        print(f"nbckpt: replaced the autosave of {' '.join(running.names)}")
    print(autosave.status())
