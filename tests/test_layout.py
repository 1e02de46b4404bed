"""The package's layers import downwards only, and nobody reaches into another layer's private modules.

    engine  <-  bench  <-  analysis  <-  notebook, integrations  <-  cli
    (and every layer may use nbckpt._errors and nbckpt._util, the bottom)

Read from the source with ``ast`` (imports inside functions count too), so the test holds
for code paths no other test runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "nbckpt"
LEVELS = {"_version": 0, "_errors": 0, "_util": 1, "engine": 2, "bench": 3, "analysis": 4,
          "notebook": 5, "integrations": 5, "cli": 6, "__main__": 7, "__init__": 7}
#: Layers at the same level that may use each other (the bottom's two modules).
BESIDE = {("_util", "_errors"), ("_util", "_version")}
#: What each test folder tests: it may import that layer's private modules, no other's.
TEST_LAYERS = {"engine": "engine", "reliability": "engine", "helpers": "engine", "bench": "bench",
               "analysis": "analysis", "notebook": "notebook", "integrations": "integrations"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every ``nbckpt`` import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("nbckpt")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("nbckpt"):
                # ``from nbckpt import bench`` and ``from nbckpt.engine import _faults`` import modules
                for alias in node.names:
                    inner = ROOT.joinpath(*target.split("."), alias.name)
                    is_module = inner.is_dir() or inner.with_suffix(".py").is_file()
                    found.append((node.lineno, f"{target}.{alias.name}" if is_module else target))
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def private_of(module: str) -> str | None:
    """The layer whose private module ``module`` is (None for a public one)."""
    parts = module.split(".")
    if len(parts) > 2 and any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
        return parts[1]
    return None


SOURCES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_imports_go_downwards_and_through_public_names(path: Path) -> None:
    here = module_name(path)
    own = layer(here)
    wrong = []
    for line, target in imports(path):
        theirs = layer(target)
        beside = LEVELS[theirs] == LEVELS[own] and theirs != own and (own, theirs) not in BESIDE
        if LEVELS[theirs] > LEVELS[own] or beside:
            wrong.append(f"line {line}: {here} ({own}) imports {target} ({theirs}), a layer above or beside")
        elif private_of(target) not in (None, own) and own not in ("__init__", "__main__"):
            wrong.append(f"line {line}: {here} imports {target}, private to the {theirs} layer")
    assert not wrong, "\n".join(wrong)


TESTS = sorted(p for p in (ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", TESTS, ids=lambda p: str(p.relative_to(ROOT / "tests")))
def test_tests_use_only_their_own_layers_private_modules(path: Path) -> None:
    folder = path.relative_to(ROOT / "tests").parts[0]
    allowed = TEST_LAYERS.get(folder)
    wrong = [f"line {line}: {target}" for line, target in imports(path)
             if private_of(target) not in (None, allowed)]
    assert not wrong, f"{path.name} reaches into another layer's private modules:\n" + "\n".join(wrong)


def test_every_module_declares_all() -> None:
    missing = [str(p.relative_to(PACKAGE)) for p in SOURCES
               if p.name != "__main__.py" and "__all__" not in p.read_text()]
    assert not missing, missing


#: A module may run to about this many lines; a longer one says why at its top.
MODULE_LINES = 420


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: module_name(p))
def test_a_long_module_says_why(path: Path) -> None:
    lines = path.read_text().count("\n")
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert lines <= MODULE_LINES or "Longer than" in docstring, (
        f"{module_name(path)} has {lines} lines: split it, or say at its top why it is "
        f"'Longer than {MODULE_LINES - 20} lines'"
    )
