"""The analysis layer's glue for the layers above it (the notebook faces, the CLI): not public API.

The one private module of the analysis another layer may import (``tests/test_layout.py``).
"""

from ._diff import diff_states
from ._interval import waste_curve
from ._job_report import checkpoint_rates, host_loads, job_table_shown, rank_floors, rate_over_time
from ._reference import load_published

__all__ = [
    "checkpoint_rates",
    "diff_states",
    "host_loads",
    "job_table_shown",
    "load_published",
    "rank_floors",
    "rate_over_time",
    "waste_curve",
]
