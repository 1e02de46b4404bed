"""The checkpoint engine: stage into reused host images, persist in the background, commit atomically.

The bottom layer of nbckpt: it imports no bench, analysis or notebook code.
"""

from ._checkpointer import Checkpointer, close_all
from ._config import CheckpointConfig
from ._handles import SaveHandle, SaveRecord

__all__ = ["CheckpointConfig", "Checkpointer", "SaveHandle", "SaveRecord", "close_all"]
