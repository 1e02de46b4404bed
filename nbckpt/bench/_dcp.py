"""PyTorch DCP's strategies: ``dcp.save``, ``dcp.async_save`` with torch's defaults, and DCP at
its best (a reused ``DefaultStager``, cached plans, the process executor).

``dcp-async-stager`` needs a process group; outside ``torchrun`` it starts a gloo group of one
on loopback. torch spawns its checkpoint process on the first such save, which re-imports
``__main__``: a script that runs it needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
    async_save,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .._errors import ConfigError
from ..engine import Timeline
from ..engine._internal import now_ns, step_name
from ._dcp_compat import quiet_spawn
from ._strategy import (
    WAIT_NOISE_NS,
    BlockingSave,
    Strategy,
    failing_as,
    file_bytes,
    plain_state,
    tensor_bytes,
)

__all__ = ["DcpAsync", "DcpAsyncStager", "DcpSync"]


# torch warns on every save without a process group ("torch.distributed is disabled,
# unavailable or uninitialized, assuming the intent is to save in a single process."), even with
# no_dist=True, which says that this is the intent: in a notebook, a stderr box per strategy.
# While one of the strategies below is open, exactly that warning is ignored: the filter names
# its text, and it is taken out when the last of them closes, so a user's own dcp.save still
# warns. (Not warnings.catch_warnings: it swaps the whole filter list, not thread-safe, and
# dcp-async's warning comes from torch's writer thread after async_save has returned.)
_SINGLE_PROCESS_WARNING = re.escape(
    "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    "save in a single process."
)
_quiet_lock = threading.Lock()
_quiet_strategies = 0  # open strategies that save without a process group


class _SingleProcess(Strategy):
    """A DCP strategy that saves without a process group: torch's warning about that is
    ignored while it is open. On many ranks DCP's collectives use :attr:`process_group`."""

    _quiet = False
    process_group: Any = None
    """The group DCP's collectives use (None: the default group). A bench on many ranks gives
    them a gloo group of their own: an async save's collectives run in a background thread, and
    on the default group they would interleave with FSDP's collectives in the training step."""

    def open(self, directory: str, timeline: Timeline) -> None:
        super().open(directory, timeline)
        if not self._quiet:
            self._quiet = True
            self._count_quiet(1)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._quiet:
                self._quiet = False
                self._count_quiet(-1)

    @staticmethod
    def _count_quiet(change: int) -> None:
        global _quiet_strategies
        with _quiet_lock:
            _quiet_strategies += change
            if change > 0:  # (again: a test's catch_warnings may have dropped it meanwhile)
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
            elif _quiet_strategies == 0:
                for entry in [
                    entry
                    for entry in warnings.filters
                    if entry[0] == "ignore" and getattr(entry[1], "pattern", None) == _SINGLE_PROCESS_WARNING
                ]:
                    warnings.filters.remove(entry)  # type: ignore[attr-defined]  # a list at run time


class DcpSync(_SingleProcess, BlockingSave):
    name = "dcp-sync"
    description = "torch.distributed.checkpoint.save (single process)"
    writer = "dcp.save"

    def write(self, plain: dict[str, Any], path: str) -> None:
        dcp_save(
            plain, checkpoint_id=path, no_dist=not dist.is_initialized(), process_group=self.process_group
        )


class DcpAsync(_SingleProcess):
    """``dcp.async_save`` with torch's defaults: a fresh CPU copy per save, a writer thread.

    Like torchtitan, a save first waits for the previous one (recorded as ``wait``).
    """

    name = "dcp-async"
    description = "torch.distributed.checkpoint.async_save, default settings (thread)"

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(storage_options)
        self._pending: tuple[int, Future[Any], threading.Event] | None = None
        self._staging: tuple[int, Future[Any]] | None = None  # a copy behind the loop

    def _async_save(self, plain: dict[str, Any], path: str) -> Future[Any] | AsyncSaveResponse:
        return async_save(
            plain,
            checkpoint_id=path,
            no_dist=not dist.is_initialized(),
            process_group=self.process_group,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
        )

    def save(self, state: Mapping[str, Any], step: int) -> None:
        self._wait_pending(record_for=step)
        begin = now_ns()
        plain = plain_state(state)
        path = os.path.join(self.path, step_name(step))
        with failing_as(f"dcp.async_save of step {step} to {path}"):
            response = self._async_save(plain, path)
        returned = now_ns()
        if isinstance(response, AsyncSaveResponse):
            staging, upload = response.staging_completion, response.upload_completion
        else:
            staging, upload = None, response
        self._track(
            step, nbytes=tensor_bytes(plain), begin=begin, returned=returned, staging=staging, upload=upload
        )

    def _track(
        self,
        step: int,
        *,
        nbytes: int,
        begin: int,
        returned: int,
        staging: Future[Any] | None,
        upload: Future[Any],
    ) -> None:
        """Record ``stage`` until the copy is done and ``persist`` from then until durable."""
        staged_at = [returned]
        if staging is None:
            self.record("stage", begin, returned, step=step, nbytes=nbytes)
        else:

            def on_staged(done: Future[Any]) -> None:
                staged_at[0] = now_ns()
                kind = "error" if done.exception() is not None else "stage"
                self.record(kind, begin, staged_at[0], step=step, nbytes=nbytes)

            staging.add_done_callback(on_staged)
            self._staging = (step, staging)
        recorded = threading.Event()

        def on_done(done: Future[Any]) -> None:
            try:
                if done.exception() is not None:
                    self.record("error", staged_at[0], step=step, nbytes=nbytes)
                else:  # durable now; the files' sizes are counted after, outside the event
                    end = now_ns()
                    written = file_bytes(os.path.join(self.path, step_name(step)))
                    self.record("persist", staged_at[0], end, step=step, nbytes=nbytes, written=written)
            finally:
                recorded.set()

        upload.add_done_callback(on_done)
        self._pending = (step, upload, recorded)

    def _wait_pending(self, *, record_for: int | None) -> None:
        """Wait for the save in flight; record it as a ``wait`` of save ``record_for`` (the
        one that waits, as the engine records backpressure), unless None."""
        if self._pending is None:
            return
        step, future, recorded = self._pending
        self._pending = None
        begin = now_ns()
        try:
            with failing_as(f"{self.name} of step {step} to {self.path}"):
                future.result()
        finally:
            # add_done_callback runs after waiters wake: wait for the persist event too.
            recorded.wait()
        if record_for is not None and now_ns() - begin > WAIT_NOISE_NS:
            self.record("wait", begin, step=record_for)

    def finish(self) -> None:
        self._wait_pending(record_for=None)

    def close(self) -> None:
        # Never leave a save running behind a closed strategy; its error was finish()'s to raise.
        if self._staging is not None:
            self._staging[1].exception()
            self._staging = None
        if self._pending is not None:
            self._pending[1].exception()
            self._pending[2].wait()
            self._pending = None
        super().close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _CachedPlanner(DefaultSavePlanner):
    """DCP's planner with cached save plans, under a cache key of its own: DCP keys its
    class-level plan cache by class name, and a user's own cached planner must not share it."""

    def __init__(self) -> None:
        super().__init__(enable_plan_caching=True)


class DcpAsyncStager(DcpAsync):
    """DCP at its best, as torchtitan's ``async_with_pinned_mem`` runs it.

    A ``DefaultStager`` reused across saves copies the state into the same (shared, and on
    CUDA pinned) host buffers in a background thread; save plans are cached; the write runs
    in DCP's checkpoint process. ``save`` returns once the copy is queued; the copy must end
    before the optimizer changes the parameters, so :meth:`before_step` waits for it (that
    wait counts as stall, as ``nbckpt-async-overlap``'s does). One save in flight: the next
    save waits for the previous upload, because the reused buffers are what it reads.

    Outside ``torchrun`` it starts a gloo group of world size 1 on a free loopback port and
    destroys it in :meth:`close`. torch keeps its checkpoint process for the life of the
    interpreter (a daemon), so only the first save pays for spawning it.
    """

    name = "dcp-async-stager"
    stall_covers_copy = False  # async staging: the copy runs behind the loop
    description = (
        "DCP at its best: reused DefaultStager, cached save plans, process "
        "executor (torchtitan's async_with_pinned_mem)"
    )
    blocks_before_step = True

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(storage_options)
        self._own_group = False
        self._stager: DefaultStager | None = None
        self._planner: _CachedPlanner | None = None

    def open(self, directory: str, timeline: Timeline) -> None:
        super().open(directory, timeline)
        try:
            if not dist.is_initialized():
                address = f"tcp://127.0.0.1:{_free_port()}"
                try:
                    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
                except Exception as exc:
                    raise ConfigError(
                        f"{self.name} needs a process group and starting a gloo group of one on "
                        f"{address} failed ({type(exc).__name__}: {exc}); run under torchrun instead"
                    ) from exc
                self._own_group = True
            # Pinned memory and non-blocking copies need an accelerator; a CPU-only torch refuses them.
            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=True,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
        except BaseException:
            self.close()
            raise
        self._planner = _CachedPlanner()

    def _async_save(self, plain: dict[str, Any], path: str) -> Future[Any] | AsyncSaveResponse:
        if self._stager is None or self._planner is None:
            raise ConfigError(f"strategy {self.name} is not open; call open() first")
        # For a group of our own, DCP's checkpoint process rendezvous on loopback: torch
        # otherwise takes the host's fully qualified name, which need not resolve to this host.
        loopback = self._own_group and "MASTER_ADDR" not in os.environ
        if loopback:
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        undo = quiet_spawn()
        try:
            response = async_save(
                plain,
                checkpoint_id=path,
                no_dist=not dist.is_initialized(),
                process_group=self.process_group,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self._stager,
                planner=self._planner,
            )
        except BaseException:
            undo()
            raise
        finally:
            if loopback:
                os.environ.pop("MASTER_ADDR", None)
        upload = response.upload_completion if isinstance(response, AsyncSaveResponse) else response
        upload.add_done_callback(lambda _: undo())
        return response

    def before_step(self) -> None:
        if self._staging is None:
            return
        step, staging = self._staging
        self._staging = None
        with failing_as(f"{self.name}: copying step {step} into the staging buffers"):
            staging.result()

    def finish(self) -> None:
        self.before_step()
        super().finish()

    def close(self) -> None:
        try:
            super().close()  # waits for the upload still reading the buffers
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            self._planner = None
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False
