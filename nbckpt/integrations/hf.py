"""nbckpt behind ``transformers.Trainer``: asynchronous saves through the public callback API.

>>> from nbckpt.integrations.hf import NbckptCallback
>>> cb = NbckptCallback("ckpt/run1", keep=args.save_total_limit)
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
>>> trainer.train(resume_from_checkpoint=cb.resume_checkpoint())   # None on a fresh start

The Trainer's own policy decides *when* to save (``save_strategy``, ``save_steps``); at each of
those moments the callback starts an nbckpt save of the model, optimizer, LR scheduler, RNG
states and ``TrainerState``, returns once it is copied, and tells the Trainer not to write its own
synchronous ``checkpoint-N/`` folder. ``keep`` plays ``save_total_limit``'s part.

Resuming uses the Trainer's own resume path, which reads a ``checkpoint-N/`` folder:
:meth:`NbckptCallback.resume_checkpoint` writes one from the newest nbckpt step (weights,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``) and returns its
path, so batches are skipped and RNGs set exactly as the Trainer does it. That is one
synchronous write of the state per resume, not per save.

Not covered: ``save_strategy="best"`` (the Trainer decides that save after evaluating, where no
callback can take it over: the Trainer then saves itself), DeepSpeed and FSDP (their optimizer
state is sharded: use their own checkpointing).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Any, cast

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.utils import WEIGHTS_NAME

from .._errors import ConfigError
from ..engine import Checkpointer, SaveHandle
from ._common import atomic_torch_save, atomic_write

__all__ = ["NbckptCallback"]

_RNG_NAME = "rng_state.pth"


class NbckptCallback(TrainerCallback):  # type: ignore[misc]
    """Takes over the Trainer's checkpoint saves with asynchronous nbckpt saves to ``directory``.

    ``keep`` committed checkpoints stay on disk (None keeps all); ``mode="sync"`` makes each
    save durable before training goes on; ``options`` are other :class:`~nbckpt.CheckpointConfig`
    fields. Host memory: ``max_inflight`` copies of the state (1 by default).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = None,
        mode: str = "async",
        **options: Any,
    ) -> None:
        if options.get("capture_rng"):
            raise ConfigError(
                "NbckptCallback saves the RNG states in the Trainer's own format; drop capture_rng"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        self.ckpt = Checkpointer(self.directory, mode=mode, keep=keep, **options)  # type: ignore[arg-type]
        self.handles: list[SaveHandle] = []

    # -- saving -------------------------------------------------------------------------------

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._maybe_save(args, state, control, kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._maybe_save(args, state, control, kwargs)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.ckpt.wait()  # the run's checkpoints are durable when train() returns; raises a failure

    def _maybe_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, objects: dict[str, Any]
    ) -> None:
        if not control.should_save:
            return
        model, optimizer = objects.get("model"), objects.get("optimizer")
        if model is None or optimizer is None:
            return  # nothing to take over: the Trainer saves by itself
        # The Trainer's own save records the control flags as they are now; callbacks do not see
        # the other stateful callbacks, whose saved state stays what the run began with.
        if isinstance(control, ExportableState):
            # typed as a list in TrainerState, a dict of name -> state at run time
            stateful = cast(dict[str, Any], state.stateful_callbacks)
            stateful[type(control).__name__] = control.state()
        saved: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "trainer_state": json.dumps(_state_dict(state), sort_keys=True),
            "rng": _rng_states(),
        }
        scheduler = objects.get("lr_scheduler")
        if scheduler is not None:
            saved["lr_scheduler"] = scheduler
        self.handles = [h for h in self.handles if not h.done()]
        self.handles.append(self.ckpt.save(saved, step=state.global_step, overwrite=True))
        control.should_save = False  # saved here: the Trainer skips its synchronous checkpoint-N/

    # -- resuming -----------------------------------------------------------------------------

    def resume_checkpoint(
        self, step: int | None = None, folder: str | os.PathLike[str] | None = None
    ) -> str | None:
        """A ``checkpoint-N/`` folder of the newest (or ``step``'s) checkpoint for
        ``trainer.train(resume_from_checkpoint=...)``; None when there is no checkpoint yet.

        Written to ``folder`` (default: ``<directory>-resume``), replacing an older one there.
        """
        if step is None:
            step = self.ckpt.latest_step()
            if step is None:
                return None
        data = self.ckpt.load(step)
        base = os.path.abspath(os.fspath(folder)) if folder is not None else self.directory + "-resume"
        out = os.path.join(base, f"checkpoint-{step}")
        if os.path.isdir(base):
            shutil.rmtree(base)
        os.makedirs(out)
        atomic_torch_save(data["model"], os.path.join(out, WEIGHTS_NAME))
        atomic_torch_save(data["optimizer"], os.path.join(out, OPTIMIZER_NAME))
        if "lr_scheduler" in data:
            atomic_torch_save(data["lr_scheduler"], os.path.join(out, SCHEDULER_NAME))
        atomic_torch_save(_rng_for_trainer(data["rng"]), os.path.join(out, _RNG_NAME))
        atomic_write(os.path.join(out, TRAINER_STATE_NAME), data["trainer_state"].encode())
        return out

    def close(self) -> None:
        """Wait for the saves in flight and release the directory."""
        self.ckpt.close()


def _state_dict(state: TrainerState) -> dict[str, Any]:
    # TrainerState.save_to_json writes exactly these fields; to_json_string is not in every version.
    import dataclasses

    return dataclasses.asdict(state)


def _rng_states() -> dict[str, Any]:
    """The RNG states the Trainer saves (``rng_state.pth``), in values nbckpt stores as they are
    (numpy's key as a tensor: ``load(map_location="meta")`` cannot give an ndarray without data)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state())
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.array(keys, dtype=np.uint32)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.random.get_rng_state()
    return rng


def _rng_for_trainer(saved: dict[str, Any]) -> dict[str, Any]:
    """Back into the exact objects ``random.setstate`` and ``np.random.set_state`` take."""
    py, npy = saved["python"], saved["numpy"]
    out: dict[str, Any] = {
        "python": (py["version"], tuple(py["state"]), py["gauss"]),
        "numpy": (npy["kind"], npy["keys"].numpy(), npy["pos"], npy["has_gauss"], npy["cached"]),
        "cpu": saved["cpu"],
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out
