"""nbckpt in an ``accelerate`` loop: what ``accelerator.save_state`` saves, saved asynchronously.

>>> model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
>>> ckpt = AcceleratorCheckpointer(accelerator, "ckpt/run1", keep=2)
>>> step = ckpt.restore()              # instead of accelerator.load_state(...); 0 on a fresh start
>>> ckpt.save(step)                    # instead of accelerator.save_state(...)

The state is what accelerate itself tracks (:meth:`AcceleratorCheckpointer.state`), with every
rank's RNG states. Under ``accelerate launch`` or ``torchrun`` every rank calls ``save`` and
``restore``. FSDP, DeepSpeed, Megatron-LM and XLA are refused: their state is sharded or lives
elsewhere (use ``accelerator.save_state``).

A notebook cell run again (after a Ctrl-C stopped its loop before ``ckpt.close()``) makes a new
one on the same directory while the old one is still bound: the new one closes the old one's
Checkpointer (its saves in flight commit) and takes the directory over, unless the old one is in
use on another thread that still runs (then a ConfigError names it). The old one opens it again if
used.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from .._errors import ConfigError
from ..engine import Checkpointer, RetentionPolicy, SaveHandle
from ._accelerate_compat import tracked
from ._common import close_held, let_go, open_taking_over, running_elsewhere

__all__ = ["AcceleratorCheckpointer"]

#: Sharded state, or state held elsewhere: accelerator.save_state's own.
_UNSUPPORTED = (
    DistributedType.FSDP,
    DistributedType.DEEPSPEED,
    DistributedType.MEGATRON_LM,
    DistributedType.XLA,
)
#: Options decided here: every rank's RNG states are saved, every rank saves its part.
_RESERVED = {"capture_rng", "ranks", "read_only"}


class AcceleratorCheckpointer:
    """Checkpoints of everything ``accelerator`` tracks, to ``directory``; create it after
    ``accelerator.prepare(...)`` (and ``register_for_checkpointing``), on every rank.

    ``keep`` committed checkpoints stay on disk, or those a retention policy such as
    ``AnyOf(LatestN(2), EveryNSteps(1000))`` keeps (None keeps all); ``mode="sync"`` makes each save
    durable before it returns; ``options`` are other :class:`~nbckpt.CheckpointConfig` fields.
    """

    def __init__(
        self,
        accelerator: Accelerator,
        directory: str | os.PathLike[str],
        *,
        keep: int | RetentionPolicy | None = None,
        mode: str = "async",
        **options: Any,
    ) -> None:
        if not isinstance(accelerator, Accelerator):
            raise ConfigError(
                f"accelerator must be an accelerate.Accelerator, not {type(accelerator).__name__}"
            )
        if accelerator.distributed_type in _UNSUPPORTED:
            raise ConfigError(
                f"AcceleratorCheckpointer does not save {accelerator.distributed_type.value} state "
                "(sharded or held elsewhere); use accelerator.save_state"
            )
        reserved = sorted(_RESERVED & set(options))
        if reserved:
            raise ConfigError(f"AcceleratorCheckpointer decides {', '.join(reserved)} itself; drop it")
        self.accelerator = accelerator
        self.directory = os.path.abspath(os.fspath(directory))
        self._options: dict[str, Any] = {"mode": mode, "keep": keep, "capture_rng": True, **options}
        self._ckpt: Checkpointer | None = None
        self._thread: threading.Thread | None = None  # the one that saved or restored last
        _ = self.ckpt  # open now: a bad directory fails here

    @property
    def ckpt(self) -> Checkpointer:
        """The Checkpointer (opened again if a newer one on the directory took it over)."""
        if self._ckpt is None:
            self._ckpt = open_taking_over(
                self, self.directory, lambda: Checkpointer(self.directory, **self._options)
            )
        return self._ckpt

    def _busy_thread(self) -> threading.Thread | None:
        """The thread that saved or restored last, if another one and still running."""
        return running_elsewhere(self._thread)

    def _let_go(self) -> None:
        """Taken over by a newer one on the directory: close the Checkpointer."""
        ckpt, self._ckpt = self._ckpt, None
        close_held(ckpt)

    def state(self) -> dict[str, Any]:
        """What ``accelerator.save_state`` saves, as a Checkpointer state (objects by reference,
        named as accelerate names its files: ``model``, ``model_1``, ``optimizer``, ...): every
        prepared model (unwrapped from DDP), optimizer and LR scheduler, the objects given to
        ``register_for_checkpointing``, the dataloaders that keep a position (one per rank), the
        gradient scaler and ``accelerator.step``."""
        acc = self.accelerator
        objects = tracked(acc)
        state: dict[str, Any] = {}
        groups = {
            "model": [acc.unwrap_model(model) for model in objects.models],
            "optimizer": objects.optimizers,
            "scheduler": objects.schedulers,
            "custom": objects.custom,
        }
        for name, group in groups.items():
            for i, obj in enumerate(group):
                state[name if i == 0 else f"{name}_{i}"] = obj
        for i, loader in enumerate(objects.dataloaders):
            if getattr(loader, "use_stateful_dataloader", False):  # its position is this rank's own
                state[f"dataloader_{i}.rank{acc.process_index}"] = loader
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        state["accelerator_step"] = acc.step  # the gradient accumulation counter
        return state

    def save(self, step: int, **kwargs: Any) -> SaveHandle:
        """Start a checkpoint of :meth:`state` as ``step`` (``kwargs``: :meth:`Checkpointer.save`'s)."""
        self._thread = threading.current_thread()
        return self.ckpt.save(self.state(), step, **kwargs)

    def restore(self, step: int | None = None) -> int:
        """Load the newest (or ``step``'s) checkpoint into every object in place and set every
        rank's RNG states back; return its step, or 0 when there is no checkpoint yet."""
        self._thread = threading.current_thread()
        if step is None and self.ckpt.latest_step() is None:
            return 0
        state = self.state()
        restored = self.ckpt.restore(state, step)
        self.accelerator.step = state["accelerator_step"]
        return restored

    def wait(self) -> None:
        """Block until every save in flight has committed; raise the first that failed."""
        self.ckpt.wait()

    def close(self) -> None:
        """Wait for the saves in flight and release the directory."""
        if self._ckpt is not None:
            self._ckpt.close()
            let_go(self, self.directory)

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
