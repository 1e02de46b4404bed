"""The Lab widget's logic without a browser: simulated clicks, live updates, stop, errors, and
one live lab per kernel (tests/test_magics.py re-runs a lab's cell in a real kernel)."""

from __future__ import annotations

import argparse
import html
import logging
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.kernel import RealKernel

from nbckpt import ConfigError
from nbckpt.bench import OVERHEAD_DEFINITION, STALL_DEFINITION
from nbckpt.notebook._lab import LOG_LINES, SYNTHETIC, Lab, devices, live_lab


def make_lab(path: Path, **options: Any) -> Lab:
    settings: dict[str, Any] = {
        "directory": str(path),
        "preset": SYNTHETIC,
        "size_mb": 2.0,
        "strategies": ("none", "nbckpt-async"),
        "steps": 30,
        "every": 10,
        "repeats": 1,
        "refresh_s": 0.05,
    }
    return Lab(**{**settings, **options})


def poll(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def points(lab: Lab) -> int:
    return sum(len(trace.x or ()) for trace in lab.figure.data)


def test_run_click_grows_the_timeline_and_fills_the_results(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab")
    changed_by: set[str] = set()
    lab.progress.observe(lambda _: changed_by.add(threading.current_thread().name), "value")
    lab.results.observe(lambda _: changed_by.add(threading.current_thread().name), "value")
    lab.run_button.click()
    assert lab.running and lab.stop_button.disabled is False and lab.run_button.disabled
    seen = []
    deadline = time.monotonic() + 120
    while lab.running and time.monotonic() < deadline:  # sampling the live figure, not waiting
        seen.append(points(lab))
        time.sleep(0.01)
    assert lab.wait(60)
    growing = sorted({n for n in seen if n > 0})
    assert len(growing) >= 2, f"the timeline never grew during the run: {growing}"
    assert lab.error is None and lab.comparison is not None
    assert lab.comparison.results["strategy"].tolist() == ["none", "nbckpt-async"]
    assert lab.progress.value == lab.progress.max == 60
    assert "nbckpt-ok" in lab.message.value and "Done" in lab.message.value
    assert "nbckpt-results" in lab.results.value and "nbckpt-async" in lab.results.value
    kinds = {trace.name for trace in lab.figure.data}
    assert {"step", "stall", "persist"} <= kinds
    assert points(lab) == len(lab.comparison.timeline)
    # the widget's state is the figure as it is now (what a reloaded page draws)
    state = lab.figure._widget_data
    assert sum(len(trace.get("x", ())) for trace in state) == points(lab)
    assert lab.figure._widget_layout["title"]["text"] == "Timeline: each strategy's last repeat"
    assert any("[nbckpt-async]" in line for line in lab.log_lines)
    # widgets changed only from the main thread (reset) and the one updater, never the worker
    assert changed_by <= {"MainThread", "nbckpt-lab-updater"}
    assert lab.run_button.disabled is False and lab.stop_button.disabled


def test_stop_ends_the_run_promptly_with_nothing_half_written(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", steps=100_000, every=5, strategies=("nbckpt-async",))
    assert lab.run()
    assert not lab.run()  # a second run while one is going is refused
    assert "already in progress" in lab.message.value
    poll(lambda: lab.progress.value >= 12)
    lab.stop_button.click()
    assert lab.wait(60)
    assert lab.stopped and lab.error is None and lab.comparison is not None
    assert "Stopped after" in lab.message.value
    steps = int(lab.comparison.timeline["kind"].eq("step").sum())
    assert 12 <= steps < 100_000
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


def test_run_from_two_threads_at_once_starts_one_run(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", steps=100_000, every=5, strategies=("nbckpt-async",))
    both = threading.Barrier(2)
    started: list[bool] = []

    def click() -> None:
        both.wait()
        started.append(lab.run())

    threads = [threading.Thread(target=click) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sorted(started) == [False, True]
        assert "already in progress" in lab.message.value
        assert sum(t.name == "nbckpt-lab-worker" for t in threading.enumerate()) <= 1
    finally:
        lab.stop()
        assert lab.wait(60)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": -3}, "steps must be a positive integer, not -3"),
        ({"every": -1}, "checkpoint interval (every) must be an integer from 1 to 30, not -1"),
        ({"every": 31}, "checkpoint interval (every) must be an integer from 1 to 30, not 31"),
        ({"repeats": 0}, "repeats must be a positive integer, not 0"),
        ({"strategies": ()}, "select at least one strategy"),
        ({"path": " "}, "the target path is empty"),
        ({"path": "{file}/sub"}, "is a file, not a directory"),
    ],
)
def test_bad_fields_get_a_one_line_message(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    lab = make_lab(tmp_path / "lab")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for name, value in change.items():
        getattr(lab, name).value = value.format(file=a_file) if isinstance(value, str) else value
    lab.run_button.click()
    assert not lab.running
    assert lab.error is not None and message in lab.error and "\n" not in lab.error
    assert "nbckpt-error" in lab.message.value
    assert not (tmp_path / "lab").exists()


def test_out_of_memory_preset_is_a_clear_message(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", size_mb=1e9)  # about a petabyte
    assert lab.run() and lab.wait(60)
    assert lab.error is not None and lab.error.startswith("Cannot run: ")
    assert "memory" in lab.error and "nbckpt-error" in lab.message.value
    assert lab.progress.bar_style == "danger"
    assert not any("Traceback" in line for line in lab.log_lines)


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc as an unwritable target")
def test_unwritable_target_is_a_clear_message(tmp_path: Path) -> None:
    lab = make_lab(Path("/proc/nbckpt-lab-test"))
    assert lab.run() and lab.wait(60)
    assert lab.error is not None and "/proc/nbckpt-lab-test" in lab.error
    assert "nbckpt-error" in lab.message.value
    assert lab.run_button.disabled is False  # ready for another try


def test_from_args_and_display(tmp_path: Path) -> None:
    args = argparse.Namespace(
        dir=str(tmp_path),
        preset=None,
        size_mb=8.0,
        strategies="torch-save, nbckpt-async",
        steps=12,
        every=4,
        device="cpu",
        repeats=2,
        compute_ms=1.0,
        no_warmup=True,
        json=None,
    )
    lab = Lab.from_args(args)
    assert lab.preset.value == SYNTHETIC and lab.size_mb.value == 8.0
    assert lab.strategies.value == ("torch-save", "nbckpt-async")
    assert (lab.steps.value, lab.every.value, lab.path.value) == (12, 4, str(tmp_path))
    assert (lab.repeats.value, lab.compute_ms, lab.warmup) == (2, 1.0, False)
    bundle = lab._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "cpu" in devices() and lab.device.options == tuple(devices())
    lab.preset.value = "tiny"
    assert lab.size_mb.disabled
    # An option of nbckpt bench the live lab has no field for is refused, not dropped.
    with pytest.raises(ConfigError, match="the live lab does not take --idle-compute"):
        Lab.from_args(argparse.Namespace(**vars(args), idle_compute=True))


def test_defaults_measure_the_interval_so_saves_do_not_queue(tmp_path: Path) -> None:
    """Issue 29 defect 7: the lab's defaults (and %ckpt_bench's, whose options are nbckpt bench's)
    checkpointed every 5 steps of a few ms, faster than a save persists; now a probe of a step and
    a save picks the interval, the log says it, and the progress bar counts the steps it chose."""
    from nbckpt import cli

    from_magic = Lab.from_args(
        cli.build_parser().parse_args(["bench", "-d", str(tmp_path / "m"), "--size-mb", "2"])
    )
    assert (from_magic.steps.value, from_magic.every.value) == (0, 0)  # 0: measured
    from_magic.close()
    lab = make_lab(tmp_path / "lab", steps=None, every=None, strategies=("nbckpt-async",), compute_ms=1.0)
    assert (lab.steps.value, lab.every.value) == (0, 0)
    assert lab.run() and "a step and a save are timed for the interval" in lab.message.value
    assert lab.wait(120) and lab.error is None and lab.comparison is not None
    said = [line for line in lab.log_lines if line.startswith("checkpoint every ")]
    assert len(said) == 1 and said[0].startswith(f"checkpoint every {lab.comparison.every} steps, measured")
    assert lab.comparison.steps == 4 * lab.comparison.every
    assert lab.progress.max == lab.progress.value == 2 * lab.comparison.steps  # none and nbckpt-async
    assert (lab.steps.value, lab.every.value) == (0, 0)  # the next run measures again


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"preset": "huge"}, "unknown preset 'huge'"),
        ({"strategies": ("nbckpt-async", "magic")}, "unknown strategy 'magic'"),
        ({"device": "tpu"}, "unknown device 'tpu'"),
    ],
)
def test_bad_constructor_arguments_are_config_errors(
    tmp_path: Path, option: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_lab(tmp_path, **option)


def test_a_new_lab_stops_and_closes_the_previous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Re-running a lab's cell mid-run: the old run stops, its directory is free for the new."""
    first = make_lab(tmp_path / "lab", steps=100_000, every=5, strategies=("nbckpt-async",))
    assert first.run()
    poll(lambda: first.progress.value >= 12)  # past its first checkpoint: the lock is held
    capsys.readouterr()
    second = make_lab(tmp_path / "lab", steps=12, every=4, strategies=("nbckpt-async",))
    note = capsys.readouterr().out
    assert note.count("\n") == 1 and "stopped the previous lab's run" in note
    assert first.closed and not first.running and first.stopped
    assert first.comparison is not None  # stopped after the current step, saves committed
    assert first.widget.comm is None and first.figure.comm is None  # gone from the kernel
    assert live_lab() is second
    assert not first.run() and first.error is not None and "closed" in first.error
    assert second.run() and second.wait(120)
    assert second.error is None, second.error  # no "in use by another Checkpointer"
    assert second.comparison is not None
    row = second.comparison.results.set_index("strategy").loc["nbckpt-async"]
    assert int(row["checkpoints"]) == 3
    third = make_lab(tmp_path / "lab")
    assert capsys.readouterr().out == "nbckpt: closed the previous lab\n"
    assert second.closed and live_lab() is third
    third.close()
    assert live_lab() is None


def test_each_run_starts_clean_and_none_is_added(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", strategies=("nbckpt-async",), steps=10, every=5)
    lab.every.value = -1
    assert not lab.run() and "nbckpt-error" in lab.message.value
    lab.every.value = 5
    assert lab.run()
    assert "none (the baseline)" in lab.message.value and "nbckpt-error" not in lab.message.value
    assert lab.wait(120) and lab.error is None and lab.comparison is not None
    assert lab.comparison.results["strategy"].tolist() == ["none", "nbckpt-async"]
    assert any("[nbckpt-async]" in line for line in lab.log_lines)
    lab.strategies.value = ("torch-save",)
    assert lab.run() and lab.wait(120) and lab.error is None
    lanes = set(lab.figure.layout.yaxis.categoryarray)
    assert lanes == {
        f"{name} · {lane}" for name in ("none", "torch-save") for lane in ("train", "background")
    }
    assert {y for trace in lab.figure.data for y in trace.y} <= lanes
    assert not any("[nbckpt-async]" in line for line in lab.log_lines)  # the log was cleared
    assert "nbckpt-async" not in lab.results.value


def test_results_table_is_aligned_rounded_and_defines_overhead(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", steps=10, every=5)
    assert lab.run() and lab.wait(120) and lab.error is None
    table = lab.results.value
    cells = re.findall(r'<td style="([^"]*)">([^<]*)</td>', table)
    assert cells
    for style, text in cells:
        # words (the strategy, what a row rests on) align left; numbers right
        words = text in ("none", "nbckpt-async") or "cycles" in text
        numbers = bool(re.fullmatch(r"[+-]?\d[\d.]*( %| s|x)?", text))
        if words or numbers:
            assert f"text-align:{'left' if words else 'right'}" in style, (text, style)
        assert not re.search(r"\d\.\d{5,}", text), f"{text} is not rounded"
    assert "tabular-nums" in table and html.escape(OVERHEAD_DEFINITION) in table
    # the same headers as every nbckpt table, the stall with its two parts, and the method
    for header in (
        "overhead",
        "95 % interval",
        "per repeat",
        "rests on",
        "stall s",
        "save stall s",
        "wait for the earlier save s",
    ):
        assert f">{header}</th>" in table, header
    assert html.escape(STALL_DEFINITION) in table
    assert '<details class="nbckpt-method"' in table and html.escape("Pairs.") in table
    assert "1 repeat, 2 cycles (widened)" in table  # what a one-repeat row rests on


def test_log_keeps_its_newest_lines_in_view(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "lab", steps=10, every=5)
    assert lab.run() and lab.wait(120)
    assert "flex-direction:column-reverse" in lab.log.value  # scrolled to the end as it grows
    assert lab.log_lines[-1].rstrip() in lab.log.value
    assert lab.log_lines.maxlen == LOG_LINES


def test_the_live_figure_drops_the_listeners_of_removed_views(tmp_path: Path) -> None:
    """Its JavaScript is plotly's, run with the view's own model while a view renders (the
    browser test checks that a re-run cell leaves no "gd.data must be an array" errors).
    Plotly's module travels as a synced trait, not in the widget's module, which awaits nothing
    before a view: anywidget drops the updates of a model whose module loads for over 2 s
    (test_browser.py::test_a_replaced_lab_draws_its_timeline)."""
    import plotly.graph_objects as go

    lab = make_lab(tmp_path / "lab")
    assert isinstance(lab.figure, go.FigureWidget)
    esm = lab.figure._esm
    assert "rendering = context.model" in esm and "(rendering ?? model).on" in esm
    assert len(esm) < 10_000 and "await plotlyModule(" in esm
    assert not [line for line in esm.splitlines() if "await" in line and not line.startswith(" ")]
    assert lab.figure.get_state()["_plotly_esm"] == str(go.FigureWidget._esm)


def test_failures_the_lab_cannot_show_go_to_the_nbckpt_logger(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def posted(*items: tuple[str, Any]) -> queue.Queue[tuple[str, Any]]:
        source: queue.Queue[tuple[str, Any]] = queue.Queue()
        for item in (*items, ("finished", None)):
            source.put(item)
        return source

    lab = make_lab(tmp_path / "lab")
    with caplog.at_level(logging.WARNING, logger="nbckpt"):
        # a widget that refuses the update: the progress bar takes no text for its length
        lab._update_loop(posted(("steps", "many"), ("log", "a line")))
        lab.close()  # a closed lab shows nothing: its run's failure is logged
        lab._update_loop(posted(("error", OSError(28, "No space left on device"))))
    assert "the lab could not show an update: TraitError: " in caplog.text
    assert "the closed lab's run failed: Storage error: No space left on device" in caplog.text


INTERRUPTED_LAB = """\
from nbckpt.notebook import Lab
lab = Lab(directory={directory!r}, preset="synthetic", size_mb=2.0, strategies=["nbckpt-async"],
          steps=100_000, every=5, repeats=1, refresh_s=0.05)
"""
# Runs until the lab has trained `past` steps (beyond its first save), or stops, or 120 s pass.
_UNTIL_PAST = (
    "import time\ndeadline = time.monotonic() + 120\n"
    "while lab.running and lab.progress.value < {past} and time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
    "assert lab.running, lab.error"
)
_STATE = (
    "print(lab.running, lab.stopped, lab.interrupted, lab.error)\n"
    "print(lab.message.value)\n"
    "print(lab.run_button.disabled, lab.stop_button.disabled)\n"
    "print(int(lab.comparison.timeline['kind'].eq('step').sum()))"
)


EXITS_AS_A_LAB_RUNS = """\
import atexit
seen = []
atexit.register(lambda: print("at the teardown, running:", seen[0].running))
from nbckpt.notebook import Lab
lab = Lab(directory={directory!r}, preset="synthetic", size_mb=2.0, strategies=["nbckpt-async"],
          steps=100_000, every=5, repeats=1, refresh_s=0.05)
seen.append(lab)
assert lab.run()
"""  # and the kernel shuts down (its script ends) as the lab runs


def test_a_kernel_exiting_as_a_lab_runs_stops_the_run_before_the_teardown(tmp_path: Path) -> None:
    """A kernel shut down or restarted as a lab runs: the run stops after the current step (its
    saves in flight commit), and the exit waits for its threads. Before, the lab still ran as the
    interpreter's teardown began, and its training step or save under it aborted the process in
    3 runs of 5 (``terminate called without an active exception``, SIGABRT, a core dump)."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS_AS_A_LAB_RUNS.format(directory=str(tmp_path / "lab"))],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # a core dump, if any, never lands in the worktree
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "at the teardown, running: False" in done.stdout, done.stdout


def _stopped_state(kernel: RealKernel) -> list[str]:
    """The lab's state once its run has ended (60 s at most after the interrupt)."""
    kernel.run(
        "deadline = time.monotonic() + 60\n"
        "while lab.running and time.monotonic() < deadline:\n    time.sleep(0.01)"
    )
    return kernel.run(_STATE).splitlines()


def test_kernel_interrupt_stops_a_lab_run_as_stop_does_in_a_real_kernel(tmp_path: Path) -> None:
    """Kernel > Interrupt (SIGINT to the kernel) while a lab runs behind an idle kernel, and
    while a cell waits for it: the run stops after the current step, as Stop would, with a line
    saying it was interrupted, and the lab runs again."""
    kernel = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        kernel.run(INTERRUPTED_LAB.format(directory=str(tmp_path / "lab")))
        # Run clicked in the page: a comm message, as JupyterLab sends it; then the kernel is idle
        button = kernel.evaluate("lab.run_button.model_id").strip("'")
        click = kernel.kc.session.msg(
            "comm_msg", {"comm_id": button, "data": {"method": "custom", "content": {"event": "click"}}}
        )
        kernel.kc.shell_channel.send(click)
        kernel.run(
            "import time\ndeadline = time.monotonic() + 60\n"
            "while not lab.running and time.monotonic() < deadline:\n    time.sleep(0.01)"
        )
        kernel.run(_UNTIL_PAST.format(past=12))
        kernel.km.interrupt_kernel()
        running, message, buttons, steps = _stopped_state(kernel)
        assert running == "False True True None", message  # stopped, interrupted, no error
        assert "nbckpt-info" in message and "Interrupted (Kernel &gt; Interrupt) after" in message
        assert "every checkpoint written so far is committed" in message
        assert buttons == "False True"  # Run enabled again, Stop disabled
        assert 12 <= int(steps) < 100_000
        log = kernel.run("print(''.join(lab.log_lines))")
        assert "interrupted (Kernel > Interrupt): finishing the current step" in log
        # a cell that waits for the run: the interrupt ends the cell and stops the run
        msg_id = kernel.send("lab.run()\n" + _UNTIL_PAST.format(past=12) + "\nprint('past')\nlab.wait()")
        kernel.output(msg_id, until=lambda out: "past" in out)
        kernel.km.interrupt_kernel()
        reply = kernel.reply(msg_id, timeout=60)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        running, message, buttons, steps = _stopped_state(kernel)
        assert running == "False True True None" and "Interrupted" in message
        assert buttons == "False True" and 12 <= int(steps) < 100_000
        # and the lab still runs to the end
        done = kernel.run("lab.steps.value = 10\nlab.run()\nlab.wait()\n" + _STATE).splitlines()
        assert done[0] == "False False False None" and "Done: 20 training steps" in done[1], done
    finally:
        kernel.close()
