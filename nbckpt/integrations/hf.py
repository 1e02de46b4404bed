"""nbckpt behind ``transformers.Trainer``: asynchronous saves through the public callback API.

>>> cb = NbckptCallback("ckpt/run1", keep=2)
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
>>> trainer.train(resume_from_checkpoint=cb.resume_checkpoint())   # None on a fresh start

The Trainer's policy decides *when* to save; at each of those moments the callback saves the
model, optimizer, LR scheduler, RNG states and ``TrainerState`` asynchronously (after the step's
evaluation, if any, as the Trainer does) and tells the Trainer to skip its own ``checkpoint-N/``.
The Trainer resumes only from such a folder: :meth:`NbckptCallback.resume_checkpoint` writes one
from the newest step, removed once read. What it covers and not: docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
from ..engine import AnyOf, CheckpointConfig, Checkpointer, CustomSteps, RetentionPolicy, SaveHandle
from ..engine._internal import step_name, write_atomic
from ._common import atomic_torch_save

__all__ = ["NbckptCallback"]

_log = logging.getLogger("nbckpt")
#: Options the callback decides itself: every rank saves its part and its RNG states.
_RESERVED = {"capture_rng", "ranks", "read_only"}
#: The Trainer's files of a ``checkpoint-N/`` folder, and the saved entries they hold.
_FILES = {WEIGHTS_NAME: "model", OPTIMIZER_NAME: "optimizer", SCHEDULER_NAME: "lr_scheduler"}


class NbckptCallback(TrainerCallback):  # type: ignore[misc]
    """Takes over the Trainer's checkpoint saves with asynchronous nbckpt saves to ``directory``.

    ``keep`` committed checkpoints stay on disk, or those a retention policy keeps (None keeps
    all), and the Trainer's best step; ``mode="sync"`` makes each save durable before training
    goes on; ``options`` are other :class:`~nbckpt.CheckpointConfig` fields. Host memory:
    ``max_inflight`` copies of the state (1 by default).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | RetentionPolicy | None = None,
        mode: str = "async",
        **options: Any,
    ) -> None:
        reserved = sorted(_RESERVED & set(options))
        if reserved:
            raise ConfigError(
                f"NbckptCallback decides {', '.join(reserved)} itself (every rank saving its part "
                "and its RNG states); drop it"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        config = CheckpointConfig.build(None, mode=mode, keep=keep, capture_rng=True, **options)  # fail now
        if config.retention is not None:  # as save_total_limit does, never delete the best step
            config = CheckpointConfig.build(config, keep=AnyOf(config.retention, CustomSteps(self._best)))
        self._config = config
        self._ckpt: Checkpointer | None = None
        self._saved: set[int] = set()  # steps on disk at the start and saved since: the same on every rank
        self.handles: list[SaveHandle] = []
        self.best_step: int | None = None
        """The step ``load_best_model_at_end`` loads: the newest saved step that was the best so far."""
        self._due = False  # a save taken over from the Trainer, waiting for this step's evaluation
        self._resume_folder: str | None = None  # written by resume_checkpoint, removed once read

    @property
    def ckpt(self) -> Checkpointer:
        """The Checkpointer, opened at first use (under torchrun: after the process group exists)."""
        if self._ckpt is None:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _distributed():
                raise ConfigError(
                    "NbckptCallback under torchrun opens its directory once the process group "
                    "exists: create the TrainingArguments (they join it) before using the callback"
                )
            self._ckpt = Checkpointer(self.directory, config=self._config)
            self._saved = set(self._ckpt.steps())
        return self._ckpt

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        _ = self.ckpt  # open now: a bad directory fails before training, on every rank

    # -- saving -------------------------------------------------------------------------------

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not control.should_save or kwargs.get("model") is None or kwargs.get("optimizer") is None:
            return  # nothing to take over: the Trainer saves by itself
        if control.should_evaluate:
            self._due = True  # the Trainer evaluates, then saves: so does this callback
        else:
            self._save(args, state, control, kwargs, None)

    on_epoch_end = on_step_end

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._due and control.should_save:  # still ours: no other callback took the save back
            self._save(args, state, control, kwargs, kwargs.get("metrics") or {})

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._due = False  # a save left to the Trainer (an evaluation another callback called off)
        # The Trainer has read the resume folder by now (the RNG file last, before this step).
        self._remove_resume_folder()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.ckpt.wait()  # the run's checkpoints are durable when train() returns; raises a failure
        self._remove_resume_folder()
        model = kwargs.get("model")
        if args.load_best_model_at_end and self.best_step is not None and model is not None:
            # The Trainer loads its best checkpoint just before this, from a folder it never wrote.
            _log.info("nbckpt: loading the best model, step %s (score %s)", self.best_step, state.best_metric)
            self.ckpt.restore({"model": model}, step=self.best_step, rng=False)
            state.best_model_checkpoint = os.path.join(self.directory, step_name(self.best_step))

    def _save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        objects: dict[str, Any],
        metrics: dict[str, Any] | None,
    ) -> None:
        self._due = False
        # The Trainer's own save records the control flags as they are now; callbacks do not see
        # the other stateful callbacks, whose saved state stays what the run began with.
        if isinstance(control, ExportableState):
            # typed as a list in TrainerState, a dict of name -> state at run time
            stateful = cast(dict[str, Any], state.stateful_callbacks)
            stateful[type(control).__name__] = control.state()
        trainer_state = dataclasses.asdict(state)  # what TrainerState.save_to_json writes
        # as rank 0 writes it (the Trainer's file is rank 0's): one value on every rank
        trainer_state.update(is_local_process_zero=True, is_world_process_zero=True)
        if metrics is not None:
            _count_evaluation(trainer_state, args, metrics)
        self._saved.add(state.global_step)
        if trainer_state["best_global_step"] in self._saved:
            self.best_step = trainer_state["best_global_step"]  # as the Trainer does: if it was saved
        saved = {key: objects[key] for key in _FILES.values() if objects.get(key) is not None}
        saved.update(trainer_state=json.dumps(trainer_state, sort_keys=True), best_step=self.best_step)
        self.handles = [h for h in self.handles if not h.done()]
        numbers = {k: v for k, v in (metrics or {}).items() if type(v) in (int, float)}  # for BestN
        self.handles.append(self.ckpt.save(saved, step=state.global_step, overwrite=True, metrics=numbers))
        control.should_save = False  # saved here: the Trainer skips its synchronous checkpoint-N/

    def _best(self) -> tuple[int, ...]:
        """The step the retention policy keeps beside ``keep``'s: the Trainer's best."""
        return () if self.best_step is None else (self.best_step,)

    # -- resuming -----------------------------------------------------------------------------

    def resume_checkpoint(
        self, step: int | None = None, folder: str | os.PathLike[str] | None = None
    ) -> str | None:
        """A ``checkpoint-N/`` folder of the newest (or ``step``'s) checkpoint for
        ``trainer.train(resume_from_checkpoint=...)``; None when there is no checkpoint yet.

        Every rank calls it (under torchrun), and gets the same path. Written to ``folder``
        (default: ``<directory>-resume``), replacing an older one there, and removed once the
        Trainer has read it.
        """
        if step is None:
            step = self.ckpt.latest_step()
            if step is None:
                return None
        data = self.ckpt.load(step)
        rank, world = self.ckpt.rank, self.ckpt.world_size
        base = os.path.abspath(os.fspath(folder)) if folder is not None else self.directory + "-resume"
        out = os.path.join(base, f"checkpoint-{step}")
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(out)
            for name, key in _FILES.items():
                if key in data:
                    atomic_torch_save(data[key], os.path.join(out, name))
            write_atomic(os.path.join(out, TRAINER_STATE_NAME), data["trainer_state"].encode())
        _barrier()  # the folder exists before any rank writes its RNG file into it
        self.ckpt.restore({"trainer_state": None}, step)  # sets this rank's RNG states as saved
        name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"  # what the Trainer reads
        atomic_torch_save(_rng_states(world), os.path.join(out, name))
        self.best_step = data.get("best_step")
        self._resume_folder = base
        _barrier()  # every rank's files are there before the Trainer reads them
        return out

    def _remove_resume_folder(self) -> None:
        if self._resume_folder is None:
            return
        _barrier()  # every rank has read its files
        if self.ckpt.rank == 0:
            shutil.rmtree(self._resume_folder, ignore_errors=True)
        self._resume_folder = None

    def close(self) -> None:
        """Wait for the saves in flight and release the directory."""
        if self._ckpt is not None:
            self._ckpt.close()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _barrier() -> None:
    if _distributed() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _count_evaluation(saved: dict[str, Any], args: TrainingArguments, metrics: dict[str, Any]) -> None:
    """Put into the saved copy of the Trainer's state what the Trainer sets right after this
    evaluation (``Trainer._determine_best_metric``): the best metric and its step."""
    name = args.metric_for_best_model
    if name is None:
        return
    value = metrics.get(name if name.startswith("eval_") else f"eval_{name}")
    if value is None:
        return  # the Trainer raises a KeyError naming the metric right after
    greater = bool(args.greater_is_better)
    if saved["best_metric"] is None:
        saved["best_metric"] = float("-inf") if greater else float("inf")
    if (value > saved["best_metric"]) if greater else (value < saved["best_metric"]):
        saved["best_metric"] = value
        saved["best_global_step"] = saved["global_step"]


def _rng_states(world: int) -> dict[str, Any]:
    """This process's RNG states as the Trainer saves them (``Trainer._save_rng_state``)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():  # every device's under DDP, as the Trainer loads them then
        cuda = torch.cuda.random
        states["cuda"] = cuda.get_rng_state_all() if world > 1 else cuda.get_rng_state()
    return states
