"""Compat plugin: ``--dist loadgroup`` groups the tests marked ``xdist_group`` again on pytest 9.2.

pytest-xdist 3.8 tells the scheduler a test's group by appending ``@group`` to the test's id in
the worker, through ``item._nodeid``; pytest 9.2 keeps the id in ``item._id`` (a ``NodeId``) and no
longer reads ``_nodeid``, so the suffix never arrives and every grouped test is scheduled on its
own (pytest-dev/pytest-xdist#1386, fix proposed in #1388). Then the 4-rank sharded launches ran
once per worker, each worker started its own report run, and two JupyterLabs could run at once.
This plugin sets the suffix where xdist's own could not, and does nothing where xdist's worked.
"""

from __future__ import annotations

import pytest


def _group(item: pytest.Item) -> str | None:
    """The suffix xdist would give ``item``: its group names sorted and joined, as xdist does."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    return "_".join(sorted(names)) if names else None


@pytest.hookimpl(trylast=True)  # after xdist's own hook, to see whether its suffix took
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "loadgroup", False):  # set in xdist workers under --dist loadgroup
        return
    for item in items:
        group = _group(item)
        if group is None or item.nodeid.endswith(f"@{group}") or not hasattr(item, "_id"):
            continue
        # pytest's private structured id: parsing the suffixed string keeps it as the id's text
        item._id = type(item._id).parse(f"{item.nodeid}@{group}")
