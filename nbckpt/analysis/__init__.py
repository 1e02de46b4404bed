"""What the measurements mean: the checkpoint-interval advisor, the measured scaling of a bench
on many ranks (the job's figures, the straggler, the curve over rank counts), the published
figures with their sources, the report's conclusions, and checkpoint diffs.

Reads the bench's results, knows nothing of notebooks; comes with the ``notebook`` extra. Glue
the layers above share with it is in ``_internal``.
"""

from .._errors import require_extra

require_extra("nbckpt.analysis")

from ._conclusions import conclusions
from ._defaults import DEFAULTS
from ._interval import advise, compare_modes, expected_waste, job_mtbf_s, young_daly_interval
from ._job_report import (
    job_conclusions,
    job_table,
    rank_rows,
    read_jobs,
    read_runs,
    scaling_conclusions,
    scaling_table,
    swimlanes,
)
from ._reference import cite, published_table
from ._sizes import checkpoint_gb

__all__ = [
    "DEFAULTS",
    "advise",
    "checkpoint_gb",
    "cite",
    "compare_modes",
    "conclusions",
    "expected_waste",
    "job_conclusions",
    "job_mtbf_s",
    "job_table",
    "published_table",
    "rank_rows",
    "read_jobs",
    "read_runs",
    "scaling_conclusions",
    "scaling_table",
    "swimlanes",
    "young_daly_interval",
]
