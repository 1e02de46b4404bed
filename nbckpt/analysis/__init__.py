"""What the measurements mean: the checkpoint-interval advisor, the scale-out projection, the
published figures with their sources, the report's conclusions, and checkpoint diffs.

Reads the bench's results, knows nothing of notebooks; comes with the ``notebook`` extra. Glue
the layers above share with it is in ``_internal``.
"""

from .._errors import require_extra

require_extra("nbckpt.analysis")

from ._conclusions import conclusions
from ._defaults import DEFAULTS
from ._interval import advise, compare_modes, expected_waste, job_mtbf_s, young_daly_interval
from ._projection import checkpoint_gb, project_scale
from ._reference import cite, published_table

__all__ = [
    "DEFAULTS",
    "advise",
    "checkpoint_gb",
    "cite",
    "compare_modes",
    "conclusions",
    "expected_waste",
    "job_mtbf_s",
    "project_scale",
    "published_table",
    "young_daly_interval",
]
