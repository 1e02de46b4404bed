"""The Checkpointers this process holds open: the one writing into a directory, closing them
all (a notebook's lost handles), and closing each at exit so its saves in flight finish."""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from collections.abc import Callable
from typing import Protocol

from .._errors import CheckpointError
from .._util import is_url
from ._config import CheckpointConfig
from ._store import Store, open_store

__all__ = ["close_all", "register", "release", "unregister", "writing_into"]

_log = logging.getLogger("nbckpt")


class _Open(Protocol):
    store: Store
    config: CheckpointConfig

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


class _Stoppable(Protocol):
    def stop(self, wait: bool) -> None: ...


def release(store: Store, wait: bool, *parts: _Stoppable | None) -> None:
    """Stop the threads of ``parts`` and free the directory; ``wait`` for the threads to end (not
    from a finalizer, which may run on one of them). Parts may be missing (a failed construction)."""
    for part in parts:
        if part is not None:
            part.stop(wait)
    store.unlock()


_OPEN: weakref.WeakSet[_Open] = weakref.WeakSet()
_EXITS: weakref.WeakKeyDictionary[_Open, Callable[[], None]] = weakref.WeakKeyDictionary()


def register(ckpt: _Open, at_exit_method: Callable[[], None]) -> None:
    """Count ``ckpt`` as open, and run ``at_exit_method`` (its bound method, held weakly) at
    exit unless it is closed or dropped before."""
    _OPEN.add(ckpt)
    method = weakref.WeakMethod(at_exit_method)

    def at_exit() -> None:
        bound = method()
        if bound is not None:
            bound()

    _EXITS[ckpt] = at_exit
    atexit.register(at_exit)
    # Unregistered when dropped too: a notebook that opens many readers keeps no dead entries
    # in atexit's list.
    weakref.finalize(ckpt, atexit.unregister, at_exit).atexit = False


def unregister(ckpt: _Open) -> None:
    _OPEN.discard(ckpt)
    at_exit = _EXITS.pop(ckpt, None)
    if at_exit is not None:
        atexit.unregister(at_exit)


def writing_into(directory: str | os.PathLike[str]) -> _Open | None:
    """The open Checkpointer of this process that writes into ``directory`` (on a local
    directory: the one holding its lock), or None."""
    wanted = open_store(os.fspath(directory)).url
    if not is_url(wanted):
        wanted = os.path.realpath(wanted)  # a symlink or a relative path to the run is the run
    for ckpt in list(_OPEN):
        url = ckpt.store.url if is_url(ckpt.store.url) else os.path.realpath(ckpt.store.url)
        if url == wanted and not ckpt.closed and not ckpt.config.read_only:
            return ckpt
    return None


def close_all() -> list[str]:
    """Close every Checkpointer of this process (a notebook's lost handles); return their directories.

    Background errors are logged, not raised: this is the way out of a stuck session.
    """
    closed = []
    for ckpt in list(_OPEN):
        try:
            ckpt.close()
        except CheckpointError as exc:
            _log.warning("nbckpt: %s", exc)
        closed.append(ckpt.store.url)
    return closed
