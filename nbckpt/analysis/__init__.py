"""What the measurements mean: the checkpoint-interval advisor, the scale-out projection, the
published figures (with their sources), the report's computed conclusions, and what changed
between two checkpoints, tensor by tensor.

Reads the bench's results; knows nothing of notebooks.
"""

from ._conclusions import conclusions
from ._costs import Cost, measured_costs
from ._defaults import DEFAULTS, AdvisorDefaults
from ._diff import DIFF_COLUMNS, DIFF_STATUSES, diff_states
from ._interval import (
    advise,
    cluster_mtbf_s,
    compare_modes,
    expected_waste,
    node_mtbf_hours,
    waste_curve,
    young_daly_interval,
)
from ._projection import SHARDING, checkpoint_gb, mlperf_checkpoint_sizes, project_scale
from ._reference import cite, load_published, published_table, published_value

__all__ = [
    "DEFAULTS",
    "DIFF_COLUMNS",
    "DIFF_STATUSES",
    "SHARDING",
    "AdvisorDefaults",
    "Cost",
    "advise",
    "checkpoint_gb",
    "cite",
    "cluster_mtbf_s",
    "compare_modes",
    "conclusions",
    "diff_states",
    "expected_waste",
    "load_published",
    "measured_costs",
    "mlperf_checkpoint_sizes",
    "node_mtbf_hours",
    "project_scale",
    "published_table",
    "published_value",
    "waste_curve",
    "young_daly_interval",
]
