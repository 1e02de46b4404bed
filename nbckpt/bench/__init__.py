"""The benchmark harness: workloads, checkpoint strategies side by side, floors and the storage probe.

Built on the engine; knows nothing of notebooks. ``compare`` runs strategies on a workload
and returns a :class:`Comparison` (tables, timeline, floors, the machine's load) that the
analysis and the notebook faces read.
"""

from ._experiment import (
    DEFAULT_REPEATS,
    DEFAULT_STRATEGIES,
    FLOOR_SAMPLE_BYTES,
    OVERHEAD_DEFINITION,
    RESULT_COLUMNS,
    SCHEMA,
    TIMELINE_COLUMNS,
    Comparison,
    ExperimentResult,
    Floors,
    Load,
    compare,
    environment,
    format_results,
    interval_text,
    measurable,
    measure_floors,
    overhead_text,
    run_experiment,
    t_interval,
)
from ._options import add_bench_arguments, run_bench_from_args
from ._probe import DEFAULT_REPEATS as PROBE_REPEATS
from ._probe import DEFAULT_SIZE_MB as PROBE_SIZE_MB
from ._probe import DEFAULT_STREAMS as PROBE_STREAMS
from ._probe import MountInfo, ProbeResult, StreamRun, measure_write, mount_info, probe, storage_advice
from ._strategies import (
    STRATEGIES,
    NbckptStrategy,
    Strategy,
    get_strategy,
    plain_state,
    register_strategy,
    tensor_bytes,
)
from ._workloads import PRESETS, GPTConfig, Workload, gpt, make_workload, synthetic

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_STRATEGIES",
    "FLOOR_SAMPLE_BYTES",
    "OVERHEAD_DEFINITION",
    "PRESETS",
    "PROBE_REPEATS",
    "PROBE_SIZE_MB",
    "PROBE_STREAMS",
    "RESULT_COLUMNS",
    "SCHEMA",
    "STRATEGIES",
    "TIMELINE_COLUMNS",
    "Comparison",
    "ExperimentResult",
    "Floors",
    "GPTConfig",
    "Load",
    "MountInfo",
    "NbckptStrategy",
    "ProbeResult",
    "Strategy",
    "StreamRun",
    "Workload",
    "add_bench_arguments",
    "compare",
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
    "plain_state",
    "probe",
    "register_strategy",
    "run_bench_from_args",
    "run_experiment",
    "storage_advice",
    "synthetic",
    "t_interval",
    "tensor_bytes",
]
