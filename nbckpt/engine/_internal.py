"""The engine's glue for the layers above it: names the bench, the analysis, the notebook
faces and the integrations share with the engine, that no user calls.

Not public API (``nbckpt.engine`` exports what users call, and docs/api.md lists it); the one
private module of the engine another layer may import (``tests/test_layout.py`` checks both).
"""

from ._checkpointer import writer_of
from ._files import cached_fraction, drop_cached, fsync_dir, write_all, write_atomic
from ._format import MANIFEST, POINTER_FORMAT, POINTER_LIMIT, parse_step, step_name
from ._object_store import endpoint, explain_fsspec_error, fsspec_options, open_fsspec
from ._plain_dcp import plain_dcp_steps
from ._schedule import Costs, Interval, Pacer, expected_waste, job_mtbf_s, young_daly_interval
from ._shutdown import check_signals
from ._state import flatten
from ._timeline import events_to_pandas, now_ns
from ._torch_compat import version_of
from ._workers import Pool, deferred_interrupt

__all__ = [
    "MANIFEST",
    "POINTER_FORMAT",
    "POINTER_LIMIT",
    "Costs",
    "Interval",
    "Pacer",
    "Pool",
    "cached_fraction",
    "check_signals",
    "deferred_interrupt",
    "drop_cached",
    "endpoint",
    "events_to_pandas",
    "expected_waste",
    "explain_fsspec_error",
    "flatten",
    "fsspec_options",
    "fsync_dir",
    "job_mtbf_s",
    "now_ns",
    "open_fsspec",
    "parse_step",
    "plain_dcp_steps",
    "step_name",
    "version_of",
    "write_all",
    "write_atomic",
    "writer_of",
    "young_daly_interval",
]
