"""The :class:`Strategy` interface every checkpoint strategy implements, and its helpers.

A strategy writes under ``<directory>/<name>/``. The runner times every ``save`` (and
``before_step`` where a strategy declares it may block) as the stall the training loop sees;
strategies record what happens inside (``stage``, ``persist``, ``wait``, ``fsync``, ``commit``)
into the timeline they are given. The built-in strategies are in :mod:`._strategies` and
:mod:`._dcp`.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import torch

from .._errors import CheckpointError, ConfigError, describe_error
from .._util import is_url
from ..engine import Event, Timeline
from ..engine._internal import now_ns, step_name

__all__ = [
    "WAIT_NOISE_NS",
    "BlockingSave",
    "Strategy",
    "failing_as",
    "file_bytes",
    "join",
    "plain_state",
    "tensor_bytes",
]


# A wait for background work shorter than this is bookkeeping (the work was already done), not
# backpressure: neither the runner nor a strategy records it as a wait.
WAIT_NOISE_NS = 100_000


def join(directory: str, name: str) -> str:
    if is_url(directory):
        return f"{directory.rstrip('/')}/{name}"
    return os.path.join(directory.removeprefix("file://"), name)


def plain_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` with modules and optimizers replaced by their state dicts (what torch.save wants)."""

    def convert(value: Any) -> Any:
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            return value.state_dict()
        if isinstance(value, Mapping):
            return {key: convert(item) for key, item in value.items()}
        return value

    return {key: convert(value) for key, value in state.items()}


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a nested dict/list structure."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, Mapping):
        return sum(tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(item) for item in value)
    return 0


def file_bytes(path: str) -> int:
    """Bytes of the file at ``path``, or of every file under the directory ``path``: what a save
    that writes everything anew wrote."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _dirs, names in os.walk(path) for name in names
    )


@contextmanager
def failing_as(what: str) -> Iterator[None]:
    """Raise what the block raises as ``CheckpointError("<what> failed: ...")``, the cause kept.

    The net is wide because DCP raises CheckpointException, a BaseException; Ctrl-C and
    ``sys.exit`` still pass through unchanged.
    """
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        raise CheckpointError(f"{what} failed: {describe_error(exc)}") from exc


class Strategy(ABC):
    """How a training loop checkpoints. The runner calls, in order::

    open(directory, timeline)
    for each step: before_step(); <train>; save(state, step) every k steps
    finish(); close()
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    writes_checkpoints: ClassVar[bool] = True
    """False only for the ``none`` baseline (the runner then never calls ``save``)."""
    blocks_before_step: ClassVar[bool] = False
    """True when ``before_step`` may wait for an earlier save (its time counts as stall)."""
    local_only: ClassVar[bool] = True
    """True when the strategy can only write to a local (or mounted) directory."""
    stall_covers_copy: ClassVar[bool] = True
    """True when the loop stays blocked while every byte is copied (or written) once, so its save
    stall cannot be shorter than the copy floor; False when the copy runs behind the loop."""
    whole_saves: ClassVar[bool] = True
    """True when every save writes the whole state anew, so a run keeps one state per save;
    False when later saves write only what changed (incremental), the first one whole."""
    mode: ClassVar[Literal["sync", "async"]] = "async"
    """``sync`` when a save returns once it is durable; ``async`` when the write runs behind."""

    def __init__(self, storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.path = ""
        self._timeline: Timeline | None = None

    @property
    def timeline(self) -> Timeline:
        if self._timeline is None:
            raise ConfigError(f"strategy {self.name} is not open; call open() first")
        return self._timeline

    def open(self, directory: str, timeline: Timeline) -> None:
        """Start writing under ``directory/<name>/`` and record events into ``timeline``."""
        if self.local_only and is_url(directory):
            raise ConfigError(
                f"strategy {self.name} writes local files only, not to {directory}; "
                "use the nbckpt-* strategies for object storage"
            )
        self.path = join(directory, self.name)
        self._timeline = timeline
        if self.writes_checkpoints and not is_url(self.path):
            os.makedirs(self.path, exist_ok=True)

    @abstractmethod
    def save(self, state: Mapping[str, Any], step: int) -> None:
        """Checkpoint ``state`` as ``step``; returns when training may continue."""

    def before_step(self) -> None:  # noqa: B027 - optional hook
        """Called before the training step mutates the state (after backward)."""

    def finish(self) -> None:  # noqa: B027 - optional hook
        """Block until every save is durable; raise CheckpointError if one failed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`open` took (after :meth:`finish`)."""

    def save_cpu_s(self) -> float | None:
        """CPU seconds the strategy's own threads spent on its saves so far, where it knows."""
        return None

    def record(
        self,
        kind: str,
        start_ns: int,
        end_ns: int | None = None,
        *,
        step: int | None = None,
        nbytes: int = 0,
        **detail: Any,
    ) -> Event:
        return self.timeline.record(kind, start_ns, end_ns, step=step, nbytes=nbytes, **detail)

    def __repr__(self) -> str:
        return f"<Strategy {self.name}>"


class BlockingSave(Strategy):
    """A save that returns once the checkpoint is durable: one ``persist`` event, the whole save."""

    mode = "sync"
    writer: ClassVar[str] = ""
    """What writes (``torch.save``), for error messages."""
    suffix: ClassVar[str] = ""
    """Appended to the step's name: the checkpoint's file or directory under :attr:`path`."""

    def save(self, state: Mapping[str, Any], step: int) -> None:
        begin = now_ns()
        plain = plain_state(state)
        path = os.path.join(self.path, step_name(step) + self.suffix)
        with failing_as(f"{self.writer} of step {step} to {path}"):
            self.write(plain, path)
        end = now_ns()  # durable; the file's size is counted after, outside the event
        self.record("persist", begin, end, step=step, nbytes=tensor_bytes(plain), written=file_bytes(path))

    @abstractmethod
    def write(self, plain: dict[str, Any], path: str) -> None:
        """Write ``plain`` to ``path``, durably, before returning."""
