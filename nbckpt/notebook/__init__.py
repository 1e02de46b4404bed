"""The notebook faces: the ``%ckpt_*`` magics, autosave, the lab, the checkpoint browser, the
plotly figures and the report run; the ``notebook`` extra (without it, importing this raises one
line naming the extra). Glue the CLI shares with it is in ``_internal``.
"""

from .._errors import require_extra

require_extra("nbckpt.notebook")

from ._autosave import Autosave
from ._browser import Browser
from ._lab import Lab
from ._rank_figures import rank_stall_figure, scaling_figure, swimlane_figure
from ._report import report_progress
from ._result_figures import interval_figure, overhead_figure, probe_figure, stall_figure
from ._timeline_figures import throughput_figure, timeline_figure

__all__ = [
    "Autosave",
    "Browser",
    "Lab",
    "interval_figure",
    "overhead_figure",
    "probe_figure",
    "rank_stall_figure",
    "report_progress",
    "scaling_figure",
    "stall_figure",
    "swimlane_figure",
    "throughput_figure",
    "timeline_figure",
]
