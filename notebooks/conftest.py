"""nbval, ``make test``'s second pass, runs every notebook here with its defaults, as Run All does.

Not these: tests/notebook/test_notebooks.py runs them under papermill with their defaults (it sets
only where results and checkpoints go) and checks what they computed, so nbval would run the same
cells on the same values a second time, about a quarter of the suite's time on two cores. That test
keeps this list and its own the same.
"""

collect_ignore = [
    "02_sync_vs_async.ipynb",
    "03_storage_and_flashblade.ipynb",
    "07_interval_and_scale.ipynb",
    "09_many_ranks.ipynb",
    "10_fine_tuning.ipynb",
]
