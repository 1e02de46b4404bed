"""The notebook layer's glue for the CLI (``nbckpt report``): not public API.

The one private module of the notebook faces another layer may import (``tests/test_layout.py``).
"""

from ._report import RESULTS_FILE, run_report
from ._report_from import report_from

__all__ = ["RESULTS_FILE", "report_from", "run_report"]
