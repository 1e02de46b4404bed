"""The benchmark harness: workloads, checkpoint strategies side by side, floors and the storage probe.

Built on the engine; knows nothing of notebooks. ``compare`` runs strategies on a workload
and returns a :class:`Comparison` (tables, timeline, floors, the machine's load) that the
analysis and the notebook faces read. Comes with the ``notebook`` extra (pandas); glue the
layers above share with it is in ``_internal``, not here.
"""

from .._errors import require_extra

require_extra("nbckpt.bench")

from ._compare import compare, environment
from ._comparison import SHOWN_COLUMNS, Comparison, format_results
from ._load import Load
from ._measure import FLOOR_SAMPLE_BYTES, Floors, measure_write
from ._probe import ProbeResult, mount_info, probe
from ._result import STALL_DEFINITION
from ._stats import OVERHEAD_DEFINITION, OVERHEAD_METHOD
from ._strategies import register_strategy
from ._strategy import Strategy
from ._sweep import sweep
from ._workloads import GPTConfig, Workload, make_workload, synthetic

__all__ = [
    "FLOOR_SAMPLE_BYTES",
    "OVERHEAD_DEFINITION",
    "OVERHEAD_METHOD",
    "SHOWN_COLUMNS",
    "STALL_DEFINITION",
    "Comparison",
    "Floors",
    "GPTConfig",
    "Load",
    "ProbeResult",
    "Strategy",
    "Workload",
    "compare",
    "environment",
    "format_results",
    "make_workload",
    "measure_write",
    "mount_info",
    "probe",
    "register_strategy",
    "sweep",
    "synthetic",
]
