"""environment.yml (for conda users) parses and installs what pyproject.toml declares."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the venv runs 3.11+
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _environment() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert isinstance(data, dict), "environment.yml is not a mapping"
    return data


def _pip_section(env: dict[str, Any]) -> list[str]:
    sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(sections) == 1, "environment.yml needs exactly one pip: section"
    return [str(item) for item in sections[0]]


def _declared() -> dict[str, Requirement]:
    """The core and the extras the environment installs (the lab extra brings the notebook one)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["notebook"] + extras["s3"] + extras["lab"]
    requirements = [Requirement(text) for text in wanted]
    return {canonicalize_name(r.name): r for r in requirements if canonicalize_name(r.name) != "nbckpt"}


def test_environment_parses_with_python_and_pip() -> None:
    env = _environment()
    assert env["name"] == "nbckpt"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    names = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0] for d in conda}
    assert {"python", "pip"} <= names
    python = next(d for d in conda if d.startswith("python"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert python.removeprefix("python") == project["requires-python"]


def test_pip_section_installs_the_project() -> None:
    pip = _pip_section(_environment())
    assert "-e .[lab,s3]" in pip, "the pip section must install the project itself (-e .[lab,s3])"


def test_pip_packages_agree_with_pyproject() -> None:
    listed = {
        canonicalize_name(Requirement(item).name): Requirement(item)
        for item in _pip_section(_environment())
        if not item.startswith("-")
    }
    declared = _declared()
    missing = sorted(set(declared) - set(listed))
    extra = sorted(set(listed) - set(declared))
    assert not missing, f"in pyproject.toml but not environment.yml: {missing}"
    assert not extra, f"in environment.yml but not pyproject.toml: {extra}"
    differ = [name for name in declared if str(declared[name].specifier) != str(listed[name].specifier)]
    assert not differ, f"version ranges differ between pyproject.toml and environment.yml: {differ}"
