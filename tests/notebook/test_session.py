"""A notebook session a user cannot break (issue 22), in real kernels: ``nbckpt.close_all()``
under the magics and the autosave, the Browser's Delete while they hold the directory, Ctrl-C
during a large save or restore, the re-run advice."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from helpers.kernel import RealKernel
from helpers.sync import until

from nbckpt import Checkpointer

SETUP = """\
import torch
import nbckpt
%load_ext nbckpt
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
step = 5
"""


def cell(kernel: RealKernel, code: str) -> tuple[str, str]:
    """Run a cell that must succeed; what it wrote to stdout and to stderr (post_run_cell's
    autosave included: it writes under the cell before the kernel goes idle)."""
    msg_id = kernel.send(code)
    reply = kernel.reply(msg_id)
    shown = kernel.outputs(msg_id)
    assert reply["status"] == "ok", (reply, shown)
    return shown["stdout"], shown["stderr"]


def failing(kernel: RealKernel, code: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Run a cell that must fail; its reply and what it showed (see RealKernel.outputs)."""
    msg_id = kernel.send(code)
    reply = kernel.reply(msg_id)
    shown = kernel.outputs(msg_id)
    assert reply["status"] == "error", (reply, shown)
    return reply, shown


def test_close_all_leaves_the_magics_and_the_autosave_working(kernel: RealKernel, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cell(kernel, SETUP + f"%ckpt_config -d {run}")
    cell(kernel, "%ckpt_sync model opt step --step 1")
    cell(kernel, "%ckpt_autosave model opt step --every 0.001s --step step")
    out, err = cell(kernel, "closed = nbckpt.close_all()")
    assert err == ""
    # the autosave as that cell ended reopened the directory, with the session's config
    assert f"nbckpt: reopened the Checkpointer for {run} (it was closed" in out
    assert "autosave" not in err
    out, _ = cell(kernel, "step = 10\nh = %ckpt_async model opt step --step 20\nh.wait()")
    assert (run / "step-000020" / "manifest.json").is_file()
    out, _ = cell(kernel, "nbckpt.close_all()\n%ckpt_sync model opt step --step 30")
    assert "reopened the Checkpointer" in out and (run / "step-000030" / "manifest.json").is_file()
    out, _ = cell(kernel, "nbckpt.close_all()\n%ckpt_restore model opt --step 20")
    assert f"restored step 20 from {run}" in out
    cell(kernel, "nbckpt.close_all()")
    cell(kernel, "step = 40")
    assert kernel.evaluate("nbckpt.notebook.Autosave.active().last.handle.wait().step") == "40"
    # Every failure shows under the cell it followed, each time, and in the status.
    problem = "the step variable 'step' is 'three', not a non-negative integer"
    for code in ("step = 'three'", "pass", "pass"):
        _, err = cell(kernel, code)
        assert err == f"nbckpt: autosave to {run}: {problem}\n"
    out, _ = cell(kernel, "%ckpt_autosave")
    last, failed = out.splitlines()[1:3]
    assert re.fullmatch(r"  last: step 40 at \d\d:\d\d:\d\d \(committed\)", last), out
    said = re.fullmatch(r"  failed: 3 time\(s\), the last at \d\d:\d\d:\d\d: (.*)", failed)
    assert said is not None and said[1] == problem, out
    with Checkpointer(run, read_only=True) as ckpt:
        assert {1, 20, 30, 40} <= set(ckpt.steps())


def test_the_rerun_advice_is_the_magics_own_in_one_line_and_a_bad_directory_is_refused_when_set(
    kernel: RealKernel, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cell(kernel, SETUP + f"%ckpt_config -d {run}")
    assert cell(kernel, "%ckpt_sync model opt --step 1") == ("", "")
    _, err = cell(kernel, "%ckpt_sync model opt --step 1")  # the cell run again
    assert err == (
        f"UserWarning: nbckpt: step 1 already exists in {run} and is replaced; add "
        "--overwrite if that is intended, or run %ckpt_config --new-run to save into a "
        "fresh run directory\n"
    )
    assert cell(kernel, "%ckpt_sync model opt --step 1 --overwrite") == ("", "")
    out, _ = cell(kernel, "%ckpt_config")
    shown = dict(line.strip().split(": ", 1) for line in out.splitlines())
    assert shown["directory"] == str(run) and "dir" not in shown and "run" not in shown
    for bad, why in (
        ("/etc/passwd/x", "/etc/passwd is a file, not a directory"),
        ("nosuchproto://bucket/run", "cannot open nosuchproto://bucket/run"),
    ):
        reply, shown = failing(kernel, f"%ckpt_config -d {bad}")
        err = shown["stderr"] + shown["error"]
        assert reply["ename"] == "UsageError"
        assert err.strip().startswith(f"UsageError: cannot checkpoint to {bad!r}: ") and why in err
        assert len(err.strip().splitlines()) == 1, err
    out, _ = cell(kernel, "%ckpt_config")
    assert out.splitlines()[0].split(": ", 1)[1] == str(run)  # unchanged
    out, _ = cell(kernel, "%ckpt_config --new-run")
    directory = out.splitlines()[0].split(": ", 1)[1]
    assert re.fullmatch(
        rf"{re.escape(str(run))}/run-\S+ \(a --new-run inside {re.escape(str(run))}\)", directory
    ), out


def test_the_browser_deletes_while_the_autosave_holds_the_directory(
    kernel: RealKernel, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cell(kernel, SETUP + f"%ckpt_autosave model opt step --every 0.001s --step step -d {run}")
    for value in (10, 20, 30):
        # the save of the cell before is done: this cell's end is not skipped for one in flight
        cell(kernel, f"%ckpt_wait\nstep = {value}")
        assert kernel.evaluate("nbckpt.notebook.Autosave.active().last.handle.wait().step") == str(value)
    delete = "browser.select({}); print(browser.delete(), browser.confirm_delete(), browser.error)"
    out, err = cell(
        kernel, f"from nbckpt.notebook import Browser\nbrowser = Browser({str(run)!r})\n" + delete.format(10)
    )
    assert (out, err) == ("True True None\n", "")
    out, _ = cell(kernel, "%ckpt_autosave --off\n" + delete.format(20))
    assert out.splitlines()[-1] == "True True None"
    # the cell that turned the autosave on may have saved step 5 at its end (every 0.001 s)
    rows = kernel.evaluate("[row.step for row in browser.rows]")
    assert rows in ("[30]", "[5, 30]")
    with Checkpointer(run, read_only=True) as ckpt:
        assert str(ckpt.steps()) == rows


def test_ctrl_c_in_a_large_sync_save_is_one_line_saying_what_was_kept(
    kernel: RealKernel, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cell(
        kernel,
        SETUP + f"%ckpt_config -d {run}\nbig = torch.ones(1 << 25)  # 128 MiB\n%ckpt_sync big step --step 10",
    )
    msg_id = kernel.send("step = 20\n%ckpt_sync big step --step 20")
    # Mid-write: the step's temporary directory exists, its files are being written.
    assert until(lambda: bool(list(run.glob(".tmp-step-000020-*"))), timeout=120, poll_s=0.001)
    kernel.km.interrupt_kernel()
    reply, shown = kernel.reply(msg_id), kernel.outputs(msg_id)
    assert reply["status"] == "error" and shown["stderr"] == ""
    assert shown["error"] in (  # one line: the traceback through nbckpt and torch is not shown
        f"KeyboardInterrupt: step 20 is still being written in the background (%ckpt_wait waits for "
        f"it, %ckpt_status shows it); step 10 is the newest committed in {run}\n",
        f"KeyboardInterrupt: step 20 committed to {run} before the interrupt took effect\n",  # a fast disk
    )
    out, _ = cell(kernel, "%ckpt_wait")  # the save went on in the background, and counts
    assert out.startswith("nbckpt: 2 of this session's 2 save(s) committed ("), out
    with Checkpointer(run, read_only=True) as ckpt:
        assert ckpt.steps() == [10, 20]
        for saved in (10, 20):
            ckpt.verify(saved)
    assert not list(run.glob(".tmp-*"))


INTERRUPT_IN = """\
import os, signal
from nbckpt.engine import _restorer
original = {target}

def interrupted(*args, **kwargs):  # Ctrl-C arrives here, as JupyterLab's interrupt sends it
    os.kill(os.getpid(), signal.SIGINT)
    return original(*args, **kwargs)

{target} = interrupted
"""


def test_ctrl_c_in_a_restore_says_whether_the_variables_were_loaded(
    kernel: RealKernel, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cell(kernel, SETUP + f"%ckpt_config -d {run}\nw = torch.ones(8)\n%ckpt_sync w step --step 5")
    # while the files are read: nothing is loaded
    cell(kernel, "w.zero_(); step = 0\n" + INTERRUPT_IN.format(target="_restorer._Read.read"))
    reply, shown = failing(kernel, "%ckpt_restore w step")
    assert reply["ename"] == "Interrupted" and shown["stderr"] == ""
    assert shown["error"] == "KeyboardInterrupt: %ckpt_restore stopped before loading: w, step unchanged\n"
    assert kernel.evaluate("(float(w.sum()), step)") == "(0.0, 0)"
    # while loading in place: held until the state is whole, then all of it, the plain values too
    cell(kernel, "_restorer._Read.read = original\n" + INTERRUPT_IN.format(target="_restorer._apply"))
    reply, shown = failing(kernel, "%ckpt_restore w step")
    assert reply["ename"] == "Interrupted" and shown["stderr"] == ""
    assert shown["error"] == (
        f"KeyboardInterrupt: step 5 of {run} was loaded into w, step before the interrupt took effect\n"
    )
    assert kernel.evaluate("(float(w.sum()), step)") == "(8.0, 5)"
