"""The checkpoint engine: stage into reused host images, persist in the background, commit atomically.

The bottom layer of nbckpt and the whole of the core install (``pip install nbckpt``): it
imports nothing from the bench, analysis or notebook layers. ``Checkpointer`` is its face;
the timeline is the record of every phase it runs. Glue the layers above share with it is in
``_internal``, not here.
"""

from ._checkpointer import Checkpointer, close_all
from ._config import CheckpointConfig
from ._handles import SaveHandle, SaveRecord
from ._timeline import Event, Timeline

__all__ = ["CheckpointConfig", "Checkpointer", "Event", "SaveHandle", "SaveRecord", "Timeline", "close_all"]
