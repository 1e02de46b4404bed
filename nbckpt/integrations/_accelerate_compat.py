"""Every private ``accelerate`` name nbckpt reads, in one place (checked with accelerate 1.16).

``Accelerator`` keeps what ``save_state`` saves in five private lists and no public way to see
them: ``register_save_state_pre_hook`` hands its hooks the models and their weights only (not the
optimizers, schedulers, dataloaders or registered objects), and only from inside ``save_state``,
after that has already begun its own synchronous write; ``register_for_checkpointing`` adds to
one of those lists. So :class:`~nbckpt.integrations.accelerate.AcceleratorCheckpointer` reads
the lists here, and :func:`missing` (tested) says when an accelerate release renames one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import accelerate
from accelerate import Accelerator

from .._errors import CheckpointError

__all__ = ["Tracked", "missing", "tracked"]

#: The private attributes of an ``Accelerator`` that hold what ``save_state`` saves.
_LISTS = ("_models", "_optimizers", "_schedulers", "_custom_objects", "_dataloaders")


@dataclass(frozen=True)
class Tracked:
    """What ``accelerator.save_state`` saves, in the order it numbers its files."""

    models: list[Any]
    optimizers: list[Any]
    schedulers: list[Any]
    custom: list[Any]
    dataloaders: list[Any]


def missing(accelerator: Accelerator) -> list[str]:
    """The private lists of ``accelerator`` this module reads that it lacks (none: all is well)."""
    return [
        f"Accelerator.{name}" for name in _LISTS if not isinstance(getattr(accelerator, name, None), list)
    ]


def tracked(accelerator: Accelerator) -> Tracked:
    """The objects ``accelerator`` tracks; a one-line error naming accelerate's version when
    this version keeps them elsewhere."""
    gone = missing(accelerator)
    if gone:
        raise CheckpointError(
            f"accelerate {accelerate.__version__} keeps no {', '.join(gone)}, where nbckpt finds what "
            "save_state saves; use accelerator.save_state, or an accelerate release nbckpt supports"
        )
    return Tracked(*(list(getattr(accelerator, name)) for name in _LISTS))
