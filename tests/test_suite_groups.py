"""The suite's own scheduling: ``--dist loadgroup`` keeps each ``xdist_group`` on one worker (the
4-rank sharded launches, the report run and JupyterLab count on it; see helpers/xdist_groups.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

GROUPED = """
import os
from pathlib import Path

import pytest

def _note(tmp: Path, name: str) -> None:
    (tmp / name).write_text(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.xdist_group("shared")
@pytest.mark.parametrize("case", ["a", "b@4->c@2", "d"])
def test_grouped(case: str) -> None:
    _note(Path(os.environ["SEEN"]), "grouped-" + case.replace("/", "_"))

@pytest.mark.parametrize("case", range(4))
def test_alone(case: int) -> None:
    _note(Path(os.environ["SEEN"]), f"alone-{case}")
"""


def test_a_groups_tests_all_run_on_one_worker_under_loadgroup(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    seen = tmp_path / "seen"
    seen.mkdir()
    plugins = ["-p", "no:cacheprovider", "-p", "xdist.plugin", "-p", "helpers.xdist_groups"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, "-n", "2", "--dist", "loadgroup", "test_grouped.py"],
        cwd=tmp_path,
        # no other plugin loads: two workers start in a second or two
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT / "tests"),
            "SEEN": str(seen),
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    workers = {path.name: path.read_text() for path in seen.iterdir()}
    grouped = {name: worker for name, worker in workers.items() if name.startswith("grouped-")}
    assert len(grouped) == 3 and len(set(grouped.values())) == 1, workers
    assert len(workers) == 7, workers
