"""The lab notebook in a real JupyterLab, driven through Debian's Chromium with Playwright."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
import pytest
from helpers import ROOT

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
#: The README's picture of the lab; rewritten by this test with NBCKPT_UPDATE_SCREENSHOT=1.
SCREENSHOT = ROOT / "docs" / "lab.png"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
# The first run is long (it is stopped by re-running the lab's cell); the run after that uses
# SHORT: small enough to end in seconds, long enough for the browser to see the timeline grow.
PARAMETERS = {"preset": "synthetic", "size_mb": 8.0, "steps": 5000, "every": 500, "repeats": 3,
              "strategies": ["torch-save", "nbckpt-async"]}
SHORT = {"steps": 150, "every": 25}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.xdist_group("browser"),
    pytest.mark.skipif(not CHROMIUM.exists(),
                       reason="needs Debian's Chromium at /usr/bin/chromium (make browser-deps)"),
]


@dataclass
class Server:
    url: str
    token: str
    root: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _lab_notebook(root: Path, checkpoints: Path) -> None:
    """notebooks/06_lab.ipynb with small parameters, as a user would edit its first cell."""
    nb = nbformat.read(ROOT / "notebooks" / "06_lab.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    # relative to the notebook, as a user would write it (and as the README picture shows)
    values = {**PARAMETERS, "directory": "checkpoints"}
    lines = cell.source.splitlines()
    for i, line in enumerate(lines):
        name = line.split("=")[0].strip()
        if name in values:
            lines[i] = f"{name} = {values.pop(name)!r}"
    assert not values, f"parameters missing from the notebook: {sorted(values)}"
    cell.source = "\n".join(lines)
    # and a magic whose status line must turn "committed" in the page (a display update)
    nb.cells.append(nbformat.v4.new_code_cell(
        f"%load_ext nbckpt\nimport torch\nx = torch.zeros(1 << 24)\n"
        f"h = %ckpt_async x -d {checkpoints / 'magic'}"
    ))
    # what a user changes before running the lab's cell again (Run All runs it last)
    nb.cells.append(nbformat.v4.new_code_cell(
        "; ".join(f"{name} = {value!r}" for name, value in SHORT.items())
    ))
    nbformat.write(nb, root / "06_lab.ipynb")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    root = tmp_path / "root"
    root.mkdir()
    _lab_notebook(root, tmp_path / "checkpoints")
    config = tmp_path / "config"
    (config / "labconfig").mkdir(parents=True)
    # the documented way to turn off the "get Jupyter news?" prompt (labextension disable)
    (config / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
         "exposeAppInBrowser": True}  # window.jupyterapp: to hide the file browser for the picture
    ))
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    # start the notebook's kernel without asking; keep every cell in the DOM (no windowing)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps(
        {"autoStartDefaultKernel": True, "windowingMode": "none"}
    ))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces")}
    env.pop("NBCKPT_BATCH", None)
    port, token = _free_port(), secrets.token_hex(16)
    command = [
        str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser",
        "--ip=127.0.0.1", f"--port={port}", f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    log = (tmp_path / "jupyter.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, f"jupyter lab exited: {(tmp_path / 'jupyter.log').read_text()}"
        request = urllib.request.Request(f"{url}/api/status",
                                         headers={"Authorization": f"token {token}"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        _until(ready, 90, "jupyter lab to answer /api/status")
        yield Server(url, token, root)
    finally:
        process.send_signal(signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def _save_screenshot(page: Any, lab: Any) -> None:
    """The lab alone, for the README: docs/lab.png when NBCKPT_UPDATE_SCREENSHOT=1."""
    shot = ARTIFACTS / "lab.png"
    lab.locator("table.nbckpt-results").wait_for()
    lab.scroll_into_view_if_needed()
    lab.screenshot(path=str(shot), scale="css", animations="disabled")
    if os.environ.get("NBCKPT_UPDATE_SCREENSHOT", "") not in ("", "0"):
        SCREENSHOT.write_bytes(shot.read_bytes())


def _console_errors(page: Any) -> list[str]:
    """Collect what the page logs as an error (console.error and uncaught exceptions)."""
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return errors


def test_lab_notebook_runs_live_in_jupyterlab(server: Server) -> None:
    """Run All, then Run in the lab: widgets and plot render, the timeline grows while the run
    goes on; re-running the lab's cell mid-run stops the old run and the new lab runs to its
    results table; a %ckpt_async status line turns "committed"; the console stays clean."""
    sync_api = pytest.importorskip("playwright.sync_api")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600})
        errors = _console_errors(page)
        try:
            page.goto(f"{server.url}/lab/tree/06_lab.ipynb?token={server.token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=60_000)
            # the file browser away: figures take the width they find when they render
            page.evaluate("window.jupyterapp.commands.execute('application:toggle-left-area')")
            # cells run while the kernel is still initializing are dropped: wait for idle
            page.get_by_text(re.compile(r"\| Idle$")).first.wait_for(timeout=90_000)
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            page.locator(".nbckpt-save.nbckpt-committed").wait_for(timeout=120_000)
            lab = page.locator(".nbckpt-lab")
            lab.wait_for(timeout=120_000)
            assert page.locator(".jupyter-widgets").count() > 0
            plot = lab.locator(".js-plotly-plot")
            plot.wait_for(timeout=60_000)
            bars = plot.locator("g.trace.bars g.point")

            lab.locator("button", has_text="Run").first.click()
            # the timeline gains points during the run: two counts, the second larger
            _until(lambda: bars.count() > 0, 120, "the first bars of the timeline")
            first = bars.count()
            _until(lambda: bars.count() > first, 120, "the timeline to grow")
            assert lab.locator(".nbckpt-ok").count() == 0, "grew only when the run had ended"
            page.screenshot(path=str(ARTIFACTS / "browser-lab-running.png"), full_page=True)

            # re-run the lab's cell while its run goes on, as a user editing a parameter would
            cell = page.locator(".jp-Notebook .jp-CodeCell").filter(has_text="= Lab(")
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Control+Enter")
            cell.get_by_text("stopped the previous lab").wait_for(timeout=120_000)
            lab = page.locator(".nbckpt-lab")
            lab.wait_for(timeout=60_000)
            assert lab.count() == 1, "the old lab is still on the page"
            plot = lab.locator(".js-plotly-plot")
            plot.wait_for(timeout=60_000)
            bars = plot.locator("g.trace.bars g.point")
            assert bars.count() == 0

            lab.locator("button", has_text="Run").first.click()
            table = lab.locator("table.nbckpt-results")
            lab.locator(".nbckpt-ok, .nbckpt-error").first.wait_for(timeout=180_000)
            assert lab.locator(".nbckpt-error").count() == 0, lab.inner_text()
            table.wait_for(timeout=60_000)
            for strategy in ("none", *PARAMETERS["strategies"]):
                assert table.locator("td", has_text=re.compile(f"^{strategy}$")).count() == 1
            assert bars.count() > 0
            # the log shows its newest line, not its first
            log = lab.locator(".nbckpt-log")
            assert log.evaluate("(box) => box.firstElementChild.getBoundingClientRect().bottom"
                                " <= box.getBoundingClientRect().bottom + 1")
            assert log.evaluate("(box) => box.scrollHeight > box.clientHeight")
            # the figure takes the width of the lab, not plotly's default of 700 px
            assert plot.bounding_box()["width"] > 0.9 * lab.bounding_box()["width"]
            page.screenshot(path=str(ARTIFACTS / "browser-lab.png"), full_page=True)
            _save_screenshot(page, lab)
        except BaseException:
            page.screenshot(path=str(ARTIFACTS / "browser-lab-failed.png"), full_page=True)
            raise
        finally:
            browser.close()
    assert not errors, "the browser console logged errors:\n" + "\n".join(errors)
