"""nbckpt behind ``transformers.Trainer``: asynchronous saves through the public callback API.

>>> from nbckpt.integrations.hf import NbckptCallback
>>> cb = NbckptCallback("ckpt/run1", keep=2)
>>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[cb])
>>> trainer.train(resume_from_checkpoint=cb.resume_checkpoint())   # None on a fresh start

The Trainer's own policy decides *when* to save (``save_strategy``, ``save_steps``), and so does,
beside it, a save schedule given to the callback (``NbckptCallback(dir,
schedule=SaveSchedule(mtbf="8h"))``: the interval this run's measured save costs advise, asked
after each step; ``save_strategy="no"`` leaves it alone). At each of
those moments the callback starts an nbckpt save of the model, optimizer, LR scheduler, RNG
states and ``TrainerState``, returns once it is copied, and tells the Trainer not to write its own
synchronous ``checkpoint-N/`` folder. ``keep`` plays ``save_total_limit``'s part (without
``keep``, ``save_total_limit`` itself applies; with both, ``keep`` does, with a warning; a number, or a
retention policy such as ``BestN("eval_loss", 2)``: each save carries the step's evaluation
metrics); as with ``save_total_limit``, the Trainer's best step is kept too. When the step
also logs or is evaluated, the save waits for its log line and evaluation, as the Trainer's own
does: the saved state is the one the Trainer's own checkpoint holds (its log lines, metrics, best
metric and ``total_flos``).

Under ``torchrun`` every rank saves its part (the model and optimizer once, spread over the
ranks; each rank's RNG states under its own key). The Checkpointer opens at first use, once the
``TrainingArguments`` have joined the process group. A notebook cell run again makes a new
callback on the same directory while the old one is still bound: the new one closes the old one's
Checkpointer (its saves in flight commit) and takes the directory over, unless the old one is
training on another thread (then a ConfigError names it). The old one opens it again if used.

Resuming uses the Trainer's own resume path, which reads a ``checkpoint-N/`` folder:
:meth:`NbckptCallback.resume_checkpoint` writes one from the newest nbckpt step (weights,
``optimizer.pt``, ``scheduler.pt``, ``trainer_state.json`` from rank 0, and each rank's own
``rng_state_{rank}.pth``, ``rng_state.pth`` in one process) and returns its path, so batches are
skipped and RNGs set exactly as the Trainer does it. The folder is removed once every rank has
read it (at the first training step). That is one synchronous write of the state per resume,
not per save. nbckpt makes that folder itself and marks it (:data:`RESUME_MARKER`): a folder it
did not make (the Trainer's ``output_dir``, the run) is refused, never removed.

``load_best_model_at_end=True`` works as with the Trainer's checkpoints: the best step is the
newest saved step whose metric was the best so far, and at the end of training its weights are
loaded into the model and ``state.best_model_checkpoint`` names its step directory.

Not covered: ``save_strategy="best"`` (the Trainer decides that save after evaluating, where no
callback can take it over: the Trainer then saves itself), DeepSpeed and FSDP (their optimizer
state is sharded: use their own checkpointing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import shutil
import sys
import threading
from typing import Any, cast

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy
from transformers.utils import WEIGHTS_NAME
from transformers.utils.peft_utils import ADAPTER_CONFIG_NAME, ADAPTER_SAFE_WEIGHTS_NAME

from .._errors import ConfigError
from ..engine import AnyOf, CheckpointConfig, Checkpointer, CustomSteps, RetentionPolicy, SaveHandle
from ..engine._internal import step_name, write_atomic
from ._common import atomic_torch_save, close_held, let_go, open_taking_over, running_elsewhere, said_waited
from ._hf_compat import FlosCounter, count_evaluation

__all__ = ["NbckptCallback"]

_log = logging.getLogger("nbckpt")
#: Options the callback decides itself: the RNGs are saved in the Trainer's format, every rank saves.
_RESERVED = {"capture_rng", "ranks", "read_only"}
#: The file nbckpt writes in each resume folder it makes: only a folder holding it is ever removed.
RESUME_MARKER = ".nbckpt-resume"
#: What nbckpt writes in a resume folder's ``checkpoint-N/`` (and write_atomic's temporary files).
_WRITTEN = (
    "|".join(re.escape(n) for n in (WEIGHTS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME))
    + r"|rng_state(?:_[0-9]+)?\.pth"
)
#: The save strategies at which the Trainer records its best checkpoint as it saves.
_BEST_RECORDED = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
_RESUME_FILE = re.compile(rf"(?:{_WRITTEN})|\.(?:{_WRITTEN})\.tmp-.+")


class NbckptCallback(TrainerCallback):  # type: ignore[misc]
    """Takes over the Trainer's checkpoint saves with asynchronous nbckpt saves to ``directory``.

    ``keep`` committed checkpoints stay on disk, or those a retention policy keeps (None keeps
    all), and the Trainer's best step; ``mode="sync"`` makes each save durable before training
    goes on; ``options`` are other :class:`~nbckpt.CheckpointConfig` fields, among them
    ``schedule`` (a :class:`~nbckpt.SaveSchedule`: a save whenever it says one is due, on every
    rank alike; ``ckpt.save_interval`` says why). Host memory: ``max_inflight`` copies of the
    state (1 by default).
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
                f"NbckptCallback decides {', '.join(reserved)} itself (RNG states in the Trainer's "
                "format, every rank saving its part); drop it"
            )
        self.directory = os.path.abspath(os.fspath(directory))
        config = CheckpointConfig.build(None, mode=mode, keep=keep, **options)  # fail now, not mid-run
        self._config = self._with_best(config)
        self._ckpt: Checkpointer | None = None
        self._saved: set[int] = set()  # steps on disk at the start and saved since: the same on every rank
        self.handles: list[SaveHandle] = []
        self._warned_wait = False  # a save waited for the one before it: said as a warning once
        self.best_step: int | None = None
        """The step ``load_best_model_at_end`` loads: the newest saved step that was the best so far."""
        self._due = False  # a save taken over from the Trainer, waiting for this step's evaluation
        self._resume_folder: str | None = None  # written by resume_checkpoint, removed once read
        self._flos = FlosCounter()  # what the Trainer's own save would add to total_flos
        self._training: threading.Thread | None = None  # from on_train_begin to on_train_end

    @property
    def ckpt(self) -> Checkpointer:
        """The Checkpointer, opened at first use (under torchrun: after the process group exists)."""
        if self._ckpt is None:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _distributed():
                raise ConfigError(
                    "NbckptCallback under torchrun opens its directory once the process group "
                    "exists: create the TrainingArguments (they join it) before using the callback"
                )
            self._ckpt = open_taking_over(
                self, self.directory, lambda: Checkpointer(self.directory, config=self._config)
            )
            self._saved = set(self._ckpt.steps())
        return self._ckpt

    def _busy_thread(self) -> threading.Thread | None:
        """The thread training with this callback now, if another one: a training interrupted
        on this thread (a cell's Ctrl-C: no on_train_end) is over."""
        return running_elsewhere(self._training)

    def _let_go(self) -> None:
        """Taken over by a newer callback on the directory: close the Checkpointer."""
        ckpt, self._ckpt = self._ckpt, None
        close_held(ckpt)

    def _with_best(self, config: CheckpointConfig) -> CheckpointConfig:
        """As ``save_total_limit`` does, a retention that never deletes the Trainer's best step."""
        if config.retention is None:
            return config
        return CheckpointConfig.build(config, keep=AnyOf(config.retention, CustomSteps(self._best)))

    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        limit = args.save_total_limit
        if limit and self._ckpt is None:  # the Trainer's own retention, taken over with its saves
            if self._config.keep is None:
                self._config = self._with_best(CheckpointConfig.build(self._config, keep=limit))
            else:
                _log.warning(
                    "nbckpt: NbckptCallback keeps %s; TrainingArguments.save_total_limit=%s is not "
                    "applied (pass one of the two)",
                    self._config.keep,
                    limit,
                )
        _ = self.ckpt  # open now: a bad directory fails before training, on every rank

    # -- saving -------------------------------------------------------------------------------

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flos.counting = False  # the step's batches are counted; evaluations are not
        if self._config.schedule is not None and self.ckpt.due():  # every rank asks: rank 0 decides
            control.should_save = True
        self._take_over(args, state, control, kwargs)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._take_over(args, state, control, kwargs)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._due and control.should_save:  # still ours: no other callback took the save back
            self._save(args, state, control, kwargs, kwargs.get("metrics") or {})

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if "loss" in (
            kwargs.get("logs") or {}
        ):  # a training log line: total_flos was just brought up to date
            self._flos.stored()
        if self._due and control.should_save and not control.should_evaluate:  # else on_evaluate saves
            self._save(args, state, control, kwargs, None)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._training = threading.current_thread()
        if args.load_best_model_at_end and _names_a_step_of(state.best_model_checkpoint, self.directory):
            # A resumed state names nbckpt's best step: the Trainer would look for its own weight
            # files there at the end (a warning that it found none); on_train_end loads it instead.
            state.best_model_checkpoint = None
        if kwargs.get("model") is not None:
            self._flos.attach(kwargs["model"])

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flos.stored()  # a save the Trainer made itself (save_strategy="best") stored them

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flos.counting = True
        self._due = False  # a save left to the Trainer (an evaluation another callback called off)
        # The Trainer has read the resume folder by now (the RNG file last, before this step).
        self._remove_resume_folder()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flos.detach()
        self._training = None
        self.ckpt.wait()  # the run's checkpoints are durable when train() returns; raises a failure
        self._remove_resume_folder()
        model = kwargs.get("model")
        if args.load_best_model_at_end and self.best_step is not None and model is not None:
            # The Trainer loads its best checkpoint just before this, from a folder it never wrote.
            _log.info("nbckpt: loading the best model, step %s (score %s)", self.best_step, state.best_metric)
            if _peft_adapter(model) is None:
                self.ckpt.restore({"model": model}, step=self.best_step, rng=False)
            else:
                best = self.ckpt.load(self.best_step)["model"]
                sys.modules["peft"].set_peft_model_state_dict(model, best, adapter_name=model.active_adapter)
            state.best_model_checkpoint = os.path.join(self.directory, step_name(self.best_step))

    def _take_over(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, objects: dict[str, Any]
    ) -> None:
        if not control.should_save or objects.get("model") is None or objects.get("optimizer") is None:
            return  # nothing to take over: the Trainer saves by itself
        if control.should_evaluate or control.should_log:
            # the Trainer logs and evaluates, then saves (the step's log line is in its saved
            # state): so does this callback, from on_log or on_evaluate; if neither comes, the
            # save is still the Trainer's to make
            self._due = True
        else:
            self._save(args, state, control, objects, None)

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
        trainer_state["total_flos"] = self._flos.total(args, state)  # as the Trainer's save stores them
        if metrics is not None:
            count_evaluation(trainer_state, args, metrics)
        self._saved.add(state.global_step)
        if trainer_state["best_global_step"] in self._saved:
            self.best_step = trainer_state["best_global_step"]  # as the Trainer does: if it was saved
        if self.best_step is not None and args.save_strategy in _BEST_RECORDED:
            # what the Trainer records at each of its saves: its best saved checkpoint
            best = os.path.join(self.directory, step_name(self.best_step))
            trainer_state["best_model_checkpoint"] = best
            if not args.load_best_model_at_end:  # else on_train_end names it, once it is loaded
                state.best_model_checkpoint = best
        rank, world = _rank_and_world()
        adapter = _peft_adapter(objects["model"])
        saved: dict[str, Any] = {
            "model": objects["model"] if adapter is None else adapter[0],
            "optimizer": objects["optimizer"],
            "trainer_state": json.dumps(trainer_state, sort_keys=True),
            "rng": {"world_size": world, f"rank{rank}": _rng_states(world)},  # each rank its own key
            "best_step": self.best_step,
        }
        if objects.get("lr_scheduler") is not None:
            saved["lr_scheduler"] = objects["lr_scheduler"]
        if adapter is not None:
            saved["peft_config"] = adapter[1]
        self.handles = [h for h in self.handles if not h.done()]
        numbers = {k: v for k, v in (metrics or {}).items() if type(v) in (int, float)}  # for BestN
        handle = self.ckpt.save(saved, step=state.global_step, overwrite=True, metrics=numbers)
        self.handles.append(handle)
        self._warned_wait |= said_waited(handle, self.ckpt.config.max_inflight, self._warned_wait)
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
        (default: ``<directory>-resume``), which nbckpt makes, replacing an older one it made
        there, and removed once the Trainer has read it. A ``folder`` that exists and is not one
        nbckpt made (the Trainer's ``output_dir``) is a ConfigError: nothing in it is touched.
        """
        if step is None:
            step = self.ckpt.latest_step()
            if step is None:
                return None
        data = self.ckpt.load(step)  # this rank's part: its own RNG states
        rank, world = _rank_and_world()
        base = os.path.abspath(os.fspath(folder)) if folder is not None else self.directory + "-resume"
        out = os.path.join(base, f"checkpoint-{step}")
        refused = _not_ours(base, self.directory)  # every rank, before rank 0 changes anything
        if refused is not None:
            raise ConfigError(
                f"resume_checkpoint(folder={base}): {refused}; it would be replaced and removed. Name a "
                "folder nbckpt can make for itself (one that does not exist yet)"
            )
        _barrier()  # every rank has looked before rank 0 replaces an older folder of ours
        if rank == 0:
            if os.path.lexists(base):
                shutil.rmtree(base)
            os.makedirs(base)
            # the marker first: a folder cut short after it is still known as ours next time
            write_atomic(os.path.join(base, RESUME_MARKER), b"made by nbckpt's resume_checkpoint\n")
            os.makedirs(out)
            if "peft_config" in data:  # what the Trainer's own save writes for a PEFT model
                from safetensors.torch import save as safetensors_bytes

                adapter = {k: v.contiguous() for k, v in data["model"].items()}
                write_atomic(os.path.join(out, ADAPTER_SAFE_WEIGHTS_NAME), safetensors_bytes(adapter))
                write_atomic(os.path.join(out, ADAPTER_CONFIG_NAME), data["peft_config"].encode())
            else:
                atomic_torch_save(data["model"], os.path.join(out, WEIGHTS_NAME))
            atomic_torch_save(data["optimizer"], os.path.join(out, OPTIMIZER_NAME))
            if "lr_scheduler" in data:
                atomic_torch_save(data["lr_scheduler"], os.path.join(out, SCHEDULER_NAME))
            write_atomic(os.path.join(out, TRAINER_STATE_NAME), data["trainer_state"].encode())
        _barrier()  # the folder exists before any rank writes its RNG file into it
        rng = data.get("rng", {})
        mine = rng.get(f"rank{rank}")
        if mine is not None and rng.get("world_size") == world:
            name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"  # what the Trainer reads
            atomic_torch_save(_rng_for_trainer(mine), os.path.join(out, name))
        else:
            _log.warning(
                "nbckpt: step %s holds no RNG states for rank %s of %s: the resumed run draws other "
                "random numbers than an uninterrupted one would",
                step,
                rank,
                world,
            )
        self.best_step = data.get("best_step")
        self._resume_folder = base
        _barrier()  # every rank's files are there before the Trainer reads them
        return out

    def _remove_resume_folder(self) -> None:
        if self._resume_folder is None:
            return
        _barrier()  # every rank has read its files
        folder, self._resume_folder = self._resume_folder, None
        if _rank_and_world()[0] != 0:
            return
        refused = _not_ours(folder, self.directory)
        if refused is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:  # something appeared in it since: left as it is
            _log.warning("nbckpt: leaving the resume folder %s in place: %s", folder, refused)

    def close(self) -> None:
        """Wait for the saves in flight and release the directory."""
        if self._ckpt is not None:
            self._ckpt.close()
            let_go(self, self.directory)


def _not_ours(folder: str, run: str) -> str | None:
    """Why ``folder`` is not a resume folder nbckpt made (None: it is, or it does not exist): it
    must be a real directory holding nbckpt's marker and only the ``checkpoint-N/`` folders of
    files nbckpt writes, and neither hold the run nor lie inside it."""
    inside = os.path.commonpath([folder, run])
    if inside in (folder, run):
        return f"it {'holds' if inside == folder else 'is inside'} the nbckpt run {run}"
    if not os.path.lexists(folder):
        return None
    if os.path.islink(folder) or not os.path.isdir(folder):
        return "it exists and is not a directory nbckpt made (a file or a link)"
    if not os.path.isfile(os.path.join(folder, RESUME_MARKER)):
        return f"it exists and is not a folder nbckpt made (no {RESUME_MARKER} in it)"
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name == RESUME_MARKER:
            continue
        folder_of_ours = re.fullmatch(r"checkpoint-[0-9]+", name) and not os.path.islink(path)
        if not (folder_of_ours and os.path.isdir(path)):
            return f"it holds {name!r}, which nbckpt did not write"
        strange = [f for f in os.listdir(path) if not _RESUME_FILE.fullmatch(f)]
        if strange:
            return f"it holds {name}/{strange[0]}, which nbckpt did not write"
    return None


def _names_a_step_of(path: str | None, run: str) -> bool:
    return path is not None and os.path.dirname(os.path.abspath(path)) == run


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _peft_adapter(model: Any) -> tuple[dict[str, torch.Tensor], str] | None:
    """For a PEFT model, what the Trainer's own save writes (``save_pretrained`` of the adapter
    alone): the active adapter's tensors and its config as JSON; None for any other model. A
    ``PeftModel`` exists only where peft is imported, so nothing is imported here."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return None
    name = model.active_adapter
    config = model.peft_config[name].to_dict()
    text = json.dumps(config, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))
    return peft.get_peft_model_state_dict(model, adapter_name=name), text


def _rank_and_world() -> tuple[int, int]:
    """This process's global rank and the world size (what the Trainer calls process_index)."""
    if _distributed():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _distributed() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _rng_states(world: int) -> dict[str, Any]:
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
    if torch.cuda.is_available():  # every device's under DDP, as the Trainer loads them then
        cuda = torch.cuda.random
        rng["cuda"] = cuda.get_rng_state_all() if world > 1 else cuda.get_rng_state()
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
