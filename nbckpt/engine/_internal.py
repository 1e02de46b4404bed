"""The engine's glue for the layers above it: names the bench, the analysis, the notebook
faces and the integrations share with the engine, that no user calls.

Not public API (``nbckpt.engine`` exports what users call, and docs/api.md lists it); the one
private module of the engine another layer may import (``tests/test_layout.py`` checks both).
"""

from ._checkpointer import writer_of
from ._format import POINTER_FORMAT, POINTER_LIMIT, step_name
from ._state import flatten
from ._timeline import events_to_pandas, now_ns

__all__ = [
    "POINTER_FORMAT", "POINTER_LIMIT", "events_to_pandas", "flatten", "now_ns", "step_name", "writer_of"
]
