"""The benchmark harness: workloads, checkpoint strategies side by side, floors and the storage probe.

Built on the engine; knows nothing of notebooks. ``compare`` runs strategies on a workload
and returns a :class:`Comparison` (tables, timeline, floors, the machine's load) that the
analysis and the notebook faces read.
"""

from ._aggregate import RESULT_COLUMNS, cycle_pairs
from ._compare import DEFAULT_REPEATS, DEFAULT_STRATEGIES, compare, environment
from ._comparison import SCHEMA, SHOWN_COLUMNS, TIMELINE_COLUMNS, Comparison, format_results
from ._load import Load
from ._measure import FLOOR_SAMPLE_BYTES, Floors, measure_floors, measure_write
from ._options import add_bench_arguments, run_bench_from_args
from ._probe import ProbeResult, mount_info, probe
from ._result import STALL_DEFINITION, STALL_NAMES, Cycle, ExperimentResult
from ._runner import run_experiment
from ._stats import (
    METHOD_REFERENCE,
    OVERHEAD_DEFINITION,
    OVERHEAD_METHOD,
    Clustered,
    clustered_mean,
    drag_text,
    interval_text,
    measurable,
    overhead_text,
    per_repeat_text,
    t_interval,
)
from ._strategies import STRATEGIES, get_strategy, register_strategy
from ._strategy import NbckptStrategy, Strategy, plain_state, tensor_bytes
from ._workloads import PRESETS, GPTConfig, Workload, gpt, make_workload, synthetic

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_STRATEGIES",
    "FLOOR_SAMPLE_BYTES",
    "METHOD_REFERENCE",
    "OVERHEAD_DEFINITION",
    "OVERHEAD_METHOD",
    "PRESETS",
    "RESULT_COLUMNS",
    "SCHEMA",
    "SHOWN_COLUMNS",
    "STALL_DEFINITION",
    "STALL_NAMES",
    "STRATEGIES",
    "TIMELINE_COLUMNS",
    "Clustered",
    "Comparison",
    "Cycle",
    "ExperimentResult",
    "Floors",
    "GPTConfig",
    "Load",
    "NbckptStrategy",
    "ProbeResult",
    "Strategy",
    "Workload",
    "add_bench_arguments",
    "clustered_mean",
    "compare",
    "cycle_pairs",
    "drag_text",
    "environment",
    "format_results",
    "get_strategy",
    "gpt",
    "interval_text",
    "make_workload",
    "measurable",
    "measure_floors",
    "measure_write",
    "mount_info",
    "overhead_text",
    "per_repeat_text",
    "plain_state",
    "probe",
    "register_strategy",
    "run_bench_from_args",
    "run_experiment",
    "synthetic",
    "t_interval",
    "tensor_bytes",
]
