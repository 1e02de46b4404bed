"""Autosave: ``%ckpt_autosave`` and ``nbckpt.notebook.Autosave`` in IPython's test shell, and in
real kernels that are interrupted, restarted and sent SIGTERM."""

from __future__ import annotations

import ast
import atexit
import re
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers.kernel import RealKernel
from helpers.storage import Throttle
from helpers.sync import until
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbckpt import Checkpointer, ConfigError, SaveHandle, SaveRecord, SaveSchedule
from nbckpt._util import format_bytes, parse_duration
from nbckpt.engine._internal import step_name
from nbckpt.notebook import Autosave, Browser
from nbckpt.notebook._session import Save


@pytest.fixture
def shell(ip: InteractiveShell) -> Iterator[InteractiveShell]:
    ip.user_ns["step"] = 0
    yield ip  # the ip fixture's %unload_ext stops any autosave left running
    ip.user_ns.pop("step", None)


def running(shell: InteractiveShell) -> Autosave:
    autosave = Autosave.active(shell)
    assert autosave is not None and autosave.running
    return autosave


def hooks(shell: InteractiveShell) -> tuple[int, int]:
    return len(shell.events.callbacks["pre_run_cell"]), len(shell.events.callbacks["post_run_cell"])


class Clock:
    """``time.monotonic``, moved on by the test (an autosave's ``clock``)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.ahead


def clock_of(autosave: Autosave) -> Clock:
    if not isinstance(autosave.clock, Clock):
        autosave.clock = Clock()
    return autosave.clock


def late_cell(shell: InteractiveShell, code: str = "pass") -> bool:
    """Run a cell that ends once the autosave's budget has passed (its clock moved on by it)."""
    clock_of(running(shell)).ahead += running(shell).every_s
    return bool(shell.run_cell(code).success)


def committed(directory: Path, step: int) -> bool:
    return (directory / step_name(step) / "manifest.json").is_file()


def autosave_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("nbckpt: autosave")]


# -- parsing and setting up ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("10min", 600),
        ("1h", 3600),
        ("90", 90),
        ("0.2s", 0.2),
        ("1.5 h", 5400),
        ("500ms", 0.5),
        ("2m", 120),
        (45, 45),
        (0.25, 0.25),
    ],
)
def test_durations(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "soon", "10 parsecs", "-5s", "0", "0s", "1e400", "nan", True, None, -1])
def test_a_bad_duration_is_a_one_line_config_error(bad: object) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_duration(bad, "every")  # type: ignore[arg-type]
    assert str(caught.value).startswith("every must be a positive number of seconds or a duration")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("model --every soon", "argument --every: must be a duration such as 30s, 10min or 1h, not 'soon'"),
        ("model --timeout 0", "argument --timeout: must be a duration"),
        ("model nothere", "no variable named 'nothere'"),
        ("model --step nostep", "no variable named 'nostep'"),
        ("--every 1h", "name the variables to autosave: %ckpt_autosave model opt --every ..."),
        ("model --off", "--off takes no variables or options"),
        ("model -d /dev/null/run", "cannot checkpoint to '/dev/null/run'"),  # under a file
    ],
)
def test_bad_setup_is_a_one_line_usage_error_and_hooks_nothing(
    shell: InteractiveShell, line: str, message: str
) -> None:
    before = hooks(shell)
    with pytest.raises(UsageError) as caught:
        shell.run_line_magic("ckpt_autosave", line)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert hooks(shell) == before and Autosave.active(shell) is None


def test_rerunning_the_cell_replaces_the_autosave_without_adding_hooks(
    shell: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = hooks(shell)
    line = f"model opt --every {{every}} --step step -d {tmp_path / 'run'}"
    shell.run_cell("%ckpt_autosave " + line.format(every="1h"))
    first = running(shell)
    assert hooks(shell) == (before[0] + 1, before[1] + 1)
    out = capsys.readouterr().out
    assert f"nbckpt: autosaving model opt (step from 'step') to {tmp_path / 'run'} every 1 h" in out
    assert "last: none yet" in out and "next: the first cell to end after" in out
    shell.run_cell("%ckpt_autosave " + line.format(every="10min"))
    assert running(shell) is not first and not first.running
    assert hooks(shell) == (before[0] + 1, before[1] + 1)  # the old one's hooks are gone
    assert "nbckpt: replaced the autosave of model opt" in capsys.readouterr().out
    shell.run_line_magic("ckpt_autosave", "")
    assert "every 10 min" in capsys.readouterr().out
    shell.run_line_magic("ckpt_autosave", "--off")
    assert hooks(shell) == before and Autosave.active(shell) is None
    assert capsys.readouterr().out == "nbckpt: stopped autosaving model opt\n"
    shell.run_line_magic("ckpt_autosave", "--off")
    shell.run_line_magic("ckpt_autosave", "")
    assert capsys.readouterr().out.splitlines() == [
        "nbckpt: no autosave to stop",
        "nbckpt: no autosave running; start one with %ckpt_autosave model opt --every 10min",
    ]


class ExitHooks:
    """Stands in for ``atexit.register`` and ``unregister`` (a test process cannot list what
    atexit holds, and must not run the hooks of a test's objects when it exits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hooks: list[Callable[[], None]] = []
        monkeypatch.setattr(atexit, "register", self.hooks.append)
        monkeypatch.setattr(atexit, "unregister", self.unregister)

    def unregister(self, hook: Callable[[], None]) -> None:
        self.hooks[:] = [h for h in self.hooks if h != hook]

    def of(self, owner: object) -> list[Callable[[], None]]:
        """The hooks that are methods of ``owner``."""
        return [h for h in self.hooks if getattr(h, "__self__", None) is owner]


def test_unload_removes_the_hooks_the_signal_handler_and_the_exit_hook(
    shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exits = ExitHooks(monkeypatch)
    before, handler = hooks(shell), signal.getsignal(signal.SIGTERM)
    shell.run_line_magic("ckpt_autosave", f"model --every 1h -d {tmp_path / 'run'}")
    autosave = running(shell)
    assert signal.getsignal(signal.SIGTERM) is not handler
    # one exit hook, registered after its Checkpointer's, so that it runs first
    assert len(exits.of(autosave)) == 1 and exits.hooks[-1] in exits.of(autosave)
    assert shell.run_cell("pass").success  # each cell puts it last again: still one
    assert len(exits.of(autosave)) == 1 and exits.hooks[-1] in exits.of(autosave)
    shell.run_line_magic("unload_ext", "nbckpt")
    assert hooks(shell) == before and Autosave.active(shell) is None
    assert signal.getsignal(signal.SIGTERM) is handler and exits.of(autosave) == []
    shell.run_line_magic("load_ext", "nbckpt")  # for the fixture, which unloads it


# -- when it saves ---------------------------------------------------------------------------------


def test_cells_save_once_the_budget_has_passed_numbered_after_the_newest_step(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    target = tmp_path / "run"
    with Checkpointer(target) as earlier:  # a step of an earlier run in the directory
        earlier.save({"w": torch.ones(2)}, step=7)
    shell.run_line_magic("ckpt_autosave", f"model opt --every 1h -d {target}")
    assert shell.run_cell("x = 1").success
    autosave = running(shell)
    assert autosave.last is None  # within the hour: nothing saved
    for expected in (8, 9):
        assert late_cell(shell)
        assert autosave.last is not None and autosave.last.handle.wait().step == expected
    table = shell.run_line_magic("ckpt_status", "")
    assert table["mode"].tolist() == ["autosave", "autosave"] and table["step"].tolist() == [8, 9]
    assert (table["variables"] == "model opt").all()
    assert "last: step 9 at " in autosave.status() and "(committed)" in autosave.status()


def test_a_save_in_flight_skips_the_autosave_instead_of_queueing_it(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    target = tmp_path / "run"
    shell.run_line_magic("ckpt_autosave", f"model --every 1h -d {target}")
    autosave = running(shell)
    pending = SaveHandle(99, 0, 0, reported=True)  # a save of the user's, still writing
    busy = Save(key=autosave.key, directory=str(target), mode="async", names=("model",), handle=pending)
    autosave.session.saves.append(busy)
    try:
        assert late_cell(shell)
        assert autosave.last is None
        pending.committed.set_result(SaveRecord(99, "", 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
        assert late_cell(shell)  # the next cell tries again
        assert autosave.last is not None and autosave.last.handle.wait().step == 100  # after 99
    finally:
        autosave.session.saves.remove(busy)


def test_an_interrupted_cell_is_saved_at_once(
    shell: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "run"
    shell.run_line_magic("ckpt_autosave", f"model opt --every 1h --step step -d {target}")
    result = shell.run_cell("step = 5\nmodel.weight.data.fill_(5.0)\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "nbckpt: autosaving step 5 of the interrupted cell" in capsys.readouterr().out
    handle = running(shell).last
    assert handle is not None and handle.handle.wait().step == 5
    with Checkpointer(target, read_only=True) as ckpt:
        saved = ckpt.load(5)
    assert saved["step"] == 5 and bool((saved["model"]["weight"] == 5.0).all())


def test_a_step_saved_by_another_run_is_never_replaced(
    shell: InteractiveShell, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "run"
    with Checkpointer(target) as earlier:
        earlier.save({"w": torch.ones(2)}, step=5)
    shell.user_ns["step"] = 5
    shell.run_line_magic("ckpt_autosave", f"model --every 1h --step step -d {target}")
    for _ in range(2):
        assert late_cell(shell)
    assert autosave_lines(caplog) == 2 * [  # said under each cell it refuses to save
        f"nbckpt: autosave to {target}: step 5 is already in {target} and was not saved in this "
        "session: it is not replaced (autosaves go on once the step moves on)"
    ]
    autosave = running(shell)
    shell.user_ns["step"] = 6
    assert late_cell(shell)
    first = autosave.last
    assert first is not None and first.handle.wait().step == 6
    assert late_cell(shell)  # the step has not moved: a cell that only looked saves nothing
    assert autosave.last is first
    shell.user_ns["model"].weight.data.fill_(6.0)
    assert not late_cell(shell, "raise KeyboardInterrupt")  # interrupted: its own step 6 is replaced
    assert autosave.last is not first and autosave.last is not None
    assert autosave.last.handle.wait().step == 6  # without a warning (warnings fail tests)
    with Checkpointer(target, read_only=True) as ckpt:
        assert ckpt.steps() == [5, 6] and torch.equal(ckpt.load(5)["w"], torch.ones(2))


def test_training_on_from_an_older_step_says_so_in_one_log_line(
    shell: InteractiveShell, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "run"
    shell.run_line_magic("ckpt_autosave", f"model --every 1h --step step -d {target}")
    for value in (1, 2):
        shell.user_ns["step"] = value
        assert late_cell(shell)
        running(shell).last.handle.wait()  # type: ignore[union-attr]
    shell.run_line_magic("ckpt_restore", f"model step --step 1 -d {target}")
    shell.user_ns["step"] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # after a cell, a warning would point at the kernel's code
        assert late_cell(shell)
    running(shell).last.handle.wait()  # type: ignore[union-attr]
    aside = [r.getMessage() for r in caplog.records if "those are set aside" in r.getMessage()]
    assert len(aside) == 1 and "set-aside-1" in aside[0] and "\n" not in aside[0]
    assert committed(target, 3) and committed(target / "set-aside-1", 2)


def test_problems_are_one_line_and_never_fail_the_cell(
    shell: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_line_magic("ckpt_autosave", f"model --every 1h --step step -d {tmp_path / 'run'}")
    shell.user_ns["step"] = "three"
    problem = "the step variable 'step' is 'three', not a non-negative integer"
    for _ in range(2):  # each failure is shown under its cell, not only the first
        assert late_cell(shell)
        assert capsys.readouterr().err == f"nbckpt: autosave to {tmp_path / 'run'}: {problem}\n"
    status = running(shell).status().splitlines()
    assert status[1] == "  last: none saved yet"  # never "none yet" after failures
    assert status[2].startswith("  failed: 2 time(s), the last at ") and status[2].endswith(problem)
    shell.user_ns["step"] = 1
    del shell.user_ns["model"]
    assert late_cell(shell)
    err = capsys.readouterr().err
    assert err.strip().endswith("no variable named 'model' in this notebook") and "\n" not in err.strip()
    assert "Traceback" not in err


def test_the_browser_deletes_through_the_autosave_and_refuses_the_step_in_flight(
    shell: InteractiveShell, tmp_path: Path, throttle: Throttle
) -> None:
    target = tmp_path / "run"
    shell.run_line_magic("ckpt_autosave", f"model --every 1h --step step -d {target}")
    autosave = running(shell)
    for value in (1, 2, 3):
        shell.user_ns["step"] = value
        assert late_cell(shell)
        autosave.last.handle.wait()  # type: ignore[union-attr]
    holder = autosave.session.checkpointers[autosave.key]
    browser = Browser(target)
    browser.select(1)
    assert browser.delete() and browser.confirm_delete(), browser.error  # not "in use"
    assert [row.step for row in browser.rows] == [2, 3] and not committed(target, 1)
    assert autosave.session.checkpointers[autosave.key] is holder and holder.steps() == [2, 3]
    # Ctrl-C in a cell saves step 3 again: while it is written, its Delete is refused
    throttle.hold()
    assert not late_cell(shell, "raise KeyboardInterrupt")
    assert throttle.entered.wait(30)
    browser.select(3)
    assert not browser.delete()
    assert browser.error == (
        "Cannot delete: a save of step 3 is in flight in this kernel; delete it once it has committed"
    )
    throttle.release.set()
    autosave.last.handle.wait()  # type: ignore[union-attr]
    # switched off, the session still holds the directory: the Delete still goes through it
    shell.run_line_magic("ckpt_autosave", "--off")
    browser.select(2)
    assert browser.delete() and browser.confirm_delete(), browser.error
    assert [row.step for row in browser.rows] == [3] and holder.steps() == [3] and committed(target, 3)
    browser.close()


# -- the final save ----------------------------------------------------------------------------------


def test_the_exit_hook_saves_only_what_a_cell_changed(
    shell: InteractiveShell, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "run"
    handler = signal.getsignal(signal.SIGTERM)
    line = f"model opt --every 1h --step step -d {target}"
    try:
        shell.run_line_magic("ckpt_autosave", line)
        running(shell)._at_exit()  # as atexit calls it: nothing ran since the autosave started
        assert caplog.messages[-1] == (
            "nbckpt: kernel exit: nothing new to save; the saves in flight committed"
        )
        assert Autosave.active(shell) is None and not list(target.glob("step-*"))
        shell.run_line_magic("ckpt_autosave", line)
        assert shell.run_cell("step = 3").success
        running(shell)._at_exit()
        assert caplog.messages[-1] == "nbckpt: kernel exit: final save of step 3 committed"
        assert committed(target, 3)
    finally:
        signal.signal(signal.SIGTERM, handler)  # the exit hook ignores a late SIGTERM


def test_a_save_schedule_sets_the_autosave_interval_from_the_measured_costs(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    """--mtbf in place of --every: the first cell saves (measuring the cost), the next ones wait
    the interval Young/Daly advises for that cost; a costlier save waits longer."""
    target = tmp_path / "run"
    shell.run_line_magic("ckpt_autosave", f"model opt --mtbf 8h -d {target}")
    autosave = running(shell)
    assert "by a save schedule for an MTBF of 8 h" in autosave.status()
    assert shell.run_cell("x = 1").success
    assert autosave.last is not None and autosave.last.handle.wait().step == 0  # at once
    assert shell.run_cell("x = 2").success and autosave.last.handle.step == 0  # then not for a while
    pacer = autosave._pacer
    assert pacer is not None and pacer.interval is not None
    cheap = pacer.interval.seconds  # sqrt(2 x a save's stall x 8 h): seconds, not one cell
    assert cheap > 10 * autosave.session.opened(str(target)).records[0].stall_s
    assert autosave.status().split("\n")[0].endswith(pacer.interval.reason)
    clock_of(autosave).ahead += cheap  # the interval has passed
    assert shell.run_cell("x = 3").success and autosave.last.handle.wait().step == 1
    slow = SaveRecord(3, "", 0, 4.0, 0.1, 1.0, 0.0, 0.0, 0.0)  # saves stalling 4 s
    pacer.decide(0.0, [slow] * 5, None)
    assert pacer.interval is not None and pacer.interval.seconds > 3 * cheap
    with pytest.raises(UsageError, match="not both"):
        shell.run_line_magic("ckpt_autosave", f"model --every 1h --mtbf 8h -d {target}")
    with pytest.raises(ConfigError, match="not both"):
        Autosave(["model"], every_s=60, schedule=SaveSchedule("8h"), shell=shell)
    with pytest.raises(ConfigError, match="schedule must be a SaveSchedule"):
        Autosave(["model"], schedule="8h", shell=shell)  # type: ignore[arg-type]


def test_the_python_api(shell: InteractiveShell, tmp_path: Path) -> None:
    target = tmp_path / "run"
    autosave = Autosave(
        ["model", "opt"], every_s=3600, directory=str(target), step=lambda: 11, shell=shell
    ).start()
    assert Autosave.active(shell) is autosave
    assert late_cell(shell)
    assert autosave.last is not None and autosave.last.handle.wait().step == 11
    assert repr(autosave).startswith(f"nbckpt: autosaving model opt to {target} every 1 h\n")
    autosave.stop()
    assert not autosave.running and repr(autosave).startswith("nbckpt: stopped autosaving")
    for bad in (
        {"names": []},
        {"names": ["model"], "step": 3},
        {"names": ["model"], "every_s": "never"},
        {"names": ["model", "nothere"]},
    ):
        with pytest.raises(ConfigError):
            Autosave(shell=shell, **bad)  # type: ignore[arg-type]


def test_status_shows_the_host_memory_held_for_staging(
    shell: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_line_magic("ckpt_status", "")
    assert capsys.readouterr().out == "nbckpt: host memory held for staging: 0 B\n"
    shell.run_line_magic("ckpt_sync", f"model opt -d {tmp_path / 'mem'}")
    [ckpt] = shell.magics_manager.registry["CheckpointMagics"].session.checkpointers.values()
    capsys.readouterr()
    table = shell.run_line_magic("ckpt_status", "")
    held = format_bytes(ckpt.host_bytes)
    assert ckpt.host_bytes > 0 and not ckpt.staging_pinned  # pinned only with CUDA
    assert capsys.readouterr().out == f"nbckpt: host memory held for staging: {held} (mem {held})\n"
    assert isinstance(table, pd.DataFrame) and table["mode"].tolist() == ["sync"]


# -- real kernels ----------------------------------------------------------------------------------

SETUP = """\
import logging, torch
%load_ext nbckpt
logging.getLogger("nbckpt").addHandler(logging.FileHandler({log!r}))
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
data = torch.randn(64, 16)
step = 0

def train(steps, report=False):
    global step
    for _ in range(steps):
        opt.zero_grad()
        # torch's optimizer step turns gradients off and back on in a finally block; a Ctrl-C
        # that lands inside that block (the signal is taken at its first Python call) leaves them
        # off for the kernel: the next train() would fail on a loss without a graph, no fault of
        # the autosave's. (Seen once in a full suite run.)
        with torch.enable_grad():
            loss = model(data).pow(2).mean()
        loss.backward()
        opt.step()
        step += 1
        if report:
            print(f"step {{step}}")
"""
PARAMETERS = "[p.detach().flatten().tolist() for p in model.parameters()]"


def saved_parameters(saved: dict[str, object]) -> list[list[float]]:
    model = saved["model"]
    assert isinstance(model, dict)
    return [model["weight"].flatten().tolist(), model["bias"].flatten().tolist()]


def printed_step(text: str) -> int:
    steps = re.findall(r"^step (\d+)$", text, re.MULTILINE)
    return int(steps[-1]) if steps else 0


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[RealKernel]:
    started = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1", "NBCKPT_DIR": str(tmp_path / "k")})
    # Jupyter's manager sends SIGTERM half-way through its 5 s shutdown wait: on a loaded test
    # machine that could cut the final save short, which is the previous-checkpoint-stays case.
    started.km.shutdown_wait_time = 60.0
    try:
        yield started
    finally:
        started.close()


def test_interrupt_restart_restore_and_go_on_in_a_real_kernel(kernel: RealKernel, tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "nbckpt.log"
    kernel.run(SETUP.format(log=str(log)))
    kernel.run(f"%ckpt_autosave model opt --every 0.2s --step step -d {run}")
    # Short cells: an autosave as the first cell ends 0.2 s after the last one.
    assert until(
        lambda: kernel.run("train(1)") == "" and len(list(run.glob("step-*/manifest.json"))) >= 2,
        timeout=60,
        poll_s=0,
    )

    # Ctrl-C in a long training cell, once it has printed step 20: the live state is saved at once.
    cell = kernel.send("train(10**9, report=True)")
    kernel.output(cell, until=lambda text: printed_step(text) >= 20)
    kernel.km.interrupt_kernel()
    assert kernel.reply(cell)["ename"] == "KeyboardInterrupt"
    said = re.search(r"nbckpt: autosaving step (\d+) of the interrupted cell", kernel.output(cell))
    assert said is not None
    interrupted = int(said[1])
    assert interrupted >= 20 and int(kernel.evaluate("step")) == interrupted
    live = ast.literal_eval(kernel.evaluate(PARAMETERS))
    assert until(lambda: committed(run, interrupted), timeout=60, poll_s=0.01)
    with Checkpointer(run, read_only=True) as ckpt:
        saved = ckpt.load(interrupted)
    assert saved["step"] == interrupted and saved_parameters(saved) == live

    # A few more steps with no autosave due, then a restart: the final save at exit has them.
    assert "replaced the autosave" in kernel.run(f"%ckpt_autosave model opt --every 1h --step step -d {run}")
    kernel.run("train(3)")
    final, final_live = interrupted + 3, ast.literal_eval(kernel.evaluate(PARAMETERS))
    assert not committed(run, final)
    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=120)
    assert committed(run, final)  # the old kernel is gone: its exit hook has run
    assert f"nbckpt: kernel exit: final save of step {final} committed" in log.read_text()
    with Checkpointer(run, read_only=True) as ckpt:
        assert saved_parameters(ckpt.load(final)) == final_live

    # A new kernel: restore the interrupted step and go on from it.
    kernel.run(SETUP.format(log=str(log)))
    out = kernel.run(f"%ckpt_restore model opt step -d {run} --step {interrupted}")
    assert f"restored step {interrupted}" in out
    assert ast.literal_eval(kernel.evaluate(PARAMETERS)) == live
    kernel.run(f"%ckpt_autosave model opt --every 0.2s --step step -d {run}\ntrain(2)")
    went_on = ast.literal_eval(kernel.evaluate(PARAMETERS))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.randn(64, 16)
    with Checkpointer(run, read_only=True) as ckpt:
        ckpt.restore({"model": model, "opt": opt}, step=interrupted)
    for _ in range(2):  # the same two steps here, from the checkpoint
        opt.zero_grad()
        model(data).pow(2).mean().backward()
        opt.step()
    for ours, theirs in zip(model.parameters(), went_on, strict=True):
        torch.testing.assert_close(ours.detach().flatten(), torch.tensor(theirs))
    # Its autosaves go on from the restored step: the final step is set aside, still restorable.
    aside = run / "set-aside-1"
    assert until(lambda: kernel.run("pass") == "" and committed(run, interrupted + 2), timeout=60, poll_s=0)
    assert "nbckpt: host memory held for staging: " in kernel.run("%ckpt_status")
    with Checkpointer(aside, read_only=True) as ckpt:
        assert saved_parameters(ckpt.load(final)) == final_live
    with Checkpointer(run, read_only=True) as ckpt:
        [entry] = ckpt.set_aside_runs()
    assert entry["after"] == interrupted and final in entry["steps"]


def test_sigterm_to_a_training_kernel_commits_a_final_save(kernel: RealKernel, tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "nbckpt.log"
    kernel.run(SETUP.format(log=str(log)))
    kernel.run(f"%ckpt_autosave model opt --every 1h --step step -d {run}")
    cell = kernel.send("train(10**9, report=True)")
    kernel.output(cell, until=lambda text: printed_step(text) >= 20)
    kernel.km.signal_kernel(signal.SIGTERM)
    assert until(lambda: not kernel.km.is_alive(), timeout=60, poll_s=0.01)
    process = kernel.km.provisioner.process  # type: ignore[union-attr]
    assert process.poll() == -signal.SIGTERM  # the signal still ends the kernel, as it would have
    said = re.search(r"nbckpt: SIGTERM: final save of step (\d+) committed", log.read_text())
    assert said is not None, log.read_text()
    final = int(said[1])
    assert final >= 20
    with Checkpointer(run, read_only=True) as ckpt:
        assert ckpt.steps() == [final] and ckpt.load(final)["step"] == final
        ckpt.verify(final)
