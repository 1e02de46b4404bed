"""Every checkpoint strategy by name: the nine built in, and yours.

Add your own::

    @register_strategy
    class MyStrategy(Strategy):
        name = "mine"
        def save(self, state, step): ...

Here are the registry and the strategies that need no process group (the ``none`` baseline,
``torch-save``, nbckpt's own :class:`~nbckpt.Checkpointer`); DCP's are in :mod:`._dcp`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import torch

from .._errors import ConfigError
from ..engine import Checkpointer, Event, Timeline
from ..engine._internal import fsync_dir
from ._dcp import DcpAsync, DcpAsyncStager, DcpSync
from ._strategy import BlockingSave, Strategy

__all__ = [
    "STRATEGIES",
    "NbckptAsync",
    "NbckptAsyncOverlap",
    "NbckptIncremental",
    "NbckptStrategy",
    "NbckptSync",
    "NoCheckpoint",
    "TorchSave",
    "get_strategy",
    "register_strategy",
]

S = TypeVar("S", bound=type[Strategy])

#: Every strategy by name; :func:`register_strategy` adds yours.
STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: S) -> S:
    """Class decorator: make ``cls`` available by its ``name`` (replacing one of the same name)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"{cls!r} is not a Strategy subclass")
    if not cls.name or not isinstance(cls.name, str) or "/" in cls.name:
        raise ConfigError(f"strategy {cls.__name__} needs a plain name (a class attribute 'name')")
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(name: str | Strategy, **options: Any) -> Strategy:
    """A fresh strategy by name (``options`` go to its constructor), or ``name`` itself."""
    if isinstance(name, Strategy):
        return name
    cls = STRATEGIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return cls(**options)


class NoCheckpoint(Strategy):
    name = "none"
    description = "no checkpoints: the baseline"
    writes_checkpoints = False
    local_only = False

    def save(self, state: Mapping[str, Any], step: int) -> None:
        raise ConfigError("the 'none' strategy does not save")


class TorchSave(BlockingSave):
    name = "torch-save"
    description = "torch.save of the state dicts to one file, fsync of file and directory"
    writer = "torch.save"
    suffix = ".pt"

    def write(self, plain: dict[str, Any], path: str) -> None:
        with open(path, "wb") as stream:
            torch.save(plain, stream)
            stream.flush()
            os.fsync(stream.fileno())
        fsync_dir(self.path)


class NbckptStrategy(Strategy):
    """nbckpt's own :class:`~nbckpt.Checkpointer`; its events are forwarded to the timeline."""

    overlap: ClassVar[bool] = False
    local_only = False

    def __init__(self, storage_options: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(storage_options)
        self.options = options
        self.checkpointer: Checkpointer | None = None

    def open(self, directory: str, timeline: Timeline) -> None:
        super().open(directory, timeline)
        self.checkpointer = Checkpointer(
            self.path, mode=self.mode, storage_options=self.storage_options, **self.options
        )
        self.checkpointer.timeline.add_listener(self._forward)

    def _forward(self, event: Event) -> None:
        # The runner times the stall itself (adapter included); everything else is the engine's.
        if event.kind != "stall":
            self.record(
                event.kind, event.start_ns, event.end_ns, step=event.step, nbytes=event.bytes, **event.detail
            )

    def _require(self) -> Checkpointer:
        if self.checkpointer is None:
            raise ConfigError(f"strategy {self.name} is not open; call open() first")
        return self.checkpointer

    def save(self, state: Mapping[str, Any], step: int) -> None:
        self._require().save(state, step, overlap=self.overlap)

    def before_step(self) -> None:
        if self.overlap:
            self._require().wait_staged()

    def finish(self) -> None:
        self._require().wait()

    def save_cpu_s(self) -> float | None:
        records = self.checkpointer.records if self.checkpointer is not None else []
        return sum(record.cpu_s for record in records) if records else None

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None


class NbckptSync(NbckptStrategy):
    name = "nbckpt-sync"
    description = "nbckpt Checkpointer, mode='sync' (atomic, checksummed, blocking)"
    mode = "sync"


class NbckptAsync(NbckptStrategy):
    name = "nbckpt-async"
    description = "nbckpt Checkpointer, mode='async': copy into reused buffers, persist behind"


class NbckptIncremental(NbckptStrategy):
    name = "nbckpt-incremental"
    description = (
        "nbckpt async with incremental=True: files whose tensors did not change are shared, not written"
    )
    whole_saves = False

    def __init__(self, storage_options: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(storage_options, **{"incremental": True, **options})


class NbckptAsyncOverlap(NbckptStrategy):
    name = "nbckpt-async-overlap"
    description = "nbckpt async with overlap=True: the copy runs under the next forward/backward"
    overlap = True
    blocks_before_step = True
    stall_covers_copy = False


# In the order help texts list them (and figures colour them).
for _built_in in (
    NoCheckpoint,
    TorchSave,
    DcpSync,
    DcpAsync,
    DcpAsyncStager,
    NbckptSync,
    NbckptAsync,
    NbckptAsyncOverlap,
    NbckptIncremental,
):
    register_strategy(_built_in)
