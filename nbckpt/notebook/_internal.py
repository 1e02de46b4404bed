"""The notebook layer's glue for the CLI (``nbckpt report``): not public API.

The one private module of the notebook faces another layer may import (``tests/test_layout.py``).
"""

from ._plan import notebook_defaults, plan_report
from ._report import REPORT_NOTEBOOK, RESULTS_FILE, run_report
from ._report_from import report_from

__all__ = ["REPORT_NOTEBOOK", "RESULTS_FILE", "notebook_defaults", "plan_report", "report_from", "run_report"]
