"""The checkpoint engine: stage into reused host images, persist in the background, commit atomically.

The bottom layer of nbckpt and the whole of the core install (``pip install nbckpt``): it
imports nothing from the bench, analysis or notebook layers. ``Checkpointer`` is its face,
retention policies say which steps it keeps, the timeline is the record of every phase it
runs. Glue the layers above share with it is in ``_internal``, not here.
"""

from ._checkpointer import Checkpointer, close_all
from ._config import CheckpointConfig
from ._retention import AnyOf, BestN, CustomSteps, EveryNSteps, LatestN, RetentionPolicy, StepInfo
from ._schedule import SaveSchedule
from ._timeline import Event, SaveHandle, SaveRecord, Timeline

__all__ = [
    "AnyOf",
    "BestN",
    "CheckpointConfig",
    "Checkpointer",
    "CustomSteps",
    "Event",
    "EveryNSteps",
    "LatestN",
    "RetentionPolicy",
    "SaveHandle",
    "SaveRecord",
    "SaveSchedule",
    "StepInfo",
    "Timeline",
    "close_all",
]
