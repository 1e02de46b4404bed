"""IPython magics: ``%load_ext nbckpt``, then ``h = %ckpt_async model opt`` and friends.

Thin faces over the session's Checkpointers (:class:`~._session.Session`), each answering
``--help``. Bad input raises a UsageError, a failed save or restore :class:`~._cell.CheckpointFailed`:
both one line, both fail a papermill run. While the extension is loaded, the ``nbckpt`` logger's
warnings (failures in the background) show in the notebook.
"""

from __future__ import annotations

import argparse
import html
import logging
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, magics_class
from IPython.display import DisplayHandle, display

from .._errors import ConfigError, NbckptError
from .._util import format_bytes, is_url
from ..engine import SaveHandle
from ._autosave import Autosave
from ._autosave import command as autosave_command
from ._cell import Interrupted, OneLineWarnings, one_line, reraise
from ._magic_args import (
    AUTOSAVE_ARGS,
    DIR_ARG,
    SAVE_ARGS,
    arg,
    bench_parser,
    keep_value,
    magic,
    positive,
    step_value,
)
from ._session import DIR_ENV, OPTIONS, Save, Session, variables

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go
    from IPython.core.interactiveshell import InteractiveShell

    from ._lab import Lab

__all__ = ["MAGICS", "CheckpointMagics", "load", "unload"]

#: Set to 1 to make ``%ckpt_bench`` run in the foreground with static figures.
BATCH_ENV = "NBCKPT_BATCH"


def _display(obj: Any, **options: Any) -> Any:
    return display(obj, **options)  # type: ignore[no-untyped-call]


def _rounded(value: float) -> float:
    """Three significant figures: what a table of timings can honestly show."""
    return float(f"{value:.3g}")


class _NotebookLog(logging.Handler):
    """The ``nbckpt`` logger's warnings, to ``sys.stderr`` as it is when the record comes (the
    kernel's stream into the cell's output; a StreamHandler would keep the one at load)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:
            self.handleError(record)


def _stall_s(handle: SaveHandle) -> float:
    """All the time the save blocked its cell: the committed record's (a sync save's includes the
    write it waited for; the handle's ends where the write was handed to the background)."""
    if handle.done() and handle.error is None:
        return handle.committed.result().stall_s
    return handle.stall_s


class SaveStatus:
    """A compact, self-describing line for one save: staged, persisting, committed or failed."""

    def __init__(self, handle: SaveHandle, directory: str, mode: str) -> None:
        self.handle = handle
        self.directory = directory
        self.mode = mode

    def _parts(self) -> tuple[str, str]:
        h = self.handle
        where = f" -> {self.directory}" if self.directory else ""
        head = f"nbckpt {self.mode} step {h.step} ({format_bytes(h.bytes)}){where}"
        error = h.error
        if error is not None:
            return "failed", f"{head}: failed: {one_line(error)}"
        stall = f"stall {_stall_s(h) * 1e3:.1f} ms"
        if h.wait_s > 1e-4:  # the same names as the bench's: the stall, and its wait part
            stall += f" (wait for the earlier save {h.wait_s * 1e3:.1f} ms)"
        if h.committed.done():
            record = h.committed.result()
            return "committed", (
                f"{head}: committed · {stall} · persist {record.persist_s:.2f} s · "
                f"{record.write_gbs:.2f} GB/s"
            )
        return h.phase, f"{head}: {h.phase} · {stall} · writing in the background"

    def __repr__(self) -> str:
        return self._parts()[1]

    def _repr_html_(self) -> str:
        phase, text = self._parts()
        colour = {"committed": "#1a7f37", "failed": "#cf222e"}.get(phase, "#9a6700")
        return (
            f'<div class="nbckpt-save nbckpt-{phase}" style="font-family:monospace;'
            f'color:{colour}">{html.escape(text)}</div>'
        )


@magics_class
class CheckpointMagics(Magics):
    """The ``%ckpt_*`` magics; the state they share is :attr:`session`."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.session = Session(lambda: shell.user_global_ns)
        self.lab: Lab | None = None  # the last one %ckpt_bench showed
        self.log_handler = _NotebookLog()  # on the nbckpt logger while the extension is loaded

    @property
    def user_ns(self) -> dict[str, Any]:
        ns: dict[str, Any] = self.shell.user_ns  # type: ignore[union-attr]
        return ns

    def _state(self, names: list[str]) -> dict[str, Any]:
        try:
            return variables(self.user_ns, names)
        except ConfigError as exc:
            raise UsageError(one_line(exc)) from None

    def _save(self, args: argparse.Namespace, mode: str) -> SaveHandle:
        state = self._state(args.names)
        if hasattr(args, "keep"):
            self.session.keep_in(args.dir, args.keep)
        save = self.session.save(
            state, names=args.names, mode=mode, directory=args.dir, step=args.step, overwrite=args.overwrite
        )
        self._show(save)
        return save.handle

    def _show(self, save: Save) -> None:
        """Display the save's status and update it in place when it commits or fails."""
        save.shown_at = self.shell.execution_count  # type: ignore[union-attr]
        status = SaveStatus(save.handle, save.directory, save.mode)
        shown = _display(status, display_id=True)
        if isinstance(shown, DisplayHandle):
            live = (status, shown)
            save.live.append(live)
            # Runs on the persist thread; a display update is one iopub message, safe from there.
            # Registered even if the save is done by now: it may have committed after the status
            # was rendered, and then runs at once, here, showing "committed".
            save.handle.committed.add_done_callback(lambda _: save.finalise(live))

    def _display_handle(self, handle: SaveHandle) -> None:
        """How a SaveHandle displays: its live status, unless its magic just showed it."""
        for save in self.session.saves:
            if save.handle is handle:
                if save.shown_at != self.shell.execution_count:  # type: ignore[union-attr]
                    self._show(save)
                return
        _display(SaveStatus(handle, "", "save"))

    # -- magics -------------------------------------------------------------------------------

    @magic(*SAVE_ARGS)
    def ckpt_async(self, args: argparse.Namespace) -> SaveHandle:
        """Checkpoint notebook variables in the background and return the SaveHandle; the status
        line under the cell turns "committed" when it is durable. In a loop:
            %ckpt_async model opt --step {step}
        """
        return self._save(args, "async")

    @magic(*SAVE_ARGS)
    def ckpt_sync(self, args: argparse.Namespace) -> SaveHandle:
        """Checkpoint notebook variables and return once the checkpoint is durable."""
        return self._save(args, "sync")

    @magic()
    def ckpt_wait(self, args: argparse.Namespace) -> None:
        """Wait until every save of this session has committed and print how many did; one that
        failed in the background is raised here (once)."""
        saves = self.session.saves
        waited = sum(not save.handle.done() for save in saves)
        error = self.session.wait()
        committed = sum(save.handle.done() and save.handle.error is None for save in saves)
        failed = [save.handle.step for save in saves if save.handle.error is not None]
        line = f"nbckpt: {committed} of this session's {len(saves)} save(s) committed ({waited} waited for)"
        if failed:
            line += f", {len(failed)} failed (step {', '.join(map(str, failed))})"
        print(line + "; nothing in flight")
        if error is not None:
            reraise(error)

    @magic()
    def ckpt_status(self, args: argparse.Namespace) -> pd.DataFrame:
        """A table of this session's saves: stall (ms: all the time save() blocked the cell) and
        its wait for the earlier save, persist (s), GB/s; above it, the host memory held for
        staging (max-inflight copies of the state per directory, pinned with CUDA)."""
        import pandas as pd

        print(self.session.staging_memory())
        rows = []
        for save in self.session.saves:
            h = save.handle
            record = h.committed.result() if h.done() and h.error is None else None
            rows.append(
                (
                    save.directory,
                    h.step,
                    save.mode,
                    " ".join(save.names),
                    h.phase,
                    _rounded(h.bytes / 1e6),
                    _rounded(_stall_s(h) * 1e3),
                    _rounded(h.wait_s * 1e3),
                    _rounded(record.persist_s) if record else None,
                    _rounded(record.write_gbs) if record else None,
                    one_line(h.error) if h.error is not None else "",
                )
            )
        return pd.DataFrame(
            rows,
            columns=[
                "directory",
                "step",
                "mode",
                "variables",
                "phase",
                "MB",
                "stall_ms",
                "wait_ms",
                "persist_s",
                "write_gbs",
                "error",
            ],
        )

    @magic()
    def ckpt_timeline(self, args: argparse.Namespace) -> go.Figure:
        """The plotly timeline of this session's saves: a pair of lanes per mode and variables."""
        df = self.session.timeline()
        if df.empty:
            raise UsageError("no checkpoint events in this session yet: run %ckpt_async first")
        from ._timeline_figures import timeline_figure

        return timeline_figure(df, origin="this session started (%load_ext nbckpt)")

    @magic(*AUTOSAVE_ARGS)
    def ckpt_autosave(self, args: argparse.Namespace) -> None:
        """Autosave notebook variables as a cell ends once DURATION has passed, at once when one is
        interrupted, and finally on kernel shutdown, restart or SIGTERM. Alone: shows it.
        """
        autosave_command(self.shell, args)  # type: ignore[arg-type]

    @magic(
        DIR_ARG,
        arg(
            "--step", type=step_value, help="step to restore (default: the newest one that reads back intact)"
        ),
        arg("names", nargs="+", metavar="NAME", help="notebook variables to load in place"),
    )
    def ckpt_restore(self, args: argparse.Namespace) -> None:
        """Load a checkpoint into notebook variables (in place; plain values are rebound)."""
        state = self._state(args.names)
        directory = args.dir or self.session.defaults.directory
        if not is_url(directory) and not os.path.isdir(directory):
            raise UsageError(f"no checkpoint directory {directory!r}")
        ckpt = self.session.checkpointer(directory)
        listed = ", ".join(args.names)
        try:
            with self.session.engine_call():
                step = ckpt.restore(state, step=args.step)
        except KeyboardInterrupt:
            loaded = ckpt.loaded_step  # the engine never loads half a state
            if loaded is None:
                raise Interrupted(f"%ckpt_restore stopped before loading: {listed} unchanged") from None
            self.user_ns.update(state)  # the plain values too: all of the step, as it was loaded
            raise Interrupted(
                f"step {loaded} of {ckpt.directory} was loaded into {listed} before the interrupt took effect"
            ) from None
        self.user_ns.update(state)
        print(f"nbckpt: restored step {step} from {ckpt.directory} into {listed}")

    @magic(
        arg(
            "-d",
            "--dir",
            help=f"default checkpoint directory or s3:// URL (default: ${DIR_ENV}, else ./checkpoints)",
        ),
        arg(
            "--new-run",
            action="store_true",
            help="save from now on into a new, empty run-* directory inside it (a fresh run "
            "whose steps cannot collide with earlier ones)",
        ),
        arg(
            "--keep",
            type=keep_value,
            default=argparse.SUPPRESS,
            metavar="K",
            help="keep only the newest K checkpoints of every directory, 'none' keeps all (default: none)",
        ),
        arg(
            "--max-inflight",
            type=positive,
            metavar="N",
            help="saves in flight at once, each with a host copy of the state (default: 1)",
        ),
        arg(
            "--writer-threads",
            type=positive,
            metavar="N",
            help="threads writing one checkpoint's files (default: 2)",
        ),
        arg(
            "--verify",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="check checksums when restoring (default: on)",
        ),
        arg(
            "--capture-rng",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="save and restore the RNG states (default: off)",
        ),
        arg("--reset", action="store_true", help="back to the defaults (and $NBCKPT_DIR)"),
    )
    def ckpt_config(self, args: argparse.Namespace) -> None:
        """Show or set this session's options; a change reopens each directory's Checkpointer
        once its saves in flight have committed."""
        # --keep is absent unless given (its None means "keep all"); the others are None then
        options = {
            name: getattr(args, name)
            for name in OPTIONS
            if hasattr(args, name) and (name == "keep" or getattr(args, name) is not None)
        }
        self.session.configure(options, reset=args.reset, directory=args.dir, new_run=args.new_run)
        for name, value in self.session.settings():
            print(f"{name:>15}: {value}")

    @magic(parser=bench_parser)
    def ckpt_bench(self, args: argparse.Namespace) -> Any:
        """Run checkpoint strategies side by side (nbckpt bench's options): the live lab in
        JupyterLab; in batch runs (papermill, terminal IPython, NBCKPT_BATCH=1, --static) in the
        foreground with static figures, returning the Comparison. --ranks N runs it on N local
        ranks (torchrun): a pair of timeline lanes per strategy and rank, and the job's figures.
        """
        from ..bench import _internal as bench
        from ._lab import Lab, live_lab

        if args.static or _batch_run(self.shell):
            running = live_lab()
            if running is not None and running.running:
                running.close()  # one run at a time: both would write to the same directories
                print("nbckpt: stopped the running lab (its saves in flight committed)")
            if args.ranks > 1:
                comparison = _bench_on_ranks(args)
            else:
                with self.session.engine_call():
                    comparison = bench.run_bench_from_args(args, None if args.quiet else print)
                if args.json is not None:
                    comparison.to_json(args.json)
            _show_bench(comparison)
            return comparison
        try:
            self.lab = Lab.from_args(args)
        except ConfigError as exc:
            raise UsageError(one_line(exc)) from None
        _display(self.lab)
        self.lab.run()
        return None

    def close(self) -> None:
        """Stop the lab of %ckpt_bench, finish saves in flight, release every directory."""
        if self.lab is not None and not self.lab.closed:
            self.lab.close()
        self.lab = None
        self.session.close()


def _bench_on_ranks(args: argparse.Namespace) -> Any:
    """``%ckpt_bench --ranks N`` in the foreground: the ranks' progress printed as it comes;
    Kernel > Interrupt ends every rank (one line, no traceback), as does a rank that dies."""
    from ..bench import _internal as bench

    try:
        return bench.run_local_ranks(
            args.ranks,
            bench.passthrough(args, leave_out=("help", "static")),
            args.dir,
            on_event=lambda event: None,  # the figures come from every rank's events, gathered
            on_line=lambda line: print(line, end="" if line.endswith("\n") else "\n"),
            json_path=args.json,
            device=args.device,
        )
    except bench.ComparisonInterrupted as exc:
        raise Interrupted(str(exc)) from None
    except NbckptError as exc:  # a rank that died: CheckpointFailed, its one line
        reraise(exc)
        raise


def _show_bench(comparison: Any) -> None:
    """The static figures of a comparison: its timeline and stalls; on many ranks a pair of
    lanes per strategy and rank, the stall over ranks with the straggler, and the aggregate
    write rate of each checkpoint beside every rank writing raw at once."""
    from ._timeline_figures import rank_events, timeline_figure

    if not comparison.job:
        from ._result_figures import stall_figure

        _display(timeline_figure(comparison.timeline))
        _display(stall_figure(comparison.results))
        return
    from ..analysis import job_table, rank_rows
    from ..analysis._internal import checkpoint_rates
    from ._rank_figures import checkpoint_rate_figure, rank_stall_figure

    origin = "the run's first event on any rank"
    _display(timeline_figure(rank_events(comparison.rank_timeline), by_rank=True, origin=origin))
    _display(rank_stall_figure(rank_rows(comparison), job_table(comparison)))
    floor = float(comparison.job.get("floors", {}).get("concurrent_write_gbs") or "nan")
    _display(checkpoint_rate_figure(checkpoint_rates(comparison), floor))


def _batch_run(shell: Any) -> bool:
    """True where a live widget would never be seen: JupyterLab and Notebook mark their execute
    requests with ``recordTiming`` metadata, nbclient (papermill) and terminal IPython do not."""
    if os.environ.get(BATCH_ENV, "") not in ("", "0"):
        return True
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return True
    parent = kernel.get_parent() or {}
    return "recordTiming" not in parent.get("metadata", {})


#: Shown as its results table when it is a cell's value (registered by name: no import).
_COMPARISON = ("nbckpt.bench._comparison", "Comparison")
#: The magics, by name.
MAGICS = tuple(CheckpointMagics.magics["line"])


def _comparison_text(comparison: Any, printer: Any, cycle: bool) -> None:
    printer.text(comparison.table())


def load(ipython: InteractiveShell) -> None:
    """Register the magics once per shell (loading twice is a no-op)."""
    if isinstance(ipython.magics_manager.registry.get(CheckpointMagics.__name__), CheckpointMagics):
        return
    for name in MAGICS:  # %ckpt_x? shows the same plain-text help as %ckpt_x --help
        method = getattr(CheckpointMagics, name)
        method.__doc__ = method.parser().format_help()
    magics = CheckpointMagics(ipython)
    ipython.register_magics(magics)
    formatters: Any = ipython.display_formatter
    formatters.ipython_display_formatter.for_type(SaveHandle, magics._display_handle)
    formatters.formatters["text/plain"].for_type_by_name(*_COMPARISON, _comparison_text)
    logging.getLogger("nbckpt").addHandler(magics.log_handler)
    warnings.showwarning = OneLineWarnings(warnings.showwarning)


def unload(ipython: InteractiveShell) -> None:
    """Finish saves in flight, release directories and remove the magics."""
    magics = ipython.magics_manager.registry.pop(CheckpointMagics.__name__, None)
    if not isinstance(magics, CheckpointMagics):
        return
    autosave = Autosave.active(ipython)
    if autosave is not None:  # its hooks, signal handlers and exit hook go with the extension
        autosave.stop()
    magics.close()  # its failures are still shown: the handler goes last
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    formatters: Any = ipython.display_formatter
    formatters.ipython_display_formatter.type_printers.pop(SaveHandle, None)
    plain = formatters.formatters["text/plain"]
    plain.deferred_printers.pop(_COMPARISON, None)
    plain.type_printers = {
        k: v for k, v in plain.type_printers.items() if (k.__module__, k.__name__) != _COMPARISON
    }
    logging.getLogger("nbckpt").removeHandler(magics.log_handler)
    if isinstance(warnings.showwarning, OneLineWarnings):  # unless another wrapped it since
        warnings.showwarning = warnings.showwarning.previous
