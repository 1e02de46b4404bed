"""One notebook session's checkpointing, behind the magics: its options (``%ckpt_config``), one
Checkpointer per directory, its saves, and the timeline of them all.

A Checkpointer's config is frozen: when an option changes, the session reopens the directory's
Checkpointer once its saves in flight have committed (one line says so), as it does one closed
under it (``nbckpt.close_all()``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from IPython.core.error import UsageError

from .._errors import CheckpointError, ConfigError, NbckptError
from .._util import check_path, could_create, format_bytes, is_url, run_directory
from ..engine import CheckpointConfig, Checkpointer, SaveHandle
from ..engine._internal import events_to_pandas, now_ns, open_fsspec
from ._cell import CheckpointFailed, Interrupted, engine_call, one_line

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "DIR_ENV",
    "OPTIONS",
    "Save",
    "Session",
    "SessionDefaults",
    "usable_directory",
    "variables",
]

_log = logging.getLogger("nbckpt")

#: Environment variable that sets the session's default checkpoint directory.
DIR_ENV = "NBCKPT_DIR"
#: The Checkpointer options the session sets (``%ckpt_config``), as CheckpointConfig fields.
OPTIONS = ("keep", "max_inflight", "writer_threads", "verify", "capture_rng")


@dataclass(kw_only=True)
class SessionDefaults:
    """What ``%ckpt_config`` shows and sets; every directory's Checkpointer is opened with it."""

    dir: str = field(default_factory=lambda: os.environ.get(DIR_ENV) or "checkpoints")
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


def _configured(
    base: SessionDefaults, options: dict[str, Any], directory: str | None, *, new_run: bool
) -> SessionDefaults:
    """``base`` with ``options`` set, saving into ``directory`` (a new one drops the run) and,
    with ``new_run``, into a fresh run directory inside it (made now)."""
    defaults = dataclasses.replace(base, **options)
    if directory is not None:
        defaults.dir, defaults.run = directory, None
    if new_run:
        if is_url(defaults.dir):
            raise UsageError(f"--new-run needs a local directory, not {defaults.dir}")
        try:
            defaults.run = str(run_directory(defaults.dir))
        except ConfigError as exc:
            raise UsageError(one_line(exc)) from None
    return defaults


def variables(namespace: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The notebook variables ``names`` (ConfigError in one line naming the first one missing)."""
    state: dict[str, Any] = {}
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{name!r} is not a variable name")
        if name not in namespace:
            raise ConfigError(f"no variable named {name!r} in this notebook")
        state[name] = namespace[name]
    return state


def usable_directory(directory: str) -> None:
    """Refuse, in one line, a directory no save could use (under a file, not writable, a URL of
    no known kind) when it is set, not at the next save; nothing is created."""
    try:
        check_path(directory, "directory")
        if is_url(directory):
            open_fsspec(directory)  # the protocol and its library; reaching it is the save's
            return
    except ConfigError as exc:
        raise UsageError(f"cannot checkpoint to {directory!r}: {one_line(exc)}") from None
    reason = could_create(directory)
    if reason is not None:
        raise UsageError(f"cannot checkpoint to {directory!r}: {reason}")


@dataclass(kw_only=True)
class Save:
    """One save of this session, for ``%ckpt_status``, ``%ckpt_wait`` and ``%ckpt_timeline``."""

    key: str
    directory: str
    mode: str
    names: tuple[str, ...]
    handle: SaveHandle
    shown_at: int = 0  # execution count of the cell whose magic displayed it
    live: list[tuple[Any, Any]] = field(default_factory=list)  # (SaveStatus, DisplayHandle)

    def finalise(self, live: tuple[Any, Any]) -> None:
        """Show the save's final state in one of its live displays (at most once)."""
        try:
            self.live.remove(live)
        except ValueError:
            return  # the commit callback and %ckpt_wait raced; the other one updated it
        status, shown = live
        shown.update(status)


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


class Session:
    """This session's options, Checkpointers and saves; engine warnings point at the cell that
    runs in ``user_globals()``, the notebook's namespace."""

    def __init__(self, user_globals: Callable[[], dict[str, Any]]) -> None:
        self.defaults = SessionDefaults()
        self.checkpointers: dict[str, Checkpointer] = {}
        self.saves: list[Save] = []
        self.origin_ns = now_ns()
        self._user_globals = user_globals
        self._keep: dict[str, int | None] = {}  # --keep given on a save, per directory
        self._closed: list[Checkpointer] = []  # replaced ones: their events stay on the timeline
        self._retiring: list[Checkpointer] = []  # no longer the default's, closed once their saves commit
        self._lock = threading.RLock()

    def engine_call(self) -> AbstractContextManager[None]:
        """Around a call into the engine (see :func:`._cell.engine_call`)."""
        return engine_call(self._user_globals)

    def key(self, directory: str | None) -> str:
        """The session's name for ``directory`` (default: the session's)."""
        directory = directory or self.defaults.directory
        return directory if is_url(directory) else os.path.abspath(directory)

    def checkpointer(self, directory: str | None = None) -> Checkpointer:
        """The session's Checkpointer for ``directory`` with the session's options now (reopened
        once its saves in flight have committed when they changed)."""
        directory = directory or self.defaults.directory
        key = self.key(directory)
        with self._lock:
            self._sweep()
            ckpt = self.checkpointers.get(key)
            if ckpt is not None:
                changes = self._changed(key, ckpt)
                return self._reopen(key, changes) if changes or ckpt.closed else ckpt
            try:
                with self.engine_call():
                    config = CheckpointConfig(mode="async", **self._wanted(key))
                    ckpt = Checkpointer(directory, config=config)
            except (UsageError, CheckpointFailed) as exc:
                raise UsageError(f"cannot checkpoint to {directory!r}: {exc}") from None
            self.checkpointers[key] = ckpt
            return ckpt

    def opened(self, directory: str | None = None) -> Checkpointer:
        """The directory's Checkpointer as it is, opened if there is none or it was closed (never
        reopened for changed options: a signal's final save may be using it)."""
        ckpt = self.checkpointers.get(self.key(directory))
        return ckpt if ckpt is not None and not ckpt.closed else self.checkpointer(directory)

    def keep_in(self, directory: str | None, keep: int | None) -> None:
        """``--keep`` of a save: how many checkpoints ``directory`` keeps from now on."""
        self._keep[self.key(directory)] = keep

    def save(
        self,
        state: dict[str, Any],
        *,
        names: Sequence[str],
        mode: str,
        directory: str | None = None,
        step: int | None = None,
        overwrite: bool = False,
    ) -> Save:
        """Save ``state`` (``mode`` ``sync`` blocks until it is durable) and record the save."""
        key = self.key(directory)
        ckpt = self.checkpointer(directory)
        step = self.next_step(directory) if step is None else step
        with self.engine_call():
            if not overwrite and ckpt.has_step(step):  # the magics' way, instead of the engine's
                warnings.warn(
                    f"nbckpt: step {step} already exists in {ckpt.directory} and is "
                    "replaced; add --overwrite if that is intended, or run "
                    "%ckpt_config --new-run to save into a fresh run directory",
                    stacklevel=2,
                )
                overwrite = True
            try:  # One Checkpointer per directory serves both modes: a sync save blocks per save.
                handle = ckpt.save(
                    state, step=step, mode="sync" if mode == "sync" else "async", overwrite=overwrite
                )
            except KeyboardInterrupt:
                raise Interrupted(self._interrupted(ckpt, key, step, mode, names)) from None
        save = Save(key=key, directory=ckpt.directory, mode=mode, names=tuple(names), handle=handle)
        self.saves.append(save)
        return save

    def _interrupted(self, ckpt: Checkpointer, key: str, step: int, mode: str, names: Sequence[str]) -> str:
        """What a Ctrl-C in a save kept, in one line; a save that reached the background goes on
        there (the engine never cuts a write in two) and joins the session's saves."""
        handle = next((h for h in reversed(ckpt.handles) if h.step == step), None)
        if handle is not None:
            self.saves.append(
                Save(key=key, directory=ckpt.directory, mode=mode, names=tuple(names), handle=handle)
            )
            if handle.done() and handle.error is None:
                return f"step {step} committed to {ckpt.directory} before the interrupt took effect"
            if not handle.done():
                return (
                    f"step {step} is still being written in the background (%ckpt_wait waits "
                    f"for it, %ckpt_status shows it); {self._newest(ckpt, step)}"
                )
        return f"step {step} not saved; {self._newest(ckpt, step)}"

    @staticmethod
    def _newest(ckpt: Checkpointer, step: int) -> str:
        newest = ckpt.latest_step()
        if newest is None:
            return f"{ckpt.directory} holds no committed step"
        again = " (its earlier save)" if newest == step else ""
        return f"step {newest}{again} is the newest committed in {ckpt.directory}"

    def wait(self) -> NbckptError | None:
        """Wait until every save has committed or failed; the first failure, if any."""
        error: NbckptError | None = None
        try:
            for ckpt in [c for c in [*self._retiring, *self.checkpointers.values()] if not c.closed]:
                try:
                    ckpt.wait()
                except NbckptError as exc:
                    error = error or exc
        finally:
            # the commit callbacks may still be running: make every status final from here
            for save in self.saves:
                if save.handle.done():
                    for live in list(save.live):
                        save.finalise(live)
            with self._lock:
                self._sweep()
        return error

    def configure(
        self,
        options: dict[str, Any],
        *,
        reset: bool = False,
        directory: str | None = None,
        new_run: bool = False,
    ) -> None:
        """Change the defaults (``options``: :data:`OPTIONS` given) and reopen the Checkpointers
        they change (one with saves in flight: at its next save or restore)."""
        if directory is not None:
            usable_directory(directory)  # before anything changes: a refused one changes nothing
        with self._lock:
            before = self.key(None)
            # the new defaults in full before any is taken: a refused --new-run changes nothing
            self.defaults = _configured(
                SessionDefaults() if reset else self.defaults, options, directory, new_run=new_run
            )
            if reset or "keep" in options:
                self._keep.clear()  # a session-wide keep overrides the per-directory ones
            if self.key(None) != before:
                self._retire(before)
            for key in list(self.checkpointers):
                self._apply_defaults(key)

    def _apply_defaults(self, key: str) -> None:
        """Reopen the Checkpointer of ``key`` if the defaults changed what it was opened with;
        one with saves in flight is reopened by the next magic on it, never blocking the cell here."""
        ckpt = self.checkpointers[key]
        changes = self._changed(key, ckpt)
        pending = len(self.in_flight(key))
        if changes and pending:
            print(
                f"nbckpt: {_changes(changes)} for {ckpt.directory} applies once its "
                f"{pending} save(s) in flight have committed, from its next save or restore"
            )
        elif changes:
            self._reopen(key, changes)

    def settings(self) -> Iterator[tuple[str, Any]]:
        """What ``%ckpt_config`` shows: where saves go (and the directory of a ``--new-run``), then
        every other default."""
        run = self.defaults.run
        yield "directory", run + f" (a --new-run inside {self.defaults.dir})" if run else self.defaults.dir
        yield from ((k, v) for k, v in asdict(self.defaults).items() if k not in ("dir", "run"))

    def timeline(self) -> pd.DataFrame:
        """Every event of this session's Checkpointers from the session's start, in lanes named by
        mode and variables (and the directory's short name when there are several)."""
        import pandas as pd

        opened = [*self._closed, *self.checkpointers.values()]
        keys = list(dict.fromkeys(self.key(ckpt.directory) for ckpt in opened))
        short = _short_names(keys)
        labels = {(save.key, save.handle.step): f"{save.mode} {' '.join(save.names)}" for save in self.saves}
        frames = []
        for ckpt in opened:
            key = self.key(ckpt.directory)
            frame = events_to_pandas(ckpt.timeline.events, self.origin_ns)
            prefix = f"{short[key]}: " if len(keys) > 1 else ""
            # a float step (a column with NaN) finds its int key; None and NaN find none
            frame["label"] = frame["strategy"] = [
                prefix + labels[key, step] if (key, step) in labels else short[key] for step in frame["step"]
            ]
            frames.append(frame)
        if not frames or all(frame.empty for frame in frames):
            return pd.DataFrame()
        return pd.concat(frames, ignore_index=True).sort_values("start_ns", ignore_index=True)

    def _retire(self, key: str) -> None:
        """The Checkpointer of a directory that is no longer the default one gives back its staging
        memory: closed now, or once its saves in flight have committed (never blocking the cell).
        A later save there opens a new one."""
        ckpt = self.checkpointers.pop(key, None)
        if ckpt is None:
            return
        self._closed.append(ckpt)
        self._retiring.append(ckpt)
        self._sweep()

    def _sweep(self) -> None:
        """Close the retired Checkpointers whose saves have all committed or failed."""
        for ckpt in [c for c in self._retiring if all(h.done() for h in c.handles)]:
            self._retiring.remove(ckpt)
            try:
                ckpt.close()
            except CheckpointError as exc:  # a save that failed in the background
                _log.warning("nbckpt: %s", one_line(exc))

    def close(self) -> None:
        """Finish saves in flight and release every directory."""
        for ckpt in [*self._retiring, *self.checkpointers.values()]:
            try:
                ckpt.close()
            except CheckpointError as exc:  # a save that failed in the background
                _log.warning("nbckpt: %s", one_line(exc))
        self._closed.extend(self.checkpointers.values())
        self.checkpointers.clear()
        self._retiring.clear()

    def _wanted(self, key: str) -> dict[str, Any]:
        wanted = {name: getattr(self.defaults, name) for name in OPTIONS}
        if key in self._keep:
            wanted["keep"] = self._keep[key]
        return wanted

    def _changed(self, key: str, ckpt: Checkpointer) -> dict[str, Any]:
        return {k: v for k, v in self._wanted(key).items() if getattr(ckpt.config, k) != v}

    def in_flight(self, key: str) -> list[Save]:
        """This session's saves to directory ``key`` (see :meth:`key`) not yet committed or failed."""
        return [save for save in self.saves if save.key == key and not save.handle.done()]

    def _reopen(self, key: str, changes: dict[str, Any]) -> Checkpointer:
        """A new Checkpointer for directory ``key`` in place of the one there (closed first), with
        ``changes`` to its config."""
        old = self.checkpointers[key]
        was_closed = old.closed
        waited = len(self.in_flight(key))
        with self.engine_call():
            try:
                old.close()  # waits for the saves in flight: they commit with the old options
            finally:  # closed even when a save of it failed: the next magic opens a new one
                del self.checkpointers[key]
                self._closed.append(old)
            new = Checkpointer(old.directory, config=dataclasses.replace(old.config, **changes))
        self.checkpointers[key] = new
        if was_closed:  # the magics go on: the session's directory is its own again
            with_changes = f" with {_changes(changes)}" if changes else ""
            print(
                f"nbckpt: reopened the Checkpointer for {old.directory}{with_changes} (it was closed, "
                "by nbckpt.close_all() or its close())"
            )
        else:
            after = f" after its {waited} save(s) in flight committed" if waited else ""
            print(f"nbckpt: {_changes(changes)} for {old.directory}: reopened its Checkpointer{after}")
        return new

    def next_step(self, directory: str | None = None) -> int:
        """One past the newest step the directory's line sees and this session's saves to it."""
        key = self.key(directory)
        steps = self.opened(directory).steps()
        steps += [save.handle.step for save in self.saves if save.key == key]
        return max(steps) + 1 if steps else 0

    def staging_memory(self) -> str:
        """One line: host memory each directory's Checkpointer holds for staging (pinned or not)."""
        held = [
            (self.key(ckpt.directory), ckpt.host_bytes, ckpt.staging_pinned)
            for ckpt in self.checkpointers.values()
            if not ckpt.closed
        ]
        short = _short_names([key for key, _, _ in held])
        parts = [
            f"{short[key]} {format_bytes(nbytes)}{' pinned' if pinned else ''}"
            for key, nbytes, pinned in held
        ]
        total = format_bytes(sum(nbytes for _, nbytes, _ in held))
        return f"nbckpt: host memory held for staging: {total}" + (f" ({', '.join(parts)})" if parts else "")
