"""A real JupyterLab server for browser tests, driven through Debian's Chromium with Playwright.

with jupyter_lab(tmp_path, root) as server:      # root holds the notebooks to open
    page = open_notebook(browser, server, "06_lab.ipynb")
    run_all(page)
"""

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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from helpers import ROOT

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
#: The marks of every browser test: one xdist group (one JupyterLab at a time), skipped without Chromium.
BROWSER_MARKS = [
    pytest.mark.browser,
    pytest.mark.xdist_group("browser"),
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's Chromium at /usr/bin/chromium (make browser-deps)"
    ),
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


def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@contextmanager
def jupyter_lab(tmp_path: Path, root: Path) -> Iterator[Server]:
    """JupyterLab serving ``root``, its settings and runtime files under ``tmp_path``."""
    config = tmp_path / "config"
    (config / "labconfig").mkdir(parents=True)
    # the documented way to turn off the "get Jupyter news?" prompt (labextension disable)
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps(
            {
                "disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True},
                "exposeAppInBrowser": True,
            }  # window.jupyterapp: to hide the file browser for the picture
        )
    )
    tracker = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True)
    # start the notebook's kernel without asking; keep every cell in the DOM (no windowing)
    (tracker / "tracker.jupyterlab-settings").write_text(
        json.dumps({"autoStartDefaultKernel": True, "windowingMode": "none"})
    )
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(config),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
    }
    env.pop("NBCKPT_BATCH", None)
    port, token = _free_port(), secrets.token_hex(16)
    command = [
        str(Path(sys.executable).parent / "jupyter"),
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if os.getuid() == 0:
        command.append("--allow-root")
    log = (tmp_path / "jupyter.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, f"jupyter lab exited: {(tmp_path / 'jupyter.log').read_text()}"
        request = urllib.request.Request(f"{url}/api/status", headers={"Authorization": f"token {token}"})
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    try:
        until(ready, 90, "jupyter lab to answer /api/status")
        yield Server(url, token, root)
    finally:
        process.send_signal(signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


def console_errors(page: Any) -> list[str]:
    """Collect what the page logs as an error (console.error and uncaught exceptions)."""
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"uncaught: {exc}"))
    return errors


def open_notebook(page: Any, server: Server, notebook: str) -> None:
    """Open ``notebook`` with the file browser folded away and wait for its kernel. It opens in a
    workspace of its own: on a server another test used, the default one would bring that test's
    notebook back beside it."""
    workspace = Path(notebook).stem
    page.goto(f"{server.url}/lab/workspaces/{workspace}/tree/{notebook}?token={server.token}")
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook", timeout=60_000)
    # the file browser away: figures take the width they find when they render
    page.evaluate("window.jupyterapp.commands.execute('application:toggle-left-area')")
    # cells run while the kernel is still initializing are dropped: wait for idle
    page.get_by_text(re.compile(r"\| Idle$")).first.wait_for(timeout=90_000)


def open_and_run_all(page: Any, server: Server, notebook: str) -> None:
    """Open ``notebook`` (:func:`open_notebook`), then Run All."""
    open_notebook(page, server, notebook)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def rerun_cell(page: Any, has_text: str) -> Any:
    """Run the code cell that shows ``has_text`` again, as a user would (click it, Ctrl+Enter);
    return the cell."""
    cell = page.locator(".jp-Notebook .jp-CodeCell").filter(has_text=has_text)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Control+Enter")
    return cell


def screenshot_for_docs(element: Any, name: str, docs_copy: Path) -> None:
    """``element`` alone at ``ARTIFACTS/name``; copied over ``docs_copy`` (a picture in the docs)
    when NBCKPT_UPDATE_SCREENSHOT=1."""
    element.scroll_into_view_if_needed()
    shot = ARTIFACTS / name
    element.screenshot(path=str(shot), scale="css", animations="disabled")
    if os.environ.get("NBCKPT_UPDATE_SCREENSHOT", "") not in ("", "0"):
        docs_copy.write_bytes(shot.read_bytes())


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium under Playwright: one browser for several pages (each its own context)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def chromium_page(failed_shot: str, *, height: int, width: int = 1400, browser: Any = None) -> Iterator[Any]:
    """A Chromium page (1400 px wide by default), in a fresh context of ``browser`` (or of a browser
    of its own). A failure in the block leaves a full-page screenshot at ``ARTIFACTS/failed_shot``;
    errors the console logged fail the test when the block ends."""
    if browser is None:
        with chromium() as own, chromium_page(failed_shot, height=height, width=width, browser=own) as page:
            yield page
        return
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    errors = console_errors(page)
    try:
        yield page
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / failed_shot), full_page=True)
        raise
    finally:
        context.close()
    assert not errors, "the browser console logged errors:\n" + "\n".join(errors)
