"""``pip install nbckpt`` alone (the core) checkpoints a model, and every face beyond it says
which extra it needs.

A fresh ``python -m venv`` (no system site packages, so nothing of the test's own venv leaks
in), torch installed into it the way the Makefile installs it (``torch==2.13.0``, through pip's
configuration of the machine), then nbckpt with ``--no-deps`` plus exactly the core's
dependencies as pyproject.toml declares them: if the engine imported anything else, the save
below would fail here. Built once per run, with what keeps it cheap (about 20 s on 2 cores): no
pip inside the venv (the test's own pip installs into it with ``--python``), no bytecode
compiled, no build isolation (torch already brought setuptools), built from a copy of the
sources.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from helpers import ROOT
from packaging.requirements import Requirement

pytestmark = pytest.mark.install

TORCH = "torch==2.13.0"  # the Makefile's TORCH_SPEC: the CPU wheel these machines carry


def core_requirements() -> list[str]:
    """The core's dependencies from pyproject.toml, torch left out (it is installed first)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return [text for text in declared if Requirement(text).name != "torch"]


def pip(venv_python: Path, *args: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv_python),
            *args,
            "--quiet",
            "--disable-pip-version-check",
        ],
        check=True,
        timeout=900,
    )


def isolated_env() -> dict[str, str]:
    """The environment without what would put the work tree or the test venv on the path."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def core_venv() -> Iterator[Path]:
    # Not under pytest's basetemp: another pytest run of the same user prunes old basetemps,
    # and this venv must live as long as this module's tests.
    with tempfile.TemporaryDirectory(prefix="nbckpt-core-venv-") as folder:
        venv = Path(folder) / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        python = venv / "bin" / "python"
        pip(python, "install", "--no-compile", TORCH)
        # Built from a copy: a build in the work tree would leave build/ there, and setuptools
        # would ship whatever stale module an earlier build left in it.
        source = Path(folder) / "source"
        for name in ("pyproject.toml", "README.md"):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
        shutil.copytree(ROOT / "nbckpt", source / "nbckpt", ignore=shutil.ignore_patterns("__pycache__"))
        pip(
            python,
            "install",
            "--no-compile",
            "--no-deps",
            "--no-build-isolation",
            str(source),
            *core_requirements(),
        )
        yield python


# Run in the core venv, from a directory outside the work tree; prints one JSON object. One
# process for everything: each start of a fresh venv's Python imports torch anew.
SCRIPT = r"""
import contextlib, importlib, io, json, sys, tempfile
from pathlib import Path
import torch
import nbckpt
from nbckpt import Checkpointer
from nbckpt.cli import main

found = {"nbckpt": nbckpt.__file__, "prefix": sys.prefix, "restored": {}, "errors": {}, "cli": {}}
for mode in ("sync", "async"):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).square().mean().backward()
    optim.step()
    directory = tempfile.mkdtemp()
    with Checkpointer(directory, mode=mode, keep=2) as ckpt:
        ckpt.save({"model": model, "optim": optim}, step=3)
        ckpt.wait()
    fresh = torch.nn.Linear(16, 8)
    fresh_optim = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(4, 16)).sum().backward()
    fresh_optim.step()  # the optimizer's state exists, to be overwritten by the restore
    with Checkpointer(directory) as ckpt:
        step = ckpt.restore({"model": fresh, "optim": fresh_optim})
    weights = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    moments = torch.equal(optim.state_dict()["state"][0]["exp_avg"],
                          fresh_optim.state_dict()["state"][0]["exp_avg"])
    found["restored"][mode] = [step, weights, moments]

def error_of(call):
    try:
        call()
    except ImportError as exc:
        return [type(exc).__name__, str(exc)]
    return None

for face in ("nbckpt.notebook", "nbckpt.bench", "nbckpt.analysis"):
    found["errors"][face] = error_of(lambda: importlib.import_module(face))
found["errors"]["%load_ext nbckpt"] = error_of(lambda: nbckpt.load_ipython_extension(None))
found["errors"]["s3"] = error_of(lambda: Checkpointer("s3://bucket/run"))
found["errors"]["to_pandas"] = error_of(lambda: nbckpt.Timeline().to_pandas())

from nbckpt.integrations import load  # export's reader: the core too
found["loaded"] = sorted(load(max(p for p in Path(directory).iterdir() if p.name.startswith("step-"))))

for argv in (["ls", directory], ["verify", directory], ["bench", "--steps", "4"]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as exc:  # argparse's way, for a command the install cannot run
            status = exc.code
    found["cli"][argv[0]] = [status, out.getvalue(), err.getvalue()]
print(json.dumps(found))
"""

NOTEBOOK = "needs the 'notebook' extra: pip install 'nbckpt[notebook]'"


def test_the_core_alone_saves_restores_and_names_the_missing_extras(core_venv: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(core_venv), "-c", SCRIPT],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=isolated_env(),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(found["nbckpt"]).is_relative_to(found["prefix"]), "nbckpt was not imported from the venv"
    assert found["restored"] == {"sync": [3, True, True], "async": [3, True, True]}
    assert found["errors"] == {
        "nbckpt.notebook": ["ImportError", f"nbckpt.notebook {NOTEBOOK}"],
        "nbckpt.bench": ["ImportError", f"nbckpt.bench {NOTEBOOK}"],
        "nbckpt.analysis": ["ImportError", f"nbckpt.analysis {NOTEBOOK}"],
        "%load_ext nbckpt": ["ImportError", f"nbckpt.notebook {NOTEBOOK}"],
        "s3": ["ImportError", "an s3:// directory needs the 's3' extra: pip install 'nbckpt[s3]'"],
        "to_pandas": ["ImportError", f"Timeline.to_pandas {NOTEBOOK}"],
    }
    assert found["loaded"] == ["model", "optim"]
    # The core's commands run; one that needs the bench says which extra, in one line.
    ls_status, ls_out, _ = found["cli"]["ls"]
    assert ls_status == 0 and "3" in ls_out
    assert found["cli"]["verify"][0] == 0, found["cli"]["verify"]
    assert found["cli"]["bench"] == [2, "", f"nbckpt bench: error: nbckpt.bench {NOTEBOOK}\n"]


def test_pip_check_passes_in_the_core_venv(core_venv: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(core_venv), "check", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    installed = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(core_venv),
            "list",
            "--format",
            "json",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    names = {package["name"].lower() for package in json.loads(installed.stdout)}
    assert {"nbckpt", "torch", "numpy", "xxhash", "psutil"} <= names
    assert not names & {"pandas", "plotly", "ipython", "ipywidgets", "anywidget", "papermill", "s3fs"}
