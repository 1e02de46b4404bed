"""The checkpoint engine: stage into reused host images, persist in the background, commit atomically.

The bottom layer of nbckpt: it imports nothing from the bench, analysis or notebook layers.
``Checkpointer`` is its face; the timeline is the record of every phase it runs.
"""

from ._checkpointer import Checkpointer, close_all, writer_of
from ._config import CheckpointConfig
from ._format import MAX_STEP, POINTER_FORMAT, POINTER_LIMIT, step_name
from ._handles import SaveHandle, SaveRecord
from ._retention import AnyOf, BestN, CustomSteps, EveryNSteps, LatestN, RetentionPolicy, StepInfo
from ._state import flatten
from ._timeline import COLUMNS as TIMELINE_COLUMNS
from ._timeline import KINDS as EVENT_KINDS
from ._timeline import Event, EventListener, Timeline, events_to_pandas, now_ns

__all__ = [
    "EVENT_KINDS",
    "MAX_STEP",
    "POINTER_FORMAT",
    "POINTER_LIMIT",
    "TIMELINE_COLUMNS",
    "AnyOf",
    "BestN",
    "CheckpointConfig",
    "Checkpointer",
    "CustomSteps",
    "Event",
    "EventListener",
    "EveryNSteps",
    "LatestN",
    "RetentionPolicy",
    "SaveHandle",
    "SaveRecord",
    "StepInfo",
    "Timeline",
    "close_all",
    "events_to_pandas",
    "flatten",
    "now_ns",
    "step_name",
    "writer_of",
]
