"""A second tier: every step committed in the run's directory is also uploaded, in the
background, to a mirror (an object store, or another directory) with its own commit there.

Saves never wait for the mirror: a restart restores from the fast local copy, and only when
that is gone or damaged from the mirror. An upload reads the local files block by block,
checking each against the manifest, so a damaged local copy is never passed on; the manifest
goes last, so a step counts on the mirror only once all of it is there.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from functools import partial
from typing import Any

from .._errors import describe_error
from ._files import copy_file
from ._lines import MAIN
from ._reader import damage_named, read_manifest
from ._store import Store, open_store, step_name
from ._timeline import Timeline, now_ns
from ._workers import Worker

__all__ = ["Mirror"]

_log = logging.getLogger("nbckpt")


class Mirror:
    """Uploads committed steps to ``store`` on one background thread, in commit order."""

    def __init__(
        self,
        store: Store,
        *,
        keep: int | None,
        timeline: Timeline,
        nonce: str,
        storage_options: dict[str, Any],
        nice: int = 0,
    ) -> None:
        self.store, self.keep, self.timeline, self._nonce = store, keep, timeline, nonce
        self.root, self._options = store, storage_options
        self._worker = Worker("nbckpt-mirror", nice=nice)
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # steps queued or uploading: retention must leave them
        self._last: Future[None] | None = None
        self.failures: list[str] = []
        self._count = 0

    def follow(self, line: str) -> None:
        """Upload into the mirror's copy of ``line`` (a branch of the run is a folder there too)."""
        self.store = self.root if line == MAIN else open_store(f"{self.root.url}/{line}", self._options)

    @property
    def pending(self) -> set[int]:
        with self._lock:
            return set(self._pending)

    def upload(self, source: Store, step: int, location: str) -> None:
        """Queue ``step`` (committed at ``location`` of ``source``) for upload."""
        done: Future[None] = Future()
        with self._lock:
            self._pending.add(step)
            self._last = done
            self._count += 1
            nonce = f"{self._nonce}m{self._count:x}"
        self._worker.submit(partial(self._upload, source, location, step, nonce, done))

    def wait(self) -> list[str]:
        """Block until every queued upload is over; return (and forget) the failures since last."""
        last = self._last
        if last is not None:
            last.result()
        with self._lock:
            failures, self.failures = self.failures, []
        return failures

    def stop(self, wait: bool) -> None:
        self._worker.stop(wait)

    def _upload(self, source: Store, location: str, step: int, nonce: str, done: Future[None]) -> None:
        began = now_ns()
        target: str | None = None
        committed = False
        try:
            manifest, data = read_manifest(source, step, location)
            target = self.store.begin(step, nonce)
            copied = 0
            for name, meta in manifest.files.items():
                with damage_named(f"{step_name(step)}/{name}"):
                    copied += copy_file(
                        source.source(location, name, meta["size"]),
                        self.store.sink(target, name),
                        meta["blocks"],
                        fsync=self.store.is_local,
                    )
            self.store.commit(target, step, data)
            committed = True
            self.timeline.record("upload", began, step=step, nbytes=copied, mirror=self.store.url)
            self._retain(step)
        except Exception as exc:
            if target is not None and not committed:
                self.store.discard(target)
            message = (
                f"step {step} is committed locally but not on the mirror {self.store.url}: "
                f"{describe_error(exc)}"
            )
            with self._lock:
                self.failures.append(message)
            self.timeline.record("error", began, step=step, message=message)
            _log.warning("nbckpt: %s", message)
        finally:
            with self._lock:
                self._pending.discard(step)
            done.set_result(None)

    def _retain(self, newest: int) -> None:
        """The mirror keeps as many steps as the directory (never the one just uploaded)."""
        if self.keep is None:
            return
        steps = sorted(s for s in self.store.committed() if s != newest)
        for step in steps[: max(len(steps) + 1 - self.keep, 0)]:
            try:
                self.store.delete(step)
            except Exception as exc:
                _log.warning(
                    "nbckpt: could not delete %s from the mirror: %s", step_name(step), describe_error(exc)
                )
