"""The Lab widget's logic without a browser: simulated clicks, live updates, stop, errors."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nbckpt import ConfigError
from nbckpt.widgets import SYNTHETIC, Lab, devices


def make_lab(path: Path, **options: Any) -> Lab:
    settings: dict[str, Any] = {
        "directory": str(path), "preset": SYNTHETIC, "size_mb": 2.0,
        "strategies": ("none", "nbckpt-async"), "steps": 30, "every": 10, "refresh_s": 0.05,
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
    assert any("[nbckpt-async]" in out["text"] for out in lab.log.outputs)
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


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, "steps must be a positive integer, not 0"),
        ({"steps": -3}, "steps must be a positive integer, not -3"),
        ({"every": 0}, "checkpoint interval must be between 1 and steps (30), not 0"),
        ({"every": 31}, "checkpoint interval must be between 1 and steps (30), not 31"),
        ({"strategies": ()}, "select at least one strategy"),
        ({"path": " "}, "the target path is empty"),
        ({"path": "{file}/sub"}, "is a file, not a directory"),
    ],
)
def test_bad_fields_get_a_one_line_message(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
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
    assert not any("Traceback" in out["text"] for out in lab.log.outputs)


@pytest.mark.skipif(sys.platform != "linux", reason="uses /proc as an unwritable target")
def test_unwritable_target_is_a_clear_message(tmp_path: Path) -> None:
    lab = make_lab(Path("/proc/nbckpt-lab-test"))
    assert lab.run() and lab.wait(60)
    assert lab.error is not None and "/proc/nbckpt-lab-test" in lab.error
    assert "nbckpt-error" in lab.message.value
    assert lab.run_button.disabled is False  # ready for another try


def test_probe_button_shows_the_probe_summary(tmp_path: Path) -> None:
    lab = make_lab(tmp_path / "target")
    lab.probe_button.click()
    assert lab.wait(120)
    assert "nbckpt-ok" in lab.probe_summary.value
    assert "Storage probe of" in lab.probe_summary.value and "write GB/s" in lab.probe_summary.value
    lab.path.value = str(tmp_path / "file.txt")
    (tmp_path / "file.txt").write_text("x")
    assert not lab.probe()
    assert "nbckpt-error" in lab.probe_summary.value


def test_from_args_and_display(tmp_path: Path) -> None:
    args = argparse.Namespace(dir=str(tmp_path), preset=None, size_mb=8.0,
                              strategies="torch-save, nbckpt-async", steps=12, every=4,
                              device="cpu")
    lab = Lab.from_args(args)
    assert lab.preset.value == SYNTHETIC and lab.size_mb.value == 8.0
    assert lab.strategies.value == ("torch-save", "nbckpt-async")
    assert (lab.steps.value, lab.every.value, lab.path.value) == (12, 4, str(tmp_path))
    bundle = lab._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "cpu" in devices() and lab.device.options == tuple(devices())
    lab.preset.value = "tiny"
    assert lab.size_mb.disabled


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
