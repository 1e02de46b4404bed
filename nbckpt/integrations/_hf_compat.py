"""What a private ``transformers`` method does, replicated in one place (checked with
transformers 5.25).

nbckpt's callback saves the Trainer's state as an evaluation ends, before the Trainer records
that evaluation's best metric and its step (``Trainer._determine_best_metric``, private, runs
right after the evaluation): :func:`count_evaluation` applies the same rule to the saved copy.
``tests/integrations/test_hf.py`` runs both on the same evaluations and fails, naming
transformers' version, when a release changes the rule or the method.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments

__all__ = ["count_evaluation"]


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
