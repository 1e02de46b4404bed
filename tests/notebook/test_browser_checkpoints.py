"""The checkpoint browser in a real JupyterLab, driven through Debian's Chromium with Playwright:
a notebook trains a little, saves three steps and shows a Browser beside its open Checkpointer;
two steps picked in its list and Diff give the per-tensor table; Delete goes through that
Checkpointer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import ROOT
from helpers.jupyterlab import (
    BROWSER_MARKS,
    Server,
    chromium_page,
    jupyter_lab,
    open_and_run_all,
    rerun_cell,
    screenshot_for_docs,
    until,
)

#: The picture of the browser in the docs; rewritten by this test with NBCKPT_UPDATE_SCREENSHOT=1.
SCREENSHOT = ROOT / "docs" / "browser.png"

pytestmark = BROWSER_MARKS

# The encoder is frozen: between two steps only the head (and nothing of the encoder) changes.
TRAIN = """\
import torch
from nbckpt import Checkpointer
from nbckpt.notebook import Browser

torch.manual_seed(0)
encoder, head = torch.nn.Linear(16, 8), torch.nn.Linear(8, 2)
encoder.requires_grad_(False)
opt = torch.optim.SGD(head.parameters(), lr=0.1)
ckpt = Checkpointer("checkpoints/run", mode="sync")  # left open: the browser reads without its
# lock, and deletes through it
for step in (100, 200, 300):
    loss = head(torch.relu(encoder(torch.randn(32, 16)))).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    ckpt.save({"encoder": encoder, "head": head, "optim": opt, "step": step, "lr": 0.1}, step=step)
"""
BROWSE = 'browser = Browser("checkpoints/run")\nbrowser'


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "root"
    root.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(BROWSE)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "browse.ipynb")
    with jupyter_lab(tmp_path, root) as running:
        yield running


def row_ids(table: Any) -> list[str]:
    """The data-id of each of the table's body rows, top to bottom."""
    return list(table.locator("tbody tr").evaluate_all("(rows) => rows.map((r) => r.dataset.id)"))


def pick(page: Any, *labels: str) -> None:
    """Pick steps in the browser's list, as a click (Ctrl-click for the second) does."""
    page.locator(".nbckpt-browser .nbckpt-pick select").select_option(label=list(labels))


def test_two_picked_steps_diff_in_jupyterlab(server: Server) -> None:
    """Run All; pick steps 100 and 300, then Diff: the head's tensors head the diff table as
    changed and the encoder's are unchanged; Verify marks both verified;
    re-running the Browser's cell shows one working browser; the console stays clean."""
    with chromium_page("browser-checkpoints-failed.png", height=1200) as page:
        open_and_run_all(page, server, "browse.ipynb")
        widget = page.locator(".nbckpt-browser")
        widget.wait_for(timeout=120_000)
        steps = widget.locator(".nbckpt-steps table tbody tr")
        until(lambda: steps.count() == 3, 60, "the three steps in the table")
        assert "not checked" in steps.first.inner_text()

        pick(page, "step 100", "step 300")
        until(
            lambda: widget.locator(".nbckpt-steps tr.nbckpt-selected").count() == 2,
            30,
            "the two picked steps to show selected in the table",
        )
        widget.locator("button", has_text="Diff").click()  # waits for it to be enabled

        diff = widget.locator(".nbckpt-diff table")
        diff.locator('tr[data-id="head.weight"]').wait_for(timeout=60_000)
        names = row_ids(diff)
        assert names[:2] in (["head.weight", "head.bias"], ["head.bias", "head.weight"])
        assert set(names[2:]) == {"encoder.weight", "encoder.bias"}
        for name, status in (("head.weight", "changed"), ("encoder.bias", "unchanged")):
            cells = diff.locator(f'tr[data-id="{name}"] td').all_inner_texts()
            assert cells[:2] == [name, status], cells
        assert "step 100 → step 300" in widget.locator(".nbckpt-diff-summary").inner_text()

        widget.locator("button", has_text="Verify").click()
        until(
            lambda: widget.locator(".nbckpt-steps tr.nbckpt-row-verified").count() == 2,
            60,
            "the two selected steps to show verified",
        )
        screenshot_for_docs(widget, "browser-checkpoints.png", SCREENSHOT)

        # re-run the Browser's cell, as a user would: one browser again, and it works
        rerun_cell(page, "= Browser(")
        until(
            lambda: (
                page.locator(".nbckpt-browser .nbckpt-steps tr.nbckpt-selected").count() == 0
                and page.locator(".nbckpt-browser .nbckpt-steps tbody tr").count() == 3
            ),
            60,
            "the browser of the re-run cell",
        )
        assert page.locator(".nbckpt-browser").count() == 1
        pick(page, "step 200")
        page.locator(".nbckpt-browser button", has_text="Verify").click()
        page.locator(".nbckpt-browser .nbckpt-ok", has_text="Verified 1 step(s)").wait_for(timeout=60_000)

        # Delete while the kernel's Checkpointer holds the run: it deletes through that one
        pick(page, "step 100")
        page.locator(".nbckpt-browser button[title^='delete the selected step']").click()
        page.locator(".nbckpt-browser button", has_text="Confirm delete").click()
        page.locator(".nbckpt-browser .nbckpt-ok", has_text="Deleted step 100.").wait_for(timeout=60_000)
        table = page.locator(".nbckpt-browser .nbckpt-steps table")
        until(lambda: row_ids(table) == ["200", "300"], 60, "the table without step 100")
        assert not (server.root / "checkpoints" / "run" / "step-000100").exists()
