"""The bench's glue for the layers above it (analysis, notebook faces, CLI) and the project's
benchmarks and tests: command-line options, result texts, strategy lookup. Not public API.

The one private module of the bench another layer may import (``tests/test_layout.py``).
"""

from ._auto_interval import DEFAULT_STEPS, choose_interval
from ._compare import (
    DEFAULT_REPEATS,
    DEFAULT_STRATEGIES,
    ComparisonInterrupted,
    add_bench_arguments,
    run_bench_from_args,
    run_bench_on_ranks,
    strategy_names,
)
from ._launch import EventWriter, RankLaunch, run_local_ranks
from ._load import machine_load
from ._rank_workload import RankWorkload, state_digests
from ._ranks import arm_slow, in_torchrun
from ._result import RESULT_COLUMNS, STALL_NAMES
from ._stats import drag_text, interval_text, measurable, overhead_text, per_repeat_text, t_interval
from ._strategies import STRATEGIES, get_strategy
from ._strategy import plain_state, tensor_bytes
from ._sweep import SCALING_SCHEMA, check_json_path, passthrough, run_sweep, scaling_table, write_document
from ._workloads import PRESETS

__all__ = [
    "DEFAULT_REPEATS",
    "DEFAULT_STEPS",
    "DEFAULT_STRATEGIES",
    "PRESETS",
    "RESULT_COLUMNS",
    "SCALING_SCHEMA",
    "STALL_NAMES",
    "STRATEGIES",
    "ComparisonInterrupted",
    "EventWriter",
    "RankLaunch",
    "RankWorkload",
    "add_bench_arguments",
    "arm_slow",
    "check_json_path",
    "choose_interval",
    "drag_text",
    "get_strategy",
    "in_torchrun",
    "interval_text",
    "machine_load",
    "measurable",
    "overhead_text",
    "passthrough",
    "per_repeat_text",
    "plain_state",
    "run_bench_from_args",
    "run_bench_on_ranks",
    "run_local_ranks",
    "run_sweep",
    "scaling_table",
    "state_digests",
    "strategy_names",
    "t_interval",
    "tensor_bytes",
    "write_document",
]
