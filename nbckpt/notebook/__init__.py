"""The notebook faces: the ``%ckpt_*`` magics, autosave, the lab widget, the checkpoint browser,
the plotly figures and the report run.

Thin faces over the engine, the bench and the analysis; IPython and ipywidgets are imported
only by the parts that need them.
"""

from ._autosave import Autosave
from ._browser import Browser
from ._lab import Lab, live_lab
from ._plotting import strategy_colour
from ._report import RESULTS_FILE, export_html, parse_value, report_progress, run_report
from ._result_figures import (
    interval_figure,
    overhead_figure,
    probe_figure,
    projection_figure,
    scaling_figure,
    stall_figure,
)
from ._timeline_figures import (
    TIMELINE_KINDS,
    events_frame,
    extend_timeline,
    select_repeat,
    throughput_figure,
    timeline_figure,
)

__all__ = [
    "RESULTS_FILE",
    "TIMELINE_KINDS",
    "Autosave",
    "Browser",
    "Lab",
    "events_frame",
    "export_html",
    "extend_timeline",
    "interval_figure",
    "live_lab",
    "overhead_figure",
    "parse_value",
    "probe_figure",
    "projection_figure",
    "report_progress",
    "run_report",
    "scaling_figure",
    "select_repeat",
    "stall_figure",
    "strategy_colour",
    "throughput_figure",
    "timeline_figure",
]
