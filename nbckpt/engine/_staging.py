"""Staging: the copy of the state into host memory that a save waits for (unless it overlaps).
Each in-flight slot owns one host image per data file this rank writes, allocated once per
structure (pinned with CUDA, for asynchronous copies on a side stream) with the file's framing
in place: staging copies each tensor into its hole, and the writer writes the image as it is.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

import psutil
import torch

from .._errors import CheckpointError, describe_error
from .._util import format_bytes
from ._faults import fault_point
from ._format import FileLayout
from ._state import TensorSpec
from ._workers import SIGNAL_CHECK_S, Worker, balance, settle

__all__ = ["Slot", "Stager", "StagingPool"]

T = TypeVar("T")


class Slot:
    """Host images for one save in flight, and typed views of every tensor's place in them."""

    def __init__(self) -> None:
        self.owner: object | None = None
        self.files: tuple[FileLayout, ...] = ()
        self.images: dict[str, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}
        #: The CPU copies split over the stage threads: fixed while the images are, so
        #: :class:`Stager` works it out once per fit, not on every save's stall.
        self.shards: list[list[str]] | None = None
        self.shard_keys: list[str] = []
        """The keys ``shards`` split (an incremental save stages only some of the images' keys)."""

    @property
    def nbytes(self) -> int:
        return sum(image.numel() for image in self.images.values())

    def fit(self, files: tuple[FileLayout, ...], specs: Sequence[TensorSpec], pin: bool) -> None:
        """Make the images those of ``files`` (a no-op when they already are); ``specs`` gives
        each tensor's dtype and shape."""
        fault_point("staging.fit")
        if files == self.files:
            return
        self.files, self.images, self.views, self.shards = (), {}, {}, None  # free the old images first
        spec_of = {spec.key: spec for spec in specs}
        images, views = {}, {}
        for layout in files:
            image = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pin)
            for offset, framing in layout.framing:
                image[offset : offset + len(framing)] = torch.frombuffer(
                    bytearray(framing), dtype=torch.uint8
                )
            for item in layout.items:
                spec = spec_of[item.key]
                if not item.nbytes:  # nothing to write; torch frames an empty tensor without a hole
                    views[item.key] = torch.empty(spec.shape, dtype=spec.dtype)
                    continue
                raw = image[item.offset : item.offset + item.nbytes]
                views[item.key] = raw.view(spec.dtype).view(spec.shape)
            images[layout.name] = image
        self.files, self.images, self.views = files, images, views


#: Share of the available host memory staging may take: the rest is the training's.
MEMORY_SHARE = 0.8


class StagingPool:
    """``slots`` slots, each taken by one save from staging until its files are written."""

    def __init__(self, slots: int, *, pin: bool) -> None:
        self.pin = pin
        self._slots = [Slot() for _ in range(slots)]
        self._free = threading.Condition()
        self._planned_for = -1  # bytes per slot the memory check below last ran for

    def preflight(self, slot_bytes: int) -> str | None:
        """Before images of ``slot_bytes`` each are allocated: fewer slots, or unpinned memory,
        when the configured ones would not fit (rather than an OOM kill); a line saying so."""
        if slot_bytes == self._planned_for:
            return None
        self._planned_for = slot_bytes
        notes = []
        if self.pin:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            need = slot_bytes * len(self._slots)
            if soft != resource.RLIM_INFINITY and need > soft and os.geteuid() != 0:
                self.pin = False
                notes.append(
                    f"unpinned: {need / 1e9:.2f} GB of pinned staging exceeds `ulimit -l` "
                    f"({soft / 1e9:.2f} GB); device-to-host copies will not overlap"
                )
        held = self.host_bytes  # freed when the slots are refitted
        room = int((psutil.virtual_memory().available + held) * MEMORY_SHARE)
        fit = room // slot_bytes if slot_bytes else len(self._slots)
        if fit < 1:
            raise CheckpointError(
                f"staging this state needs {format_bytes(slot_bytes)} of host memory and only "
                f"{format_bytes(room)} can be spared ({MEMORY_SHARE:.0%} of what is available)"
            )
        requested = len(self._slots)
        if fit < requested:
            with self._free:
                self._slots = self._slots[:fit]
            notes.append(
                f"{fit} staging slot(s) instead of {requested}: each needs {format_bytes(slot_bytes)} "
                f"and {format_bytes(room)} can be spared; saves wait for a free slot instead"
            )
        return "; ".join(notes) or None

    def acquire(self, owner: Any) -> Slot:
        """A free slot for ``owner`` (waits for one); ``owner.slot`` names it before it is taken,
        so an interrupt at any point leaves the caller able to :meth:`release` it."""
        with self._free:
            while True:
                slot = next((s for s in self._slots if s.owner is None), None)
                if slot is not None:
                    break
                self._free.wait(SIGNAL_CHECK_S)  # timed: a Ctrl-C gets through
            owner.slot = slot
            slot.owner = owner
        return slot

    def prepare(self, files: tuple[FileLayout, ...], specs: Sequence[TensorSpec]) -> None:
        """Fit every free slot to ``files`` now (slots in use fit at their next save)."""
        for slot in self._slots:
            with self._free:
                if slot.owner is not None:
                    continue
                slot.owner = self
            try:
                slot.fit(files, specs, pin=self.pin)
            finally:
                self.release(slot, self)

    def release(self, slot: Slot, owner: Any) -> None:
        """Give ``slot`` back if ``owner`` holds it (safe to call twice)."""
        with self._free:
            if slot.owner is owner:
                slot.owner = None
                self._free.notify_all()

    def free(self) -> None:
        """Drop the images of every slot no save holds: a closed Checkpointer gives its staging
        memory back (a notebook that replaces one would otherwise hold one more copy each time)."""
        with self._free:
            for slot in self._slots:
                if slot.owner is None:
                    slot.files, slot.images, slot.views, slot.shards = (), {}, {}, None

    @property
    def host_bytes(self) -> int:
        """Host memory the slots hold now."""
        return sum(slot.nbytes for slot in self._slots)


class Stager:
    """Copies tensors into a slot: CPU copies split over two threads, CUDA ones on a side stream."""

    def __init__(self, threads: int = 2) -> None:
        self._workers = [Worker(f"nbckpt-stage-{i}") for i in range(threads)]
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def stage(
        self,
        tensors: Mapping[str, torch.Tensor],
        slot: Slot,
        done: Future[tuple[float, int]],
        *,
        wait: bool,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Copy every tensor this rank writes into ``slot``; ``done`` gets the CPU seconds spent
        and the time (``perf_counter_ns``) the last copy ended. ``then`` runs once every copy
        has landed, before ``done`` is set (on a stage thread: while the state is still the
        saved one). With ``wait``, return after it."""
        keys = [key for key in tensors if key in slot.views]
        if not keys and then is None:
            done.set_result((0.0, time.perf_counter_ns()))
            return
        if self._stream is not None and any(tensors[k].is_cuda for k in keys):
            # The caller's stream, read on the caller's thread: the copies must follow its work.
            copy: _Copy = partial(_copy_on_stream, self._stream, torch.cuda.current_stream())
            shards = [keys]
        else:
            # CPU copies run on the stage threads, one shard each, even when save() waits for
            # them: on the main thread torch splits every copy across its OpenMP threads, which
            # on a busy 2-core machine made staging 303 MB take 0.4-2.4 s instead of 0.04-0.12 s;
            # two threads with a shard each keep both cores busy without OpenMP barriers.
            copy = _copy
            if slot.shards is None or slot.shard_keys != keys:  # same until a refit or another skip
                slot.shards = balance(keys, len(self._workers), lambda key: slot.views[key].nbytes)
                slot.shard_keys = keys
            shards = slot.shards or [[]]  # nothing to copy: one empty part runs ``then``
        parts = _Parts(len(shards), done, then)
        for worker, part in zip(self._workers, shards, strict=False):
            worker.submit(partial(parts.run, copy, slot.views, tensors, part))
        if wait:
            try:
                settle(done)
                done.result()
            except KeyboardInterrupt:
                # The slot goes back on the way out: the copies must be over first.
                done.exception()
                raise

    def run(self, jobs: Sequence[Callable[[], T]]) -> list[T]:
        """``jobs`` on the stage threads (at the caller's priority), one a thread; their results
        in order, once every one has ended (the first error raised then)."""
        futures: list[Future[T]] = [Future() for _ in jobs]

        def one(job: Callable[[], T], future: Future[T]) -> None:
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)

        for index, (job, future) in enumerate(zip(jobs, futures, strict=True)):
            self._workers[index % len(self._workers)].submit(partial(one, job, future))
        for future in futures:
            settle(future)
        return [future.result() for future in futures]

    @property
    def threads(self) -> int:
        return len(self._workers)

    def stop(self, wait: bool = True) -> None:
        for worker in self._workers:
            worker.stop(wait)


#: A stage thread's copy of ``keys``: from the tensors (second) into their views (first).
_Copy = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], list[str]], None]


def _copy(views: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor], keys: list[str]) -> None:
    for key in keys:
        views[key].copy_(tensors[key])


def _copy_on_stream(
    stream: torch.cuda.Stream,
    producer: torch.cuda.Stream,
    views: Mapping[str, torch.Tensor],
    tensors: Mapping[str, torch.Tensor],
    keys: list[str],
) -> None:
    """Device-to-host copies on the side stream, after the producer's work; returns once they landed."""
    stream.wait_stream(producer)
    with torch.cuda.stream(stream):
        for key in keys:
            views[key].copy_(tensors[key], non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    event.synchronize()


class _Parts:
    """The parts of one stage, each copied on a stage thread: the last to finish settles
    ``done`` with the CPU seconds all of them spent, or the first part's error."""

    def __init__(
        self, count: int, done: Future[tuple[float, int]], then: Callable[[], None] | None = None
    ) -> None:
        self._then = then
        self._lock = threading.Lock()
        self._pending = count
        self._cpu = 0.0
        self._error: BaseException | None = None
        self._done = done

    def run(
        self,
        copy: _Copy,
        views: Mapping[str, torch.Tensor],
        tensors: Mapping[str, torch.Tensor],
        keys: list[str],
    ) -> None:
        began = time.thread_time()
        error = None
        try:
            copy(views, tensors, keys)
        except BaseException as exc:
            error = exc
        with self._lock:
            self._cpu += time.thread_time() - began
            self._error = self._error or error
            self._pending -= 1
            last = self._pending == 0
        if not last:
            return
        if self._error is None and self._then is not None:
            try:
                self._then()
            except BaseException as exc:
                self._error = exc
        if self._error is not None:
            self._done.set_exception(CheckpointError(f"staging failed: {describe_error(self._error)}"))
        else:
            self._done.set_result((self._cpu, time.perf_counter_ns()))
