"""What ``transformers`` does where a callback cannot see it, replicated in one place (checked
with transformers 5.25).

nbckpt's callback saves the Trainer's state as an evaluation ends, before the Trainer records
that evaluation's best metric and its step (``Trainer._determine_best_metric``, private, runs
right after the evaluation): :func:`count_evaluation` applies the same rule to the saved copy.
``tests/integrations/test_hf.py`` runs both on the same evaluations and fails, naming
transformers' version, when a release changes the rule or the method. And at a save step with
no training log line, the Trainer's own save adds the floating-point operations since its last
log line to ``total_flos``: :class:`FlosCounter` counts them (test_hf.py compares the saved
state with the Trainer's own checkpoint's, ``total_flos`` included).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerState, TrainingArguments
from transformers.trainer_pt_utils import distributed_broadcast_scalars
from transformers.training_args import ParallelMode

__all__ = ["FlosCounter", "count_evaluation"]


def count_evaluation(saved: dict[str, Any], args: TrainingArguments, metrics: dict[str, Any]) -> None:
    """Put into the saved copy of the Trainer's state (``saved``: ``TrainerState`` as a dict) what
    the Trainer sets right after this evaluation: the best metric and its step."""
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


class FlosCounter:
    """The floating-point operations the Trainer has counted since it last added them to
    ``state.total_flos``, for the saved copy of the state.

    The Trainer counts each training batch's (``Trainer.floating_point_ops``: 6 x the elements of
    the model's main input x its parameters outside embeddings) into a counter of its own and adds
    them to ``total_flos`` (``store_flos``) at each training log line and each of its own saves;
    callbacks never see that counter. This counts the same from the model's forward calls inside
    training steps (:meth:`attach`; ``counting`` between ``on_step_begin`` and ``on_step_end``), and
    :meth:`stored` starts again where the Trainer adds them.
    """

    def __init__(self) -> None:
        self.pending = 0.0
        self.counting = False
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    def attach(self, model: torch.nn.Module) -> None:
        self.detach()
        self.pending, self.counting = 0.0, False
        self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def stored(self) -> None:
        """The Trainer has just added its counter to ``state.total_flos``."""
        self.pending = 0.0

    def total(self, args: TrainingArguments, state: TrainerState) -> float:
        """``state.total_flos`` as the Trainer's ``store_flos`` would make it now (a collective
        under DDP: every rank calls it, as every rank saves)."""
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            summed = distributed_broadcast_scalars([self.pending], device=args.device).sum().item()
            return float(state.total_flos + summed)
        return float(state.total_flos + self.pending)

    def _count(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        main = getattr(module, "main_input_name", "input_ids")
        if self.counting and main in kwargs and hasattr(module, "num_parameters"):
            self.pending += float(6 * kwargs[main].numel() * module.num_parameters(exclude_embeddings=True))
