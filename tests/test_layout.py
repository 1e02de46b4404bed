"""The package's layers import downwards only, and nobody reaches into another layer's private modules.

    engine  <-  bench  <-  analysis  <-  notebook, integrations  <-  cli
    (and every layer may use nbckpt._errors and nbckpt._util, the bottom)

Glue a layer shares with the layers above it lives in its one ``_internal`` module, the only
private module another layer may import; a subpackage's ``__init__`` exports what users call,
and each of those names is documented (README, docs, a notebook or an example).

Read from the source with ``ast`` (imports inside functions count too), so the test holds
for code paths no other test runs.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import threading
import types
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "nbckpt"
LEVELS = {
    "_version": 0,
    "_errors": 0,
    "_util": 1,
    "engine": 2,
    "bench": 3,
    "analysis": 4,
    "notebook": 5,
    "integrations": 5,
    "cli": 6,
    "__main__": 7,
    "__init__": 7,
}
#: Layers at the same level that may use each other (the bottom's two modules).
BESIDE = {("_util", "_errors"), ("_util", "_version")}
#: What each test folder tests: it may import that layer's private modules, no other's.
TEST_LAYERS = {
    "engine": "engine",
    "reliability": "engine",
    "helpers": "engine",
    "bench": "bench",
    "analysis": "analysis",
    "notebook": "notebook",
    "integrations": "integrations",
}


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
                # ``from nbckpt import bench`` and ``from nbckpt.engine import _store`` import modules
                for alias in node.names:
                    inner = ROOT.joinpath(*target.split("."), alias.name)
                    is_module = inner.is_dir() or inner.with_suffix(".py").is_file()
                    found.append((node.lineno, f"{target}.{alias.name}" if is_module else target))
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


#: The one private module of a layer that the layers above it may import: its shared glue.
INTERNAL = "_internal"


def private_of(module: str) -> str | None:
    """The layer whose private module ``module`` is (None for a public one or a layer's glue)."""
    parts = module.split(".")
    if parts[2:] == [INTERNAL]:
        return None
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
    wrong = [
        f"line {line}: {target}"
        for line, target in imports(path)
        if private_of(target) not in (None, allowed)
    ]
    assert not wrong, f"{path.name} reaches into another layer's private modules:\n" + "\n".join(wrong)


def test_every_module_declares_all() -> None:
    missing = [
        str(p.relative_to(PACKAGE))
        for p in SOURCES
        if p.name != "__main__.py" and "__all__" not in p.read_text()
    ]
    assert not missing, missing


# Issue 30 withdrew issue 23's line budget: it measured packing as much as design. A module's
# length is a guideline; the structural checks below (and ruff's McCabe 12 and format check,
# pyproject.toml) judge the design.

ENGINE_DIR = PACKAGE / "engine"
#: The engine's ladder, bottom first: a module imports only from its own rung or one below (never
#: a cycle, test below), so each rung can be read knowing only the rungs beneath it. A new
#: engine module takes its place here.
LADDER = {
    "basics": [
        "_workers",
        "_faults",
        "_torch_compat",
        "_ranks",
        "_shards",
        "_unpickle",
        "_state",
        "_template",
    ],
    "format": ["_format", "_files", "_manifest"],  # the bytes of a step and how they move
    "storage": ["_store", "_object_store", "_open_store", "_shared", "_set_aside", "_plain_dcp"],
    "save and restore": [
        "_staging",
        "_incremental",
        "_timeline",
        "_context",
        "_schedule",
        "_dcp_values",
        "_dcp_check",
        "_saver",
        "_retainer",
        "_reader",
        "_restorer",
        "_retention",
        "_config",
    ],
    "run": ["_mirror", "_shutdown", "_run"],
    "Checkpointer": ["_checkpointer", "__init__", "_internal"],
}


def engine_graph() -> dict[str, set[str]]:
    """Which engine modules each engine module imports (inside functions and under
    ``TYPE_CHECKING`` too: a reader follows those as much as any other)."""
    graph = {}
    for path in sorted(ENGINE_DIR.glob("*.py")):
        targets = {target.removeprefix("nbckpt.engine.") for _, target in imports(path)}
        graph[path.stem] = {t for t in targets if t != path.stem and (ENGINE_DIR / f"{t}.py").is_file()}
    return graph


def cycle_in(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), or []."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str]:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        for target in sorted(graph[node]):
            found = visit(target, [*path, node])
            if found:
                return found
        done.add(node)
        return []

    return next((found for node in sorted(graph) if (found := visit(node, []))), [])


def test_cycle_in_finds_a_cycle_and_none_in_a_ladder() -> None:
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle_in({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_engine_imports_form_a_ladder_without_a_cycle() -> None:
    """format -> storage -> save and restore -> run -> Checkpointer: imports go down the ladder
    (or within a rung), and no engine module imports itself through others (``_store`` and
    ``_object_store`` once imported each other: ``_open_store`` now chooses between them)."""
    graph = engine_graph()
    rung = {module: i for i, modules in enumerate(LADDER.values()) for module in modules}
    unplaced = sorted(set(graph) - set(rung))
    assert not unplaced, f"engine modules with no place in LADDER (add them to their rung): {unplaced}"
    names = list(LADDER)
    upward = [
        f"{module} ({names[rung[module]]}) imports {target} ({names[rung[target]]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if rung[target] > rung[module]
    ]
    assert not upward, "engine imports going up the ladder:\n" + "\n".join(upward)
    cycle = cycle_in(graph)
    assert not cycle, f"engine import cycle: {' -> '.join(cycle)}"


#: Each optional feature: its module, and the words its code uses (an identifier holding one is
#: knowledge of the feature). A feature's own module and at most two others (the one that wires
#: it and the config option) may know it.
FEATURES = {
    "mirror": ("_mirror", r"mirror"),
    "plain-DCP steps": ("_plain_dcp", r"plain_?dcp|foreign"),
    "set-aside runs": ("_set_aside", r"set_?aside|branch"),
}


def knowers(feature: str) -> set[str]:
    """The engine modules (but the feature's own) that import its module or name it in code."""
    module, words = FEATURES[feature]
    found = set()
    for path in sorted(ENGINE_DIR.glob("*.py")):
        if path.stem == module:
            continue
        identifiers = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                identifiers.add(node.id)
            elif isinstance(node, ast.Attribute):
                identifiers.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                identifiers.add(node.name)
            elif isinstance(node, ast.arg) or (isinstance(node, ast.keyword) and node.arg):
                identifiers.add(node.arg)
            elif isinstance(node, ast.alias):
                identifiers.add(node.asname or node.name)
        imported = f"nbckpt.engine.{module}" in {target for _, target in imports(path)}
        if imported or any(re.search(words, name, re.IGNORECASE) for name in identifiers):
            found.add(path.stem)
    return found


@pytest.mark.parametrize("feature", FEATURES)
def test_each_optional_feature_is_known_to_at_most_two_engine_modules(feature: str) -> None:
    known = knowers(feature)
    assert len(known) <= 2, (
        f"the {feature} feature is known to {sorted(known)}: at most two engine modules may"
    )


#: The compat modules: the only places nbckpt reads another library's private names, one
#: library each, each with a test that fails naming the library's version when a release
#: changes one (the module's ``missing()``; transformers': its rule run beside the Trainer's).
COMPAT = {
    "engine/_torch_compat.py": "torch",
    "bench/_dcp_compat.py": "torch's DCP checkpoint process",
    "notebook/_plotly_compat.py": "plotly",
    "integrations/_accelerate_compat.py": "accelerate",
    "integrations/_hf_compat.py": "transformers (a private method's rule, replicated)",
}


@pytest.mark.parametrize("compat", COMPAT, ids=str)
def test_each_compat_module_is_watched_by_a_test(compat: str) -> None:
    """A compat module is only as good as the test that fails when its library changes: some
    test imports it (and calls its ``missing()`` where it has one)."""
    module = module_name(PACKAGE / compat)
    watchers = [p for p in TESTS if any(t == module for _, t in imports(p))]
    assert watchers, f"no test imports {module}: add one that fails when {COMPAT[compat]} changes"
    if "def missing(" in (PACKAGE / compat).read_text():
        assert any(re.search(r"\bmissing\(", p.read_text()) for p in watchers), (
            f"no test of {module} calls its missing()"
        )


#: Names with a leading underscore that are their library's documented public API, not private.
DOCUMENTED = {"os._exit"}  # the exit without cleanup handlers: the teardown would abort (_shutdown)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.Module) -> set[str]:
    """The names a module defines: functions, classes, module and class variables, and what it
    stores on ``self``/``cls``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    return names


#: Private names nbckpt's own classes define anywhere (a subclass may use its base's on ``self``).
NBCKPT_NAMES = set().union(*(_own_names(ast.parse(p.read_text())) for p in SOURCES))


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def other_libraries_private_names(path: Path) -> list[str]:
    """Every private name of another library ``path`` uses: imported (``from x import _y``, a
    ``_private`` module), read off a name imported from it (``torch._C``), or read off an
    object as an attribute no nbckpt module defines (``accelerator._models``, ``getattr(x, "_y")``)."""
    tree = ast.parse(path.read_text())
    own = _own_names(tree)
    foreign_roots = set()  # names bound by importing another library
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("nbckpt"):
                    foreign_roots.add(alias.asname or alias.name.split(".")[0])
                    found += [f"line {node.lineno}: import {alias.name}"] * any(
                        _is_private(part) for part in alias.name.split(".")
                    )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and not (node.module or "").startswith("nbckpt")
        ):
            module = node.module or ""
            foreign_roots |= {alias.asname or alias.name for alias in node.names}
            if any(_is_private(part) for part in module.split(".")):
                found.append(f"line {node.lineno}: from {module} import ...")
            found += [
                f"line {node.lineno}: from {module} import {a.name}"
                for a in node.names
                if _is_private(a.name)
            ]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and ast.unparse(node) not in DOCUMENTED:
            root = _root(node.value)
            if root in foreign_roots or (
                node.attr not in own
                # a subclass's own use of its nbckpt base's private names, on ``self`` itself
                and not (
                    isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                    and node.attr in NBCKPT_NAMES
                )
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and node.args[1].value not in own
        ):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_private_name_finder_finds_each_kind_of_use(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nfrom accelerate import _x\nfrom torch._C import y\n"
        "import torch._dynamo\nclass A:\n    def f(self, acc):\n        self._mine = 1\n"
        "        self.fig._config = 2\n"
        "        return torch._C, acc._models, getattr(acc, '_y'), self._mine, self._data\n"
    )
    assert sorted(other_libraries_private_names(sample)) == [
        "line 2: from accelerate import _x",
        "line 3: from torch._C import ...",
        "line 4: import torch._dynamo",
        "line 8: self.fig._config",
        "line 9: acc._models",
        "line 9: getattr(acc, '_y')",
        "line 9: self._data",
        "line 9: torch._C",
    ]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_other_libraries_private_names_only_in_compat_modules(path: Path) -> None:
    """torch, transformers, lightning, accelerate, plotly change their private names without
    notice: nbckpt reads them in the compat modules alone (COMPAT), where a test watches each."""
    if str(path.relative_to(PACKAGE)) in COMPAT:
        return
    found = other_libraries_private_names(path)
    assert not found, (
        f"{path.relative_to(PACKAGE)} uses another library's private names (move them to that "
        "library's compat module, with a test that fails when the library changes them):\n" + "\n".join(found)
    )


# -- tests reach nbckpt through seams, not by patching its private names ---------------------------

#: The patches of nbckpt's private names that stay, each with why no seam serves. Everything else
#: goes through a named fault seam (``engine/_faults.py``), a documented parameter, or what the
#: library patched is the machine's own (``os``, ``psutil``, ``atexit``, IPython's shell).
PATCHED = {
    "reliability/test_attacks_v4_metadata.py: _shards.overlap": (
        "counts the calls of a pure function in the sweep's inner loop; a seam there would cost "
        "every restore of a sharded tensor a call per pair of chunks it compares"
    ),
    "bench/test_launch.py: _launch.torchrun_local": (
        "torchrun's stand-in, a script whose child holds the events pipe after it exits: a real "
        "torchrun costs seconds of start, and its ranks' children cannot be started after the "
        "launch's last look at its processes on cue; an option naming the launcher would be "
        "public API only tests need"
    ),
    "bench/test_experiment.py: _compare.psutil": (
        "the free memory that makes strategies take turns run by run: faked for the whole process, "
        "the workload itself would refuse to build (it asks the same), and an option forcing the "
        "turns would be public API only tests need"
    ),
    "helpers/rank_worker.py: _ranks.ARRIVAL_TIMEOUT_S": (
        "the 30 s a rank waits for one that never makes the same call, cut to 3 s in the torchrun "
        "workers; an option for it would be public API only tests need, and timeout_s=3 would cut "
        "every collective's deadline too"
    ),
    "helpers/rank_worker.py: _ranks.JOIN_TIMEOUT_S": (
        "the 60 s a rank waits for one that never creates its Checkpointer, cut to 3 s: as above"
    ),
    "helpers/rank_worker.py: _ranks.CLOSE_TIMEOUT_S": (
        "the 5 s a closing rank waits for the others to close too, cut to 1 s for a close on rank 0 "
        "alone (both ranks' closes wait it out): as above"
    ),
    "helpers/xdist_groups.py: item._id": (
        "pytest's, not nbckpt's: the test id pytest-xdist 3.8 means to suffix with its group and "
        "cannot on pytest 9.2 (pytest-xdist#1386); this compat plugin goes when xdist does it"
    ),
}


def _private_path(dotted: str) -> bool:
    return any(_is_private(part) for part in dotted.split("."))


def _bindings(tree: ast.Module) -> tuple[dict[str, bool], set[str]]:
    """The names bound by importing from nbckpt (each: whether it is private, a private module or
    a name from one), and the names bound by importing any other library."""
    nbckpt, others = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                if alias.name.startswith("nbckpt"):
                    nbckpt[bound] = _private_path(alias.name) if alias.asname else False
                else:
                    others.add(bound)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            module = node.module or ""
            for alias in node.names:
                if module.startswith("nbckpt"):
                    nbckpt[alias.asname or alias.name] = _private_path(f"{module}.{alias.name}")
                else:
                    others.add(alias.asname or alias.name)
    return nbckpt, others


def _call_patch(node: ast.Call) -> tuple[ast.expr | None, str] | None:
    """(target, name) of a patching call, (None, "dotted.path") of one naming a path, or None."""
    func, args = node.func, node.args
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    inner = func.value if isinstance(func, ast.Attribute) else None
    if not args or not (
        name in ("setattr", "delattr", "patch")
        or (name == "object" and isinstance(inner, ast.Attribute) and inner.attr == "patch")
    ):
        return None
    if isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
        return None, args[0].value
    second = args[1] if len(args) > 1 else None
    if name != "patch" and isinstance(second, ast.Constant) and isinstance(second.value, str):
        return args[0], second.value
    return None


def _patches(tree: ast.Module) -> list[tuple[int, ast.expr | None, str]]:
    """(line, target, name) of every patch in ``tree``: ``x.setattr(target, "name", ...)`` (pytest's
    monkeypatch and its contexts), ``x.delattr``, ``setattr``, ``mock.patch.object``, an assignment
    to ``target.name``; and (line, None, "dotted.path") for ``mock.patch("...")`` and
    ``monkeypatch.setattr("...", value)``."""
    found: list[tuple[int, ast.expr | None, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (patch := _call_patch(node)) is not None:
            found.append((node.lineno, *patch))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [
                (node.lineno, target.value, target.attr)
                for target in targets
                if isinstance(target, ast.Attribute) and _root(target.value) not in ("self", "cls")
            ]
    return sorted(found, key=lambda patch: patch[0])


def nbckpt_private_patches(path: Path) -> list[str]:
    """Every patch in the test file ``path`` of an nbckpt private name: a private attribute (but
    one the file defines itself, or another library's), or any name of a private nbckpt module or
    of an object imported from one; as "target.name" (or the dotted path patched)."""
    tree = ast.parse(path.read_text())
    nbckpt, others = _bindings(tree)
    own = _own_names(tree)
    found = []
    for _, target, name in _patches(tree):
        if target is None:
            if name.startswith("nbckpt") and _private_path(name):
                found.append(name)
            continue
        root = _root(target)
        chain = ast.unparse(target)
        if root in others:
            continue  # another library's (``os``, ``psutil``): the machine, not nbckpt
        private_name = _is_private(name) and name not in own
        if nbckpt.get(root or "") or private_name or _private_path(chain.replace(f"{root}", "", 1)):
            found.append(f"{chain}.{name}")
    return found


def test_the_patch_finder_finds_each_kind_of_patch(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import os\nfrom unittest import mock\nfrom nbckpt import Checkpointer\n"
        "from nbckpt.engine import _store\nfrom nbckpt.engine._store import LocalStore\n"
        "class Fake:\n    def __init__(self):\n        self._mine = 1\n"
        "def test(monkeypatch, lab, fake):\n"
        "    monkeypatch.setattr(_store, 'exchange_paths', None)\n"
        "    monkeypatch.setattr(LocalStore, 'source', None)\n"
        "    monkeypatch.setattr(lab, '_apply', None)\n"
        "    monkeypatch.setattr('nbckpt.engine._store.fsync_dir', None)\n"
        "    mock.patch.object(Checkpointer, '_run', None)\n"
        "    mock.patch('nbckpt.engine._files.LocalSink')\n"
        "    lab._job = 'run'\n"
        "    lab.ckpt._saver.x = 1\n"
        "    monkeypatch.setattr(os, 'rename', None)\n"
        "    monkeypatch.setattr(Checkpointer, 'save', None)\n"
        "    monkeypatch.setattr(lab, 'kernel', None)\n"
        "    fake._mine = 2\n"
        "    setattr(lab, 'x', 1)\n"
    )
    assert nbckpt_private_patches(sample) == [
        "_store.exchange_paths",
        "LocalStore.source",
        "lab._apply",
        "nbckpt.engine._store.fsync_dir",
        "Checkpointer._run",
        "nbckpt.engine._files.LocalSink",
        "lab._job",
        "lab.ckpt._saver.x",
    ]


def test_tests_patch_no_private_name_of_nbckpt_beyond_the_list() -> None:
    """A test that patches a private function breaks silently when a refactoring renames or
    bypasses it: tests reach nbckpt through its named fault seams, its parameters and the
    machine's own interfaces. The few patches that stay are listed, each with its reason."""
    found = {
        f"{path.relative_to(ROOT / 'tests')}: {patch}"
        for path in TESTS
        for patch in nbckpt_private_patches(path)
    }
    assert not found - set(PATCHED), (
        "tests patch nbckpt's private names (use a fault seam, engine/_faults.py, or a parameter; "
        "if none can serve, list it in PATCHED with why):\n" + "\n".join(sorted(found - set(PATCHED)))
    )
    stale = sorted(set(PATCHED) - found)
    assert not stale, f"no test patches these any more: remove them from PATCHED: {stale}"


def all_names(path: Path) -> list[str]:
    """The names in the ``__all__`` list of ``path``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            assert isinstance(node.value, ast.List), f"{path}: __all__ is not a list literal"
            return [str(ast.literal_eval(item)) for item in node.value.elts]
    return []


INITS = sorted(PACKAGE.rglob("__init__.py"))
INTERNALS = sorted(PACKAGE.rglob(f"{INTERNAL}.py"))


def _code_of_markdown(text: str) -> str:
    """The code in markdown: fenced blocks and inline spans (a name in prose is not its use)."""
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    return "\n".join(blocks + re.findall(r"`[^`\n]+`", re.sub(r"```.*?```", "", text, flags=re.S)))


def documentation() -> dict[str, str]:
    """Where a user meets the public names: README, docs, the notebooks' cells, the examples."""
    texts = {"README.md": _code_of_markdown((ROOT / "README.md").read_text())}
    texts.update(
        {
            str(p.relative_to(ROOT)): _code_of_markdown(p.read_text())
            for p in sorted((ROOT / "docs").glob("*.md"))
        }
    )
    texts.update({str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "examples").glob("*.py"))})
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources = [(cell["cell_type"], "".join(cell["source"])) for cell in cells]
        texts[str(notebook.relative_to(ROOT))] = "\n".join(
            source if kind == "code" else _code_of_markdown(source) for kind, source in sources
        )
    return texts


@pytest.mark.parametrize("path", INITS, ids=lambda p: module_name(p))
def test_every_public_name_is_documented(path: Path) -> None:
    texts = documentation()
    undocumented = [
        name
        for name in all_names(path)
        if not any(re.search(rf"(?<![\w]){re.escape(name)}\b", text) for text in texts.values())
    ]
    assert not undocumented, (
        f"{module_name(path)} exports names no README, docs/*.md, notebook or example shows: {undocumented}; "
        f"document them (docs/api.md) or, if they are glue between layers, move them to {INTERNAL}.py"
    )


def test_glue_lives_only_in_a_layers_internal_module() -> None:
    """Every ``_internal`` module sits at the top of a layer and is not that layer's public face."""
    misplaced = [str(p.relative_to(PACKAGE)) for p in INTERNALS if p.parent.parent != PACKAGE]
    assert not misplaced, f"an {INTERNAL} module belongs directly in a layer's package: {misplaced}"
    for internal in INTERNALS:
        public = set(all_names(internal.parent / "__init__.py"))
        both = sorted(public & set(all_names(internal)))
        assert not both, f"{module_name(internal)} holds public names (they belong in __init__ only): {both}"
        init_imports = [t for _, t in imports(internal.parent / "__init__.py") if t.endswith(f".{INTERNAL}")]
        assert not init_imports, f"{module_name(internal.parent / '__init__.py')} re-exports its glue"


@pytest.mark.parametrize("path", INTERNALS, ids=lambda p: module_name(p))
def test_internal_modules_gather_glue_others_use(path: Path) -> None:
    """An ``_internal`` module re-exports its own layer's names (nothing defined there), each of
    which some other layer, a test of another layer, a benchmark or a script uses."""
    here = module_name(path)
    tree = ast.parse(path.read_text())
    defined = [
        type(node).__name__
        for node in tree.body
        if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.Expr))
    ]
    assert not defined, f"{here} defines code ({defined}); it only gathers names from its layer's modules"
    foreign = [t for _, t in imports(path) if layer(t) != layer(here)]
    assert not foreign, f"{here} re-exports another layer's names: {foreign}"
    own_folder = next((f for f, layer_ in TEST_LAYERS.items() if layer_ == layer(here)), None)
    users = [
        p
        for p in (
            *SOURCES,
            *TESTS,
            *sorted((ROOT / "benchmarks").glob("*.py")),
            *sorted((ROOT / "scripts").glob("*.py")),
        )
        if p != path
        and any(t == here for _, t in imports(p))
        and not (p.is_relative_to(PACKAGE) and layer(module_name(p)) == layer(here))
        and not (own_folder and p.is_relative_to(ROOT / "tests" / own_folder))
    ]
    used = "\n".join(p.read_text() for p in users)
    unused = [name for name in all_names(path) if not re.search(rf"\b{re.escape(name)}\b", used)]
    assert not unused, f"{here} exports glue no other layer uses (drop it from there): {unused}"


ENGINE = PACKAGE / "engine"
#: Where a checkpoint may be deleted, and why there: the one retention policy decides every
#: delete of old steps (the run's through the Retainer, the mirror's through ``doomed``: that
#: both tiers keep the same steps is tested by behaviour in engine/test_retention.py);
#: the others are a user's own delete, and the stores that carry it out.
DELETERS = {
    "engine/_retainer.py": "the policy's deletes after each commit",
    "engine/_mirror.py": "the mirror applies the same decision (doomed) to its copies",
    "engine/_checkpointer.py": "Checkpointer.delete, the user's",
    "integrations/lightning.py": "Lightning's remove_checkpoint of a newest step's last name in a "
    "folder no run holds (ddp_fork's temporary weights), which retention never deletes",
    "engine/_store.py": "the local store carries a delete out",
    "engine/_object_store.py": "the object store carries a delete out",
    "notebook/_browser_index.py": "the Browser's Delete button, the user's, through the holder",
}


def test_one_retention_policy_decides_which_steps_go() -> None:
    """Keeping the newest N (or the best, or every K) is written once, in engine/_retention.py:
    no other module deletes steps (Lightning's plug-in, HF's callback and the mirror once kept
    lists of their own). Any ``.delete(...)`` call outside the modules above fails here."""
    found = []
    for path in SOURCES:
        relative = str(path.relative_to(PACKAGE))
        found += [
            f"{relative}:{node.lineno}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "delete"
            and relative not in DELETERS
        ]
    assert not found, f"steps deleted outside the one retention policy (use keep= / retain()): {found}"


def _defined_privately(tree: ast.Module) -> set[str]:
    """The private names a module defines for its own objects: ``self._x = ...`` and ``def _x``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if name.startswith("_")}


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: module_name(p))
def test_no_engine_module_reaches_into_another_ones_private_attributes(path: Path) -> None:
    """Engine modules talk through each other's public names (the final save once set four
    private attributes of the Checkpointer): ``x._name`` is allowed only on ``self``/``cls`` or
    for a name the module itself defines. torch's internals are read in _torch_compat alone."""
    if path.name == "_torch_compat.py":
        return
    tree = ast.parse(path.read_text())
    own = _defined_privately(tree)
    reached = [
        f"{ast.unparse(node.value)}.{node.attr} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and node.attr not in own
        and ast.unparse(node) not in DOCUMENTED
    ]
    assert not reached, f"{module_name(path)} reaches into private attributes: {reached}"


# -- the restore path reads top to bottom -----------------------------------------------------------

#: The engine modules a restore calls back into after leaving them, and why each must: the ranks'
#: collective runs the restorer's own step on every rank; the reader consumes the check's
#: generator of file names; the registry of open Checkpointers asks one whether it is closed.
RESTORE_REENTERED = {"_restorer", "_dcp_check", "_checkpointer"}


def _engine_module(frame: types.FrameType | None) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.removeprefix("nbckpt.engine.") if name.startswith("nbckpt.engine.") else None


def reentered_while(run: Callable[[], object]) -> dict[str, set[str]]:
    """The engine modules a call returns to while ``run`` runs (on any thread): a module already
    on the call stack below the module that calls into it, each with the stacks it happened in."""
    found: dict[str, set[str]] = {}

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        here = _engine_module(frame) if event == "call" else None
        if here is None:
            return
        stack: list[str] = []
        caller: types.FrameType | None = frame
        while caller is not None:
            module = _engine_module(caller)
            if module is not None and (not stack or stack[-1] != module):
                stack.append(module)
            caller = caller.f_back
        if here in stack[1:]:
            found.setdefault(here, set()).add(" > ".join(reversed(stack)))

    threading.setprofile(profile)  # type: ignore[arg-type]
    sys.setprofile(profile)  # type: ignore[arg-type]
    try:
        run()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return found


def test_the_restore_path_returns_to_at_most_three_modules_it_had_left(tmp_path: Path) -> None:
    """From ``Checkpointer.restore`` down, a reader follows the calls and comes back to at most
    three modules it had already left (issue 30; the same three before and after its steps)."""
    import torch

    from nbckpt import Checkpointer

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        ckpt.save({"model": model, "optim": optimizer, "step": 1}, step=1)
    with Checkpointer(tmp_path, mode="sync") as ckpt:
        state = {"model": model, "optim": optimizer, "step": 0}
        found = reentered_while(lambda: ckpt.restore(state))
    assert state["step"] == 1
    assert len(found) <= 3, "\n".join(f"{m}: {sorted(stacks)[0]}" for m, stacks in sorted(found.items()))
    # equal, not within: a module that stops being re-entered leaves RESTORE_REENTERED (the
    # tracer is also seen to work)
    assert set(found) == RESTORE_REENTERED, {
        m: min(found.get(m, {"not re-entered"})) for m in set(found) ^ RESTORE_REENTERED
    }
