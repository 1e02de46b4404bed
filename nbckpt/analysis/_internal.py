"""The analysis layer's glue for the layers above it (the notebook faces, the CLI): not public API.

The one private module of the analysis another layer may import (``tests/test_layout.py``).
"""

from ._diff import diff_states
from ._interval import waste_curve
from ._job_report import (
    checkpoint_rates,
    job_conclusions,
    job_table,
    rank_rows,
    rate_over_time,
    read_jobs,
    scaling_conclusions,
    scaling_table,
    swimlanes,
)
from ._reference import load_published

__all__ = [
    "checkpoint_rates",
    "diff_states",
    "job_conclusions",
    "job_table",
    "load_published",
    "rank_rows",
    "rate_over_time",
    "read_jobs",
    "scaling_conclusions",
    "scaling_table",
    "swimlanes",
    "waste_curve",
]
