"""IPython magics: ``%load_ext nbckpt``, then ``h = %ckpt_async model opt`` and friends.

Every magic is a thin face over :class:`nbckpt.Checkpointer`; ``%ckpt_async?`` shows its help.
Bad input (unknown flag or variable, a value that holds no state, a bad directory) raises
:class:`~IPython.core.error.UsageError` (one line, no traceback); failures of a save or restore
raise :class:`nbckpt.CheckpointError`, so a papermill run of a notebook whose magic fails fails.

The session keeps one :class:`Checkpointer` per directory; ``%ckpt_config`` sets its defaults
(the directory also comes from ``NBCKPT_DIR``).
"""

from __future__ import annotations

import argparse
import functools
import html
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import (
    MagicArgumentParser,
    argument,
    magic_arguments,
    parse_argstring,
)
from IPython.display import DisplayHandle, display

from ._dcp import is_url
from ._engine import Checkpointer, SaveHandle
from ._errors import CheckpointError, ConfigError
from ._timeline import events_to_pandas, now_ns

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go
    from IPython.core.interactiveshell import InteractiveShell

    from .widgets import Lab

F = TypeVar("F", bound=Callable[..., Any])

#: Environment variable that sets the session's default checkpoint directory.
DIR_ENV = "NBCKPT_DIR"
#: Set to 1 to make ``%ckpt_bench`` run in the foreground with static figures.
BATCH_ENV = "NBCKPT_BATCH"


# IPython's argument decorators, parse_argstring and display() carry no annotations: these
# typed views of them keep this module under mypy --strict.
def _arg(*flags: str, **options: Any) -> Any:
    """One ``magic_arguments.argument``."""
    return argument(*flags, **options)  # type: ignore[no-untyped-call]


class _Decorator(Protocol):
    def __call__(self, func: F, /) -> F: ...


def _arguments(*decorators: Any) -> _Decorator:
    """``@magic_arguments()`` with the given ``_arg(...)``s, as if stacked in this order."""

    def apply(func: F) -> F:
        for decorator in [magic_arguments(), *decorators][::-1]:  # type: ignore[no-untyped-call]
            func = decorator(func)
        return func

    return apply


#: ``line_magic`` as a plain decorator (IPython types it as decorator-or-decorator-factory).
_line_magic = cast(_Decorator, line_magic)


def _parse(magic: Callable[..., Any], line: str) -> argparse.Namespace:
    args: argparse.Namespace = parse_argstring(magic, line)  # type: ignore[no-untyped-call]
    return args


def _display(obj: Any, **options: Any) -> Any:
    return display(obj, **options)  # type: ignore[no-untyped-call]


def _default_dir() -> str:
    return os.environ.get(DIR_ENV) or "checkpoints"


@dataclass
class SessionDefaults:
    """What ``%ckpt_config`` shows and sets; applied to the session's Checkpointers."""

    dir: str = field(default_factory=_default_dir)
    keep: int | None = None
    max_inflight: int = 1
    writer_threads: int = 2
    verify: bool = True
    capture_rng: bool = False


def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, not {text!r}")
    return value


def _keep_value(text: str) -> int | None:
    """argparse type of ``--keep``: a positive integer, or ``none`` for keeping everything."""
    if text.lower() in ("none", "all"):
        return None
    return _integer(text, 1, "a positive integer or 'none'")


def _positive(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def _step_value(text: str) -> int:
    return _integer(text, 0, "a non-negative integer")


_DIR_ARG = _arg("-d", "--dir", help="checkpoint directory or s3:// URL (default: %%ckpt_config)")
_KEEP_ARG = _arg("--keep", type=_keep_value, default=argparse.SUPPRESS,
                 help="keep only the newest K checkpoints ('none': all)")
#: The arguments ``%ckpt_async`` and ``%ckpt_sync`` share.
_save_arguments = _arguments(
    _DIR_ARG,
    _arg("--step", type=_step_value,
         help="step number (default: one past the newest step in the directory)"),
    _KEEP_ARG,
    _arg("names", nargs="+", metavar="NAME",
         help="notebook variables to save: modules, optimizers, tensors, dicts, plain values"),
)


@dataclass
class _Save:
    """One save of this session, for ``%ckpt_status``."""

    directory: str
    mode: str
    names: tuple[str, ...]
    handle: SaveHandle
    shown_at: int = 0  # execution count of the cell whose magic displayed it
    live: list[tuple[SaveStatus, Any]] = field(default_factory=list)  # (status, DisplayHandle)

    def finalise(self, live: tuple[SaveStatus, Any]) -> None:
        """Show the save's final state in one of its live displays (at most once)."""
        try:
            self.live.remove(live)
        except ValueError:
            return  # the commit callback and %ckpt_wait raced; the other one updated it
        status, shown = live
        shown.update(status)


class SaveStatus:
    """A compact, self-describing line for one save: staged, persisting, committed or failed."""

    def __init__(self, handle: SaveHandle, directory: str, mode: str) -> None:
        self.handle = handle
        self.directory = directory
        self.mode = mode

    def _parts(self) -> tuple[str, str]:
        h = self.handle
        size = f"{h.bytes / 1e6:.1f} MB" if h.bytes < 1e9 else f"{h.bytes / 1e9:.2f} GB"
        where = f" -> {self.directory}" if self.directory else ""
        head = f"nbckpt {self.mode} step {h.step} ({size}){where}"
        error = h.error
        if error is not None:
            return "failed", f"{head}: failed: {error}"
        if h.committed.done():
            record = h.committed.result()
            return "committed", (
                f"{head}: committed · stall {record.stall_s * 1e3:.1f} ms · "
                f"persist {record.persist_s:.2f} s · {record.write_gbs:.2f} GB/s"
            )
        return h.phase, (
            f"{head}: {h.phase} · stall {h.stall_s * 1e3:.1f} ms · writing in the background"
        )

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
    """The ``%ckpt_*`` magics and the session state they share."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.defaults = SessionDefaults()
        self.checkpointers: dict[str, Checkpointer] = {}
        self.saves: list[_Save] = []
        self.origin_ns = now_ns()
        self.labs: list[Lab] = []

    # -- helpers ------------------------------------------------------------------------------

    @property
    def user_ns(self) -> dict[str, Any]:
        ns: dict[str, Any] = self.shell.user_ns  # type: ignore[union-attr]
        return ns

    def _state(self, names: list[str]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for name in names:
            if not name.isidentifier():
                raise UsageError(f"{name!r} is not a variable name")
            if name not in self.user_ns:
                raise UsageError(f"no variable named {name!r} in this notebook")
            state[name] = self.user_ns[name]
        return state

    def _key(self, directory: str) -> str:
        return directory if is_url(directory) else os.path.abspath(directory)

    def checkpointer(self, directory: str | None, keep: int | None = None, *,
                     keep_given: bool = False) -> Checkpointer:
        """The session's Checkpointer for ``directory`` (created once, reused afterwards)."""
        directory = directory or self.defaults.dir
        key = self._key(directory)
        ckpt = self.checkpointers.get(key)
        if ckpt is None:
            try:
                ckpt = Checkpointer(
                    directory,
                    mode="async",
                    keep=keep if keep_given else self.defaults.keep,
                    max_inflight=self.defaults.max_inflight,
                    writer_threads=self.defaults.writer_threads,
                    verify=self.defaults.verify,
                    capture_rng=self.defaults.capture_rng,
                )
            except (CheckpointError, ConfigError, OSError) as exc:
                raise UsageError(f"cannot checkpoint to {directory!r}: {exc}") from None
            self.checkpointers[key] = ckpt
        elif keep_given:
            ckpt.config.keep = keep  # a changed option never recreates the Checkpointer
        return ckpt

    def _next_step(self, ckpt: Checkpointer) -> int:
        steps = ckpt.steps() + [h.step for h in ckpt.handles]
        return max(steps) + 1 if steps else 0

    def _save(self, line: str, magic: Callable[..., Any], mode: str) -> SaveHandle:
        args = _parse(magic, line)
        state = self._state(args.names)
        keep_given = hasattr(args, "keep")
        ckpt = self.checkpointer(args.dir, getattr(args, "keep", None), keep_given=keep_given)
        step = self._next_step(ckpt) if args.step is None else args.step
        try:
            # One Checkpointer per directory serves both magics: %ckpt_sync blocks per save.
            handle = ckpt.save(state, step=step, blocking=mode == "sync")
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        save = _Save(ckpt.directory, mode, tuple(args.names), handle)
        self.saves.append(save)
        self._show(save)
        return handle

    def _show(self, save: _Save) -> None:
        """Display the save's status and update it in place when it commits or fails."""
        save.shown_at = self.shell.execution_count  # type: ignore[union-attr]
        status = SaveStatus(save.handle, save.directory, save.mode)
        shown = _display(status, display_id=True)
        if isinstance(shown, DisplayHandle) and not save.handle.done():
            live = (status, shown)
            save.live.append(live)
            # Runs on the persist thread; a display update is one iopub message, safe from there.
            save.handle.committed.add_done_callback(lambda _: save.finalise(live))

    def _display_handle(self, handle: SaveHandle) -> None:
        """How a SaveHandle displays: its live status, unless its magic just showed it."""
        for save in self.saves:
            if save.handle is handle:
                if save.shown_at != self.shell.execution_count:  # type: ignore[union-attr]
                    self._show(save)
                return
        _display(SaveStatus(handle, "", "save"))

    def _wait_all(self) -> int:
        committed = 0
        try:
            for ckpt in self.checkpointers.values():
                committed += len(ckpt.wait())
        finally:
            # the commit callbacks may still be running: make every status final from here
            for save in self.saves:
                if save.handle.done():
                    for live in list(save.live):
                        save.finalise(live)
        return committed

    # -- magics -------------------------------------------------------------------------------

    @_line_magic
    @_save_arguments
    def ckpt_async(self, line: str) -> SaveHandle:
        """Checkpoint notebook variables in the background; returns the SaveHandle.

        The cell continues as soon as the state is copied; the status line below the cell
        updates when the checkpoint has committed. In a loop:
        ``if step % 50 == 0: %ckpt_async model opt --step {step}``.
        """
        return self._save(line, self.ckpt_async, "async")

    @_line_magic
    @_save_arguments
    def ckpt_sync(self, line: str) -> SaveHandle:
        """Checkpoint notebook variables and block until the checkpoint is durable."""
        return self._save(line, self.ckpt_sync, "sync")

    @_line_magic
    @_arguments()
    def ckpt_wait(self, line: str) -> None:
        """Wait for every save of this session to commit; raises CheckpointError if one failed."""
        _parse(self.ckpt_wait, line)
        committed = self._wait_all()
        print(f"nbckpt: {committed} save(s) committed, nothing in flight")

    @_line_magic
    @_arguments()
    def ckpt_status(self, line: str) -> pd.DataFrame:
        """A table of this session's saves: directory, step, mode, phase, stall, persist, GB/s."""
        _parse(self.ckpt_status, line)
        import pandas as pd

        rows = []
        for save in self.saves:
            handle = save.handle
            record = handle.committed.result() if handle.done() and handle.error is None else None
            rows.append({
                "directory": save.directory,
                "step": handle.step,
                "mode": save.mode,
                "variables": " ".join(save.names),
                "phase": handle.phase,
                "MB": handle.bytes / 1e6,
                "stall_ms": handle.stall_s * 1e3,
                "persist_s": record.persist_s if record else None,
                "write_gbs": record.write_gbs if record else None,
                "error": str(handle.error) if handle.error is not None else "",
            })
        columns = ["directory", "step", "mode", "variables", "phase", "MB", "stall_ms",
                   "persist_s", "write_gbs", "error"]
        return pd.DataFrame(rows, columns=columns)

    def timeline(self) -> pd.DataFrame:
        """Every event of this session's Checkpointers, ``start_s`` from the extension's load."""
        import pandas as pd

        frames = []
        for ckpt in self.checkpointers.values():
            frame = events_to_pandas(ckpt.timeline.events, self.origin_ns)
            frame["label"] = ckpt.directory
            frame["strategy"] = ckpt.directory
            frames.append(frame)
        if not frames:
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True).sort_values("start_ns", ignore_index=True)

    @_line_magic
    @_arguments()
    def ckpt_timeline(self, line: str) -> go.Figure:
        """The plotly timeline of this session's saves: stalls, staging, persistence, commits."""
        _parse(self.ckpt_timeline, line)
        df = self.timeline()
        if df.empty:
            raise UsageError("no checkpoint events in this session yet: run %ckpt_async first")
        from .plots import timeline_figure

        return timeline_figure(df)

    @_line_magic
    @_arguments(
        _DIR_ARG,
        _arg("--step", type=_step_value, help="step to restore (default: the newest valid one)"),
        _arg("names", nargs="+", metavar="NAME", help="notebook variables to load in place")
    )
    def ckpt_restore(self, line: str) -> None:
        """Load a checkpoint into notebook variables in place and print the step restored.

        Modules, optimizers and tensors are loaded in place; plain values are rebound.
        """
        args = _parse(self.ckpt_restore, line)
        state = self._state(args.names)
        directory = args.dir or self.defaults.dir
        if not is_url(directory) and not os.path.isdir(directory):
            raise UsageError(f"no checkpoint directory {directory!r}")
        ckpt = self.checkpointer(directory)
        try:
            step = ckpt.restore(state, step=args.step)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        self.user_ns.update(state)
        print(f"nbckpt: restored step {step} from {ckpt.directory} into {', '.join(args.names)}")

    @_line_magic
    @_arguments(
        _arg("-d", "--dir", help="default checkpoint directory or s3:// URL"),
        _KEEP_ARG,
        _arg("--max-inflight", type=_positive, help="saves in flight at once (new directories)"),
        _arg("--writer-threads", type=_positive, help="threads writing one checkpoint's files"),
        _arg("--verify", action=argparse.BooleanOptionalAction, default=None,
             help="check checksums before restoring"),
        _arg("--capture-rng", action=argparse.BooleanOptionalAction, default=None,
             help="save and restore the RNG states"),
        _arg("--reset", action="store_true", help="back to the defaults (and NBCKPT_DIR)"),
    )
    def ckpt_config(self, line: str) -> None:
        """Show or set this session's defaults; changes apply to its open Checkpointers too.

        ``%ckpt_config`` shows them; ``%ckpt_config -d /mnt/fast --keep 3`` sets them.
        The save mode is chosen by the magic (``%ckpt_async`` or ``%ckpt_sync``).
        """
        args = _parse(self.ckpt_config, line)
        if args.reset:
            self.defaults = SessionDefaults()
        given = {
            name: getattr(args, name)
            for name in ("dir", "keep", "max_inflight", "writer_threads", "verify", "capture_rng")
            if getattr(args, name, None) is not None or (name == "keep" and hasattr(args, "keep"))
        }
        for name, value in given.items():
            setattr(self.defaults, name, value)
        for ckpt in self.checkpointers.values():
            # dir names new saves' directory; max_inflight sizes staging buffers allocated once
            for name in given.keys() - {"dir", "max_inflight"}:
                setattr(ckpt.config, name, given[name])
        for name, value in asdict(self.defaults).items():
            print(f"{name:>15}: {value}")

    @_line_magic
    def ckpt_bench(self, line: str) -> Any:
        """Run checkpoint strategies side by side (the options of ``nbckpt bench``).

        Interactive (JupyterLab, Notebook): shows the live Lab and starts it in the background.
        Batch (papermill, nbconvert, terminal IPython, NBCKPT_BATCH=1 or --static): runs in
        the foreground, prints progress, shows the static figures and returns the Comparison
        (which displays as its results table).
        """
        args: argparse.Namespace = _bench_parser().parse_argstring(line)  # type: ignore[no-untyped-call]
        from . import experiment

        if args.static or _batch_run(self.shell):
            try:
                comparison = experiment.run_from_args(args, None if args.quiet else print)
            except ConfigError as exc:
                raise UsageError(str(exc)) from None
            if args.json is not None:
                comparison.to_json(args.json)
            from .plots import stall_figure, timeline_figure

            _display(timeline_figure(comparison.timeline))
            _display(stall_figure(comparison.results))
            return comparison
        from .widgets import Lab

        try:
            lab = Lab.from_args(args)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        self.labs.append(lab)
        _display(lab)
        lab.run()
        return None

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop labs, finish saves in flight and release every directory (on unload)."""
        for lab in self.labs:
            lab.stop()
        self.labs.clear()
        for ckpt in self.checkpointers.values():
            try:
                ckpt.close()
            except CheckpointError as exc:
                print(f"nbckpt: {exc}")
        self.checkpointers.clear()


@functools.cache
def _bench_parser() -> MagicArgumentParser:
    """``%ckpt_bench``'s parser: ``nbckpt bench``'s options plus ``--static``."""
    from . import experiment

    parser = MagicArgumentParser(  # type: ignore[no-untyped-call]
        "%ckpt_bench", description=_BENCH_DOC
    )
    experiment.add_arguments(parser)
    parser.add_argument("--static", action="store_true",
                        help="run in the foreground and show static figures (as in batch runs)")
    return parser


_BENCH_DOC = CheckpointMagics.ckpt_bench.__doc__


def _batch_run(shell: Any) -> bool:
    """True outside an interactive Jupyter frontend: where a live widget would never be seen.

    JupyterLab and Notebook mark their execute requests with ``recordTiming`` metadata;
    papermill/nbconvert (nbclient) and terminal IPython do not.
    """
    if os.environ.get(BATCH_ENV, "") not in ("", "0"):
        return True
    kernel = getattr(shell, "kernel", None)
    if kernel is None:
        return True
    parent = kernel.get_parent() or {}
    return "recordTiming" not in parent.get("metadata", {})


#: Shown as its results table when it is a cell's value (registered by name: no import).
_COMPARISON = ("nbckpt.experiment", "Comparison")


def _comparison_text(comparison: Any, printer: Any, cycle: bool) -> None:
    printer.text(comparison.table())


def load(ipython: InteractiveShell) -> None:
    """Register the magics once per shell (loading twice is a no-op)."""
    if isinstance(ipython.magics_manager.registry.get(CheckpointMagics.__name__), CheckpointMagics):
        return
    # %ckpt_bench? shows nbckpt bench's options, which live with the experiment runner
    CheckpointMagics.ckpt_bench.__doc__ = _bench_parser().format_help()
    magics = CheckpointMagics(ipython)
    ipython.register_magics(magics)
    formatters: Any = ipython.display_formatter
    formatters.ipython_display_formatter.for_type(SaveHandle, magics._display_handle)
    formatters.formatters["text/plain"].for_type_by_name(*_COMPARISON, _comparison_text)


def unload(ipython: InteractiveShell) -> None:
    """Finish saves in flight, release directories and remove the magics."""
    magics = ipython.magics_manager.registry.pop(CheckpointMagics.__name__, None)
    if not isinstance(magics, CheckpointMagics):
        return
    magics.close()
    for kind, names in magics.magics.items():
        for name in names:
            ipython.magics_manager.magics[kind].pop(name, None)
    formatters: Any = ipython.display_formatter
    formatters.ipython_display_formatter.type_printers.pop(SaveHandle, None)
    plain = formatters.formatters["text/plain"]
    plain.deferred_printers.pop(_COMPARISON, None)
    plain.type_printers = {k: v for k, v in plain.type_printers.items()
                           if (k.__module__, k.__name__) != _COMPARISON}


__all__ = ["CheckpointMagics", "SaveStatus", "SessionDefaults", "load", "unload"]
