"""IPython magics: ``%load_ext nbckpt``, then ``h = %ckpt_async model opt`` and friends.

Every magic is a thin face over :class:`nbckpt.Checkpointer` and answers ``--help`` (as does
``%ckpt_async?``). Bad input (unknown flag or variable, a value that holds no state, a bad
directory) raises :class:`~IPython.core.error.UsageError`; a save or restore that fails raises
:class:`CheckpointFailed`, a CheckpointError that IPython shows as one line, not a traceback.
Either one fails a papermill run.

The session keeps one Checkpointer per directory. Its options come from ``%ckpt_config`` (the
directory also from ``NBCKPT_DIR``) and ``--keep`` on a save. A Checkpointer's config is frozen:
when an option changes, the magics close it once its saves in flight have committed and open a
new one with the new config, and say so in one line. Warnings point at the cell that ran the
magic.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import html
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import IPython
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import MagicArgumentParser
from IPython.display import DisplayHandle, display
from IPython.utils.text import dedent

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import format_bytes, is_url, run_directory
from ..engine import CheckpointConfig, Checkpointer, SaveHandle, events_to_pandas, now_ns

if TYPE_CHECKING:
    from types import FrameType

    import pandas as pd
    import plotly.graph_objects as go
    from IPython.core.interactiveshell import InteractiveShell

    from ._lab import Lab

__all__ = ["MAGICS", "CheckpointFailed", "CheckpointMagics", "SaveStatus", "SessionDefaults", "load",
           "unload"]

F = TypeVar("F", bound=Callable[..., Any])

#: Environment variable that sets the session's default checkpoint directory.
DIR_ENV = "NBCKPT_DIR"
#: Set to 1 to make ``%ckpt_bench`` run in the foreground with static figures.
BATCH_ENV = "NBCKPT_BATCH"
# Frames in these are never "the user's code" that a warning should point at.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__ or "")) + os.sep
                      for module in (sys.modules[__package__], IPython, contextlib))
#: The Checkpointer options the session sets (``%ckpt_config``), as CheckpointConfig fields.
OPTIONS = ("keep", "max_inflight", "writer_threads", "verify", "capture_rng")


class CheckpointFailed(CheckpointError):
    """A magic's save, wait or restore failed. IPython shows it as one line, not a traceback;
    ``except CheckpointError`` catches it; the engine's error is its ``__cause__``."""

    def _render_traceback_(self) -> list[str]:
        # IPython's hook for exceptions that format themselves (a UsageError subclass would not
        # do: only UsageError itself gets the short form).
        return [f"{type(self).__name__}: {self}"]


def _one_line(exc: BaseException) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _reraise(exc: NbckptError) -> None:
    """An NbckptError as the one-line error a magic shows (ConfigError: the user's input)."""
    if isinstance(exc, ConfigError):
        raise UsageError(_one_line(exc)) from exc
    raise CheckpointFailed(_one_line(exc)) from exc


class _Decorator(Protocol):
    def __call__(self, func: F, /) -> F: ...


#: ``line_magic`` as a plain decorator (IPython types it as decorator-or-decorator-factory).
_line_magic = cast(_Decorator, line_magic)


def _parser(name: str, doc: str | None) -> MagicArgumentParser:
    """A plain-text argparse parser for ``%name`` (IPython's default formats help as reST)."""
    parser: MagicArgumentParser = MagicArgumentParser(  # type: ignore[no-untyped-call]
        f"%{name}", description=dedent(doc or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and do nothing")
    return parser


def _wants_help(line: str) -> bool:
    return any(token in ("-h", "--help") for token in line.split())


def _magic(*arguments: tuple[tuple[str, ...], dict[str, Any]],
           parser: Callable[[str | None], MagicArgumentParser] | None = None) -> _Decorator:
    """A line magic taking parsed arguments: ``--help`` prints the help; bad input is a UsageError.

    ``arguments`` are ``_arg(...)`` pairs; ``parser(docstring)`` builds the whole parser instead
    (on first use, so that a heavy import waits until the magic runs). The help becomes the
    magic's docstring when the extension loads.
    """

    def decorate(func: F) -> F:
        @functools.cache
        def build() -> MagicArgumentParser:
            if parser is not None:
                return parser(func.__doc__)
            built = _parser(func.__name__, func.__doc__)
            for flags, options in arguments:
                built.add_argument(*flags, **options)
            return built

        @functools.wraps(func)
        def magic(self: CheckpointMagics, line: str) -> Any:
            if _wants_help(line):
                print(build().format_help())
                return None
            args: argparse.Namespace = build().parse_argstring(line)  # type: ignore[no-untyped-call]
            return func(self, args)

        magic.parser = build  # type: ignore[attr-defined]
        return cast(F, magic)

    return decorate


def _arg(*flags: str, **options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return flags, options


def _display(obj: Any, **options: Any) -> Any:
    return display(obj, **options)  # type: ignore[no-untyped-call]


def _default_dir() -> str:
    return os.environ.get(DIR_ENV) or "checkpoints"


@dataclass
class SessionDefaults:
    """What ``%ckpt_config`` shows and sets; every directory's Checkpointer is opened with it."""

    dir: str = field(default_factory=_default_dir)
    run: str | None = None  # the run-* directory inside ``dir`` of ``%ckpt_config --new-run``
    keep: int | None = None
    max_inflight: int = 1
    writer_threads: int = 2
    verify: bool = True
    capture_rng: bool = False

    @property
    def directory(self) -> str:
        """Where saves go without ``-d``."""
        return self.run or self.dir


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


_DIR_ARG = _arg("-d", "--dir",
                help="checkpoint directory or s3:// URL (default: the one %%ckpt_config shows)")
_KEEP_ARG = _arg("--keep", type=_keep_value, default=argparse.SUPPRESS, metavar="K",
                 help="keep only the newest K checkpoints of this directory, 'none' keeps all "
                 "(default: %%ckpt_config's keep)")
_SAVE_ARGS = (
    _DIR_ARG,
    _arg("--step", type=_step_value,
         help="step number (default: one past the newest step in the directory)"),
    _KEEP_ARG,
    _arg("names", nargs="+", metavar="NAME",
         help="notebook variables to save: modules, optimizers, tensors, dicts, plain values"),
)


@dataclass
class _Save:
    """One save of this session, for ``%ckpt_status``, ``%ckpt_wait`` and ``%ckpt_timeline``."""

    key: str
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
        where = f" -> {self.directory}" if self.directory else ""
        head = f"nbckpt {self.mode} step {h.step} ({format_bytes(h.bytes)}){where}"
        error = h.error
        if error is not None:
            return "failed", f"{head}: failed: {_one_line(error)}"
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


def _rounded(value: float) -> float:
    """Three significant figures: what a table of timings can honestly show."""
    return float(f"{value:.3g}")


def _changes(changes: dict[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in changes.items())


def _short_names(keys: list[str]) -> dict[str, str]:
    """The last path part of each directory, or more of it where two would read the same."""
    names: dict[str, str] = {}
    for depth in range(1, 64):
        names = {key: "/".join(key.rstrip("/").split("/")[-depth:]) for key in keys}
        if len(set(names.values())) == len(names):
            break
    return names


@functools.cache
def _bench_parser(doc: str | None) -> MagicArgumentParser:
    """``%ckpt_bench``'s parser: ``nbckpt bench``'s options plus ``--static``."""
    from .. import bench

    parser = _parser("ckpt_bench", doc)
    bench.add_bench_arguments(parser)
    parser.add_argument("--static", action="store_true",
                        help="run in the foreground and show static figures, as in batch runs "
                        "(default: live lab in JupyterLab)")
    return parser


@magics_class
class CheckpointMagics(Magics):
    """The ``%ckpt_*`` magics and the session state they share."""

    def __init__(self, shell: InteractiveShell) -> None:
        super().__init__(shell)
        self.defaults = SessionDefaults()
        self.checkpointers: dict[str, Checkpointer] = {}
        self.saves: list[_Save] = []
        self.origin_ns = now_ns()
        self.lab: Lab | None = None  # the last one %ckpt_bench showed
        self._keep: dict[str, int | None] = {}  # --keep given on a save, per directory
        self._closed: list[Checkpointer] = []  # replaced ones: their events stay on the timeline
        self._lock = threading.RLock()

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

    def _warn_at_cell(self, warning: Warning | str) -> None:
        """Issue ``warning`` as if the user's cell had (the line a reader can act on): the frame
        that runs in the notebook's namespace, else the first one outside nbckpt and IPython."""
        target = self.shell.user_global_ns  # type: ignore[union-attr]
        frame: FrameType | None = sys._getframe(0)
        level, fallback = 1, 0
        while frame is not None and frame.f_globals is not target:
            if not fallback and not frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
                fallback = level
            frame = frame.f_back
            level += 1
        warnings.warn(warning, stacklevel=level if frame is not None else fallback or 2)

    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[None]:
        """Around a call into the engine: its warnings move to the user's cell; its errors become
        one line. (catch_warnings swaps process-wide state: only the magics, which run on the
        kernel's main thread, use it, and only for the length of one call.)"""
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                yield
        except NbckptError as exc:
            _reraise(exc)
        finally:  # shown before the error, if there is one
            for record in caught:
                self._warn_at_cell(record.message)

    def _wanted(self, key: str) -> dict[str, Any]:
        """The options a directory's Checkpointer should have now."""
        wanted = {name: getattr(self.defaults, name) for name in OPTIONS}
        if key in self._keep:
            wanted["keep"] = self._keep[key]
        return wanted

    def _in_flight(self, key: str) -> list[_Save]:
        return [save for save in self.saves if save.key == key and not save.handle.done()]

    def checkpointer(self, directory: str | None = None) -> Checkpointer:
        """The session's Checkpointer for ``directory``, opened with the session's options.

        When an option changed since it was opened, it is closed once its saves in flight have
        committed and a new one is opened with the changed config (one line says so).
        """
        directory = directory or self.defaults.directory
        key = self._key(directory)
        with self._lock:
            wanted = self._wanted(key)
            ckpt = self.checkpointers.get(key)
            if ckpt is not None:
                changes = {k: v for k, v in wanted.items() if getattr(ckpt.config, k) != v}
                if not changes:
                    return ckpt
                return self._reopen(key, changes)
            try:
                with self._engine_call():
                    ckpt = Checkpointer(directory, config=CheckpointConfig(mode="async", **wanted))
            except (UsageError, CheckpointFailed) as exc:
                raise UsageError(f"cannot checkpoint to {directory!r}: {exc}") from None
            self.checkpointers[key] = ckpt
            return ckpt

    def _reopen(self, key: str, changes: dict[str, Any]) -> Checkpointer:
        old = self.checkpointers[key]
        waited = len(self._in_flight(key))
        with self._engine_call():
            try:
                old.close()  # waits for the saves in flight: they commit with the old options
            finally:  # closed even when a save of it failed: the next magic opens a new one
                del self.checkpointers[key]
                self._closed.append(old)
            new = Checkpointer(old.directory, config=dataclasses.replace(old.config, **changes))
        self.checkpointers[key] = new
        after = f" after its {waited} save(s) in flight committed" if waited else ""
        print(f"nbckpt: {_changes(changes)} for {old.directory}: reopened its Checkpointer{after}")
        return new

    def _next_step(self, key: str, ckpt: Checkpointer) -> int:
        steps = ckpt.steps() + [save.handle.step for save in self.saves if save.key == key]
        return max(steps) + 1 if steps else 0

    def _save(self, args: argparse.Namespace, mode: str) -> SaveHandle:
        state = self._state(args.names)
        directory = args.dir or self.defaults.directory
        key = self._key(directory)
        if hasattr(args, "keep"):
            self._keep[key] = args.keep
        ckpt = self.checkpointer(directory)
        step = self._next_step(key, ckpt) if args.step is None else args.step
        with self._engine_call():
            # One Checkpointer per directory serves both magics: %ckpt_sync blocks per save.
            handle = ckpt.save(state, step=step, blocking=mode == "sync")
        save = _Save(key, ckpt.directory, mode, tuple(args.names), handle)
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

    def _finalise_all(self) -> None:
        # the commit callbacks may still be running: make every status final from here
        for save in self.saves:
            if save.handle.done():
                for live in list(save.live):
                    save.finalise(live)

    # -- magics -------------------------------------------------------------------------------

    @_line_magic
    @_magic(*_SAVE_ARGS)
    def ckpt_async(self, args: argparse.Namespace) -> SaveHandle:
        """Checkpoint notebook variables in the background and return the SaveHandle.

        The cell goes on once the state is copied; the status line under the cell changes to
        "committed" when the checkpoint is durable. In a training loop:
            if step % 50 == 0:
                %ckpt_async model opt --step {step}
        """
        return self._save(args, "async")

    @_line_magic
    @_magic(*_SAVE_ARGS)
    def ckpt_sync(self, args: argparse.Namespace) -> SaveHandle:
        """Checkpoint notebook variables and return once the checkpoint is durable."""
        return self._save(args, "sync")

    @_line_magic
    @_magic()
    def ckpt_wait(self, args: argparse.Namespace) -> None:
        """Wait until every save of this session has committed and print how many did.

        A save that failed in the background is raised here (once) as CheckpointFailed.
        """
        waited = sum(not save.handle.done() for save in self.saves)
        error: NbckptError | None = None
        try:
            for ckpt in list(self.checkpointers.values()):
                try:
                    ckpt.wait()
                except NbckptError as exc:
                    error = error or exc
        finally:
            self._finalise_all()
        committed = sum(save.handle.done() and save.handle.error is None for save in self.saves)
        failed = [save.handle.step for save in self.saves if save.handle.error is not None]
        line = (f"nbckpt: {committed} of this session's {len(self.saves)} save(s) committed "
                f"({waited} waited for)")
        if failed:
            line += f", {len(failed)} failed (step {', '.join(map(str, failed))})"
        print(line + "; nothing in flight")
        if error is not None:
            _reraise(error)

    @_line_magic
    @_magic()
    def ckpt_status(self, args: argparse.Namespace) -> pd.DataFrame:
        """A table of this session's saves: directory, step, mode, phase, MB, stall (ms),
        persist (s), write rate (GB/s) and error."""
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
                "MB": _rounded(handle.bytes / 1e6),
                "stall_ms": _rounded(handle.stall_s * 1e3),
                "persist_s": _rounded(record.persist_s) if record else None,
                "write_gbs": _rounded(record.write_gbs) if record else None,
                "error": _one_line(handle.error) if handle.error is not None else "",
            })
        columns = ["directory", "step", "mode", "variables", "phase", "MB", "stall_ms",
                   "persist_s", "write_gbs", "error"]
        return pd.DataFrame(rows, columns=columns)

    def timeline(self) -> pd.DataFrame:
        """Every event of this session's Checkpointers, ``start_s`` from the extension's load.

        Lanes are labelled by what was saved (the magic's mode and variables), with the
        directory's last path part in front when the session used several.
        """
        import pandas as pd

        opened = [*self._closed, *self.checkpointers.values()]
        keys = list(dict.fromkeys(self._key(ckpt.directory) for ckpt in opened))
        short = _short_names(keys)
        saves = {(save.key, save.handle.step): save for save in self.saves}
        frames = []
        for ckpt in opened:
            key = self._key(ckpt.directory)
            frame = events_to_pandas(ckpt.timeline.events, self.origin_ns)
            prefix = f"{short[key]}: " if len(keys) > 1 else ""
            labels = []
            for step in frame["step"]:
                save = saves.get((key, int(step))) if step is not None and step == step else None
                what = f"{save.mode} {' '.join(save.names)}" if save else short[key]
                labels.append(prefix + what if save else what)
            frame["label"] = labels
            frame["strategy"] = labels
            frames.append(frame)
        if not frames or all(frame.empty for frame in frames):
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True).sort_values("start_ns", ignore_index=True)

    @_line_magic
    @_magic()
    def ckpt_timeline(self, args: argparse.Namespace) -> go.Figure:
        """The plotly timeline of this session's saves: stalls, staging, persistence, commits.

        One pair of lanes (train, background) per kind of save: its mode and variables.
        """
        df = self.timeline()
        if df.empty:
            raise UsageError("no checkpoint events in this session yet: run %ckpt_async first")
        from ._figures import timeline_figure

        return timeline_figure(df)

    @_line_magic
    @_magic(
        _DIR_ARG,
        _arg("--step", type=_step_value,
             help="step to restore (default: the newest one that reads back intact)"),
        _arg("names", nargs="+", metavar="NAME", help="notebook variables to load in place"),
    )
    def ckpt_restore(self, args: argparse.Namespace) -> None:
        """Load a checkpoint into notebook variables and print the step restored.

        Modules, optimizers and tensors are loaded in place; plain values are rebound.
        "Newest" means the highest step number in the directory.
        """
        state = self._state(args.names)
        directory = args.dir or self.defaults.directory
        if not is_url(directory) and not os.path.isdir(directory):
            raise UsageError(f"no checkpoint directory {directory!r}")
        ckpt = self.checkpointer(directory)
        with self._engine_call():
            step = ckpt.restore(state, step=args.step)
        self.user_ns.update(state)
        print(f"nbckpt: restored step {step} from {ckpt.directory} into {', '.join(args.names)}")

    @_line_magic
    @_magic(
        _arg("-d", "--dir", help="default checkpoint directory or s3:// URL "
             f"(default: ${DIR_ENV}, else ./checkpoints)"),
        _arg("--new-run", action="store_true",
             help="save from now on into a new, empty run-* directory inside it (a fresh run "
             "whose steps cannot collide with earlier ones)"),
        _arg("--keep", type=_keep_value, default=argparse.SUPPRESS, metavar="K",
             help="keep only the newest K checkpoints of every directory, 'none' keeps all "
             "(default: none)"),
        _arg("--max-inflight", type=_positive, metavar="N",
             help="saves in flight at once, each with a host copy of the state (default: 1)"),
        _arg("--writer-threads", type=_positive, metavar="N",
             help="threads writing one checkpoint's files (default: 2)"),
        _arg("--verify", action=argparse.BooleanOptionalAction, default=None,
             help="check checksums when restoring (default: on)"),
        _arg("--capture-rng", action=argparse.BooleanOptionalAction, default=None,
             help="save and restore the RNG states (default: off)"),
        _arg("--reset", action="store_true", help="back to the defaults (and $NBCKPT_DIR)"),
    )
    def ckpt_config(self, args: argparse.Namespace) -> None:
        """Show or set this session's checkpoint options.

        %ckpt_config shows them; %ckpt_config -d /mnt/fast --keep 3 sets them. Changes apply to
        the directories already in use too: each one's Checkpointer is reopened with the new
        options (after its saves in flight commit). The save mode is the magic's choice
        (%ckpt_async or %ckpt_sync).
        """
        with self._lock:
            if args.reset:
                self.defaults = SessionDefaults()
                self._keep.clear()
            if args.dir is not None:
                self.defaults.dir, self.defaults.run = args.dir, None
            if hasattr(args, "keep"):
                self.defaults.keep = args.keep
                self._keep.clear()  # a session-wide keep overrides the per-directory ones
            for name in OPTIONS:
                value = getattr(args, name, None)
                if name != "keep" and value is not None:
                    setattr(self.defaults, name, value)
            if args.new_run:
                if is_url(self.defaults.dir):
                    raise UsageError(f"--new-run needs a local directory, not {self.defaults.dir}")
                try:
                    self.defaults.run = str(run_directory(self.defaults.dir))
                except ConfigError as exc:
                    raise UsageError(_one_line(exc)) from None
            for key in list(self.checkpointers):
                ckpt = self.checkpointers[key]
                changes = {k: v for k, v in self._wanted(key).items() if getattr(ckpt.config, k) != v}
                if not changes:
                    continue
                pending = len(self._in_flight(key))
                if pending:  # never block the cell here: the next magic on it reopens it
                    print(f"nbckpt: {_changes(changes)} for {ckpt.directory} applies once its "
                          f"{pending} save(s) in flight have committed, from its next save or restore")
                else:
                    self._reopen(key, changes)
        for name, value in {"directory": self.defaults.directory,
                            **asdict(self.defaults)}.items():
            print(f"{name:>15}: {value}")

    @_line_magic
    @_magic(parser=_bench_parser)
    def ckpt_bench(self, args: argparse.Namespace) -> Any:
        """Run checkpoint strategies side by side (the options of nbckpt bench).

        In JupyterLab or Notebook: shows the live lab and starts it in the background (running
        it again, or creating another Lab, stops and closes the previous one). In batch runs
        (papermill, nbconvert, terminal IPython, NBCKPT_BATCH=1 or --static): runs in the
        foreground, prints progress, shows static figures and returns the Comparison, which
        displays as its results table.
        """
        from .. import bench
        from ._lab import Lab, live_lab

        if args.static or _batch_run(self.shell):
            running = live_lab()
            if running is not None and running.running:
                running.close()  # one run at a time: both would write to the same directories
                print("nbckpt: stopped the running lab (its saves in flight committed)")
            with self._engine_call():
                comparison = bench.run_bench_from_args(args, None if args.quiet else print)
            if args.json is not None:
                comparison.to_json(args.json)
            from ._figures import stall_figure, timeline_figure

            _display(timeline_figure(comparison.timeline))
            _display(stall_figure(comparison.results))
            return comparison
        try:
            self.lab = Lab.from_args(args)
        except ConfigError as exc:
            raise UsageError(_one_line(exc)) from None
        _display(self.lab)
        self.lab.run()
        return None

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the lab of %ckpt_bench, finish saves in flight, release every directory."""
        if self.lab is not None and not self.lab.closed:
            self.lab.close()
        self.lab = None
        for ckpt in self.checkpointers.values():
            try:
                ckpt.close()
            except CheckpointError as exc:
                print(f"nbckpt: {_one_line(exc)}")
        self._closed.extend(self.checkpointers.values())
        self.checkpointers.clear()


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
_COMPARISON = ("nbckpt.bench._experiment", "Comparison")
#: The magics, by name.
MAGICS = ("ckpt_async", "ckpt_sync", "ckpt_wait", "ckpt_status", "ckpt_timeline", "ckpt_restore",
          "ckpt_config", "ckpt_bench")


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
