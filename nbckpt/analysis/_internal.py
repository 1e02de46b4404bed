"""The analysis layer's glue for the layers above it (the notebook faces, the CLI): not public API.

The one private module of the analysis another layer may import (``tests/test_layout.py``).
"""

from ._diff import diff_states
from ._interval import waste_curve
from ._reference import load_published

__all__ = ["diff_states", "load_published", "waste_curve"]
