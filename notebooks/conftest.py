"""nbval, in ``make test``'s run, runs every notebook here with its defaults, as Run All does.

Not these: tests/notebook/test_notebooks.py runs them under papermill with their defaults (it sets
only where results and checkpoints go) and checks what they computed, so nbval would run the same
cells on the same values a second time, about a quarter of the suite's time on two cores. That test
reads this list.
"""

import pytest

collect_ignore = [
    "02_sync_vs_async.ipynb",
    "03_storage_and_flashblade.ipynb",
    "07_interval_and_scale.ipynb",
    "09_many_ranks.ipynb",
    "10_fine_tuning.ipynb",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A notebook's cells share one kernel: ``--dist loadgroup`` keeps them on one worker, in order."""
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.xdist_group(item.path.name))
