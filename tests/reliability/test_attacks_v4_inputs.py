"""Reliability v4 (issue 34), the minor items: bad inputs refused in one line at the call (v4.8),
no traceback at interpreter exit (v4.8), a report that says early when it cannot measure (v4.9)."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.hostile import assert_falls_back, blank, rewrite_manifest, rewrite_metadata, two_steps
from helpers.states import state_of
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from nbckpt import AnyOf, Checkpointer, ConfigError, CustomSteps, LatestN
from nbckpt.notebook import Autosave

# -- v4.8: twelve (and more) bad inputs, each refused at the call -------------------------------

Call = Callable[[Checkpointer, Path], object]


def _restore(**options: Any) -> Call:
    return lambda ckpt, _: ckpt.restore(state_of(0), **options)


def _save(**options: Any) -> Call:
    return lambda ckpt, _: ckpt.save(state_of(2), 2, **options)


def _handle_wait(timeout: Any, staged: bool = False) -> Call:
    def call(ckpt: Checkpointer, _: Path) -> object:
        handle = ckpt.save(state_of(2), 2)
        try:
            return (handle.wait_staged if staged else handle.wait)(timeout)
        finally:
            handle.wait()  # the refused wait left the save itself alone: it commits

    return call


def _open(**options: Any) -> Call:
    return lambda _, tmp: Checkpointer(tmp / "other", **options)


BAD_CALLS: list[tuple[str, Call, str]] = [
    ("restore(verify='no')", _restore(verify="no"), "verify must be True or False, not 'no'"),
    ("restore(rng='no')", _restore(rng="no"), "rng must be True or False, not 'no'"),
    ("restore(strict=1)", _restore(strict=1), "strict must be True or False, not 1"),
    ("restore(key_map=3)", _restore(key_map=3), "key_map must be a function of a key, or None, not 3"),
    ("save(overlap='no')", _save(overlap="no"), "overlap must be True or False, not 'no'"),
    ("save(overwrite='yes')", _save(overwrite="yes"), "overwrite must be True or False, not 'yes'"),
    ("handle.wait('5')", _handle_wait("5"), "timeout must be a number of seconds >= 0 or None, not '5'"),
    ("handle.wait(-1)", _handle_wait(-1), "timeout must be a number of seconds >= 0 or None, not -1"),
    ("handle.wait_staged(True)", _handle_wait(True, staged=True), "timeout must be a number of seconds"),
    (
        "final_save(reason=3)",
        lambda ckpt, _: ckpt.final_save(lambda: None, reason=3),  # type: ignore[arg-type]
        "reason must be text (it is logged), not 3",
    ),
    (
        "keep=CustomSteps(5)",
        lambda _, tmp: Checkpointer(tmp / "other", keep=CustomSteps(5)),  # type: ignore[arg-type]
        "CustomSteps wants step numbers or a function returning them, not 5",
    ),
    ("CustomSteps('12')", lambda *_: CustomSteps("12"), "CustomSteps wants step numbers"),
    ("CustomSteps([-1])", lambda *_: CustomSteps([-1]), "CustomSteps' steps must be an integer >= 0, not -1"),
    ("CustomSteps([True])", lambda *_: CustomSteps([True]), "CustomSteps' steps must be an integer >= 0"),
    ("AnyOf()", lambda *_: AnyOf(), "AnyOf needs at least one policy"),
    ("timeout_s=inf", _open(timeout_s=math.inf), "timeout_s must be a positive number of seconds, not inf"),
    ("storage_options={1: 2}", _open(storage_options={1: 2}), "storage_options must have option names"),
    (
        "mirror_options without mirror",
        _open(mirror_options={"anon": True}),
        "mirror_options are given but no mirror",
    ),
    (
        "Autosave(signals=('SIGNOPE',))",
        lambda *_: Autosave(["model"], signals=("SIGNOPE",)),  # type: ignore[arg-type]
        "signals: 'SIGNOPE' is not a signal",
    ),
    (
        "Autosave(directory=3)",
        lambda *_: Autosave(["model"], directory=3),  # type: ignore[arg-type]
        "directory must be a path, not int",
    ),
    (
        "Autosave(clock=5)",
        lambda *_: Autosave(["model"], clock=5),  # type: ignore[arg-type]
        "clock must be a function giving seconds, not 5",
    ),
]


@pytest.mark.parametrize(("call", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_v4_8_each_bad_input_is_one_config_error_at_the_call(
    tmp_path: Path, call: Call, message: str
) -> None:
    """Each was accepted before: a string taken as true, a policy failing at every save in the
    background (only logged), an AnyOf keeping nothing, a timeout that waited on or not at all."""
    run = tmp_path / "run"
    with Checkpointer(run, mode="async", keep=LatestN(5)) as ckpt:
        ckpt.save(state_of(1), 1).wait()
        before = sorted(os.listdir(run))
        with pytest.raises(ConfigError) as raised:
            call(ckpt, tmp_path)
        assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
        assert not (tmp_path / "other").exists()  # nothing created
        assert ckpt.steps() in ([1], [1, 2])  # [1, 2] only where a good save came before the bad wait
        assert sorted(os.listdir(run)) in (before, sorted([*before, "step-000002"]))


def test_v4_8_custom_steps_from_a_generator_keep_them_at_every_pass(tmp_path: Path) -> None:
    """A generator gave its steps to the first retention pass only; every later one kept none."""
    with Checkpointer(tmp_path / "run", mode="sync", keep=CustomSteps(s for s in (1, 2))) as ckpt:
        for step in range(1, 5):
            ckpt.save(state_of(step), step)
        ckpt.wait()
        assert ckpt.steps() == [1, 2, 4]


# -- v4.8: nothing printed at interpreter exit ---------------------------------------------------

SIGNAL_HANDLER_LEFT_AT_EXIT = """
import sys, torch
from nbckpt import Checkpointer
ckpt = Checkpointer(sys.argv[1], mode=sys.argv[2])
ckpt.save({"w": torch.arange(1 << 16, dtype=torch.float32), "step": 1}, step=1).wait()
ckpt.restore({"w": torch.zeros(1 << 16), "step": 0}, verify=True)
ckpt.save_on_signal(lambda: None)  # left installed, the Checkpointer left open: the exit tidies
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_v4_8_a_script_exits_without_a_weakmethod_traceback(tmp_path: Path, mode: str) -> None:
    """The signal handler held the Checkpointer's method by a WeakMethod, whose callback ran in
    the interpreter's teardown after the WeakMethod was gone: ``Exception ignored in: <function
    WeakMethod.__new__.<locals>._cb ...> AttributeError: 'NoneType' object has no attribute
    '_alive'`` at the end of every such script."""
    child = subprocess.run(
        [sys.executable, "-c", SIGNAL_HANDLER_LEFT_AT_EXIT, str(tmp_path / "run"), mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    assert "Exception ignored" not in child.stderr and "Traceback" not in child.stderr, child.stderr
    with Checkpointer(tmp_path / "run", read_only=True) as ckpt:
        assert ckpt.steps() == [1]


def test_v4_8_the_exit_and_signal_hooks_hold_the_checkpointer_weakly(tmp_path: Path) -> None:
    """Without WeakMethod the hooks (atexit's, the signal handler left installed) still let a
    dropped Checkpointer go: a notebook's cell run again must not keep the old one alive."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ckpt = Checkpointer(tmp_path / "run", mode="sync")
        ckpt.save_on_signal(lambda: None)
        dropped = weakref.ref(ckpt)
        del ckpt
        gc.collect()
        assert dropped() is None
    finally:
        signal.signal(signal.SIGTERM, previous)
    with Checkpointer(tmp_path / "run", mode="sync") as again:  # its lock went with it
        again.save(state_of(1), 1)


# -- v4.9: the report says before it measures when it cannot mean much, and shortens ------------

SMALL_REPORT = ["-p", "preset", "small", "-p", "steps", "12", "-p", "every", "4", "-p", "repeats", "3"]

#: A report notebook of one parameters cell and one cell that writes what it was given.
RECORDING_NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "metadata": {"tags": ["parameters"]},
            "execution_count": None,
            "outputs": [],
            "source": 'preset = "small"\nstrategies = "none,nbckpt-async"\nsize_mb = None\nsteps = 12\n'
            'every = 4\nrepeats = 3\noutput_dir = "."\nprogress_path = ""\n',
        },
        {
            "cell_type": "code",
            "metadata": {},
            "execution_count": None,
            "outputs": [],
            "source": 'import json, os\nwith open(os.path.join(output_dir, "given.json"), "w") as f:\n'
            '    json.dump({"steps": steps, "repeats": repeats}, f)\n',
        },
    ],
    "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    "nbformat": 4,
    "nbformat_minor": 5,
}


def _report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], load_1m: float, *args: str
) -> list[str]:
    """``nbckpt report ARGS`` with the machine's load fed in: the lines it said on stderr."""
    from nbckpt import cli

    # the machine itself is the seam: its load average and the cores this process may use
    monkeypatch.setattr(os, "getloadavg", lambda: (load_1m, load_1m, load_1m))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert cli.main(["report", *args]) == 0
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("report: ")]


@pytest.mark.parametrize(
    ("load_1m", "args", "said"),
    [
        # the machine: load 6-15 on 2 cores; make report's own parameters
        (
            9.0,
            SMALL_REPORT,
            [
                "about 25 min (3 repeats of 12 steps); 1-minute load 9.0 on 2 cores",
                "intervals will be too wide to mean much",
                "shortened to 2 repeats of 8 steps (about 11.1 min; the machine is busy); "
                "--full runs as asked, Ctrl-C stops",
            ],
        ),
        (9.0, [*SMALL_REPORT, "--full"], ["about 25 min", "intervals will be too wide"]),
        (
            0.2,
            [*SMALL_REPORT[:3], "-p", "steps", "40", *SMALL_REPORT[6:]],
            [
                "about 16.7 min (3 repeats of 40 steps); 1-minute load 0.2 on 2 cores",
                "shortened to 2 repeats of 36 steps (about 10 min; over the 10 min budget)",
            ],
        ),
        # never under two repeats of two checkpoints, even where that is still over the budget
        (0.2, [*SMALL_REPORT, "--max-minutes", "2"], ["about 5 min", "shortened to 2 repeats of 8 steps"]),
        (0.2, SMALL_REPORT, ["about 5 min (3 repeats of 12 steps); 1-minute load 0.2 on 2 cores"]),
    ],
    ids=["busy", "busy-full", "over-budget", "max-minutes", "quiet"],
)
def test_v4_9_the_report_says_first_what_it_will_take_and_shortens_what_cannot_mean_much(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    load_1m: float,
    args: list[str],
    said: list[str],
) -> None:
    """Before this it measured for 16.9 minutes and warned at the end (``--dry-run`` stops here)."""
    lines = _report(monkeypatch, capsys, load_1m, "--dry-run", "--output-dir", str(tmp_path / "out"), *args)
    assert len(lines) == len(said), lines
    for line, part in zip(lines, said, strict=True):
        assert part in line, (part, line)
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_v4_9_the_shortened_run_is_what_the_notebook_gets(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    notebook = tmp_path / "recording.ipynb"
    notebook.write_text(json.dumps(RECORDING_NOTEBOOK))
    out = tmp_path / "out"
    lines = _report(monkeypatch, capsys, 9.0, "--notebook", str(notebook), "--output-dir", str(out))
    assert any("shortened to 2 repeats of 8 steps" in line for line in lines), lines
    assert json.loads((out / "given.json").read_text()) == {"steps": 8, "repeats": 2}


# -- v4.8: a shape the manifest and .metadata both lie about is damage, not the caller's fault ---


@pytest.mark.parametrize("shape", [[2048, 2], [2048]])
def test_v4_8_a_shape_both_files_lie_about_falls_back(tmp_path: Path, shape: list[int]) -> None:
    """Step 2's 'w' (4096 floats) edited to another shape in the manifest and in .metadata alike,
    both re-signed: restore() blamed the caller's template (ConfigError, no fallback), though the
    blob itself still holds the saved shape."""
    run = two_steps(tmp_path / "run")

    def metadata_lies(metadata: Any) -> None:
        w = metadata.state_dict_metadata["w"]
        w.size = torch.Size(shape)
        w.chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))]
        metadata.storage_data[MetadataIndex("w", (0,) * len(shape))] = metadata.storage_data.pop(
            MetadataIndex("w", (0,))
        )

    def manifest_lies(manifest: dict[str, Any]) -> None:
        next(n for k, n in manifest["tree"]["items"] if k == "w")["shape"] = shape
        chunk = manifest["items"]["w"][0]
        chunk[4], chunk[5] = [0] * len(shape), shape

    rewrite_metadata(run / "step-000002", metadata_lies)
    rewrite_manifest(run / "step-000002", manifest_lies)
    assert_falls_back(
        run,
        f"the blob of tensor 'w' holds torch.float32 (4096,), the manifest says torch.float32 {tuple(shape)}",
    )
    with Checkpointer(run, read_only=True) as ckpt, pytest.raises(ConfigError, match="the target is"):
        ckpt.restore({**blank(), "w": torch.zeros(4095)}, step=1)  # the caller's own mistake still is one
