"""The notebook layer's glue for the CLI (``nbckpt report``): not public API.

The one private module of the notebook faces another layer may import (``tests/test_layout.py``).
"""

from ._report import RESULTS_FILE, run_report

__all__ = ["RESULTS_FILE", "run_report"]
