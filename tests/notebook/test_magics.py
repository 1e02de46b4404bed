"""The %ckpt_* magics through IPython's test shell, a real kernel and papermill."""

from __future__ import annotations

import io
import logging
import os
import queue
import re
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nbformat
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch
from helpers.kernel import RealKernel
from helpers.storage import Throttle
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbckpt import CheckpointError, SaveHandle
from nbckpt.notebook._cell import CheckpointFailed, OneLineWarnings
from nbckpt.notebook._magic_args import BENCH_DIR
from nbckpt.notebook._magics import MAGICS, CheckpointMagics


def _eventually(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` (work done on a background thread) until it holds or time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def magics_of(shell: InteractiveShell) -> CheckpointMagics:
    instance = shell.magics_manager.registry["CheckpointMagics"]
    assert isinstance(instance, CheckpointMagics)
    return instance


def test_async_save_returns_the_handle_and_shows_its_status(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.run_cell(f"h = %ckpt_async model opt -d {tmp_path / 'run'} --step 7")
    handle = ip.user_ns["h"]
    assert isinstance(handle, SaveHandle)
    record = handle.wait()
    assert record.step == 7 and record.bytes > 0
    assert (tmp_path / "run" / "step-000007" / "manifest.json").is_file()
    out = capsys.readouterr().out
    assert "nbckpt async step 7" in out and "stall" in out
    ip.run_line_magic("ckpt_wait", "")
    assert "committed" in capsys.readouterr().out


def test_a_save_that_commits_while_its_status_is_shown_still_turns_committed(
    ip: InteractiveShell, tmp_path: Path, throttle: Throttle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under load the save can commit between rendering the status and watching for the commit;
    the line must not stay "writing in the background" (a display update nobody sends)."""
    from IPython.core.displaypub import DisplayPublisher

    shown: list[str] = []

    class CommitWhileShowing(DisplayPublisher):
        """The shell's publisher of what is displayed (the first showing, then its updates)."""

        def publish(self, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
            shown.append(data["text/plain"])
            if len(shown) == 1:  # the save commits before display() returns
                throttle.release.set()
                magics_of(ip).session.saves[-1].handle.wait()

    monkeypatch.setattr(ip, "display_pub", CommitWhileShowing(shell=ip))
    throttle.hold()
    ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'run'} --step 3")
    assert "writing in the background" in shown[0] and "committed" not in shown[0]
    assert "committed" in shown[-1], shown


def test_magic_in_a_loop_expands_the_step(ip: InteractiveShell, tmp_path: Path) -> None:
    target = tmp_path / "loop"
    result = ip.run_cell(
        "for step in range(5):\n"
        "    if step % 2 == 0:\n"
        f"        %ckpt_async model opt --step {{step}} -d {target}\n"
    )
    assert result.success
    ip.run_line_magic("ckpt_wait", "")
    assert sorted(p.name for p in target.glob("step-*")) == ["step-000000", "step-000002", "step-000004"]


def test_sync_save_has_committed_when_it_returns(ip: InteractiveShell, tmp_path: Path) -> None:
    handle = ip.run_line_magic("ckpt_sync", f"model -d {tmp_path / 's'} --step 1")
    assert handle.done() and handle.phase == "committed"
    # the directory's one Checkpointer is back in async mode afterwards
    later = ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 's'}")
    assert later.step == 2
    assert magics_of(ip).session.checkpointers[str(tmp_path / "s")].config.mode == "async"
    later.wait()


def test_default_directory_step_and_keep_reuse_one_checkpointer(ip: InteractiveShell, tmp_path: Path) -> None:
    first = ip.run_line_magic("ckpt_async", "model opt")  # NBCKPT_DIR, step 0
    first.wait()
    assert first.step == 0 and (tmp_path / "default" / "step-000000").is_dir()
    second = ip.run_line_magic("ckpt_async", "model opt --keep 1")
    second.wait()
    assert second.step == 1
    magics = magics_of(ip)
    assert len(magics.session.checkpointers) == 1
    ckpt = next(iter(magics.session.checkpointers.values()))
    assert ckpt.config.keep == 1
    third = ip.run_line_magic("ckpt_async", "model opt --keep 1")  # same options: same one
    third.wait()
    assert next(iter(magics.session.checkpointers.values())) is ckpt
    ip.run_line_magic("ckpt_wait", "")
    assert _eventually(
        lambda: [p.name for p in (tmp_path / "default").glob("step-*")] == ["step-000002"]
    )  # retention deletes on a thread of its own


def test_status_table_lists_this_sessions_saves(ip: InteractiveShell, tmp_path: Path) -> None:
    for step in (1, 2):
        ip.run_line_magic("ckpt_async", f"model opt -d {tmp_path / 'st'} --step {step}")
    ip.run_line_magic("ckpt_wait", "")
    table = ip.run_line_magic("ckpt_status", "")
    assert isinstance(table, pd.DataFrame)
    assert table["step"].tolist() == [1, 2]
    assert (table["phase"] == "committed").all()
    assert (table["variables"] == "model opt").all()
    assert (table["write_gbs"] > 0).all() and (table["stall_ms"] > 0).all()


def test_timeline_is_a_plotly_figure_of_the_session(ip: InteractiveShell, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no checkpoint events"):
        ip.run_line_magic("ckpt_timeline", "")
    ip.run_line_magic("ckpt_async", f"model opt -d {tmp_path / 'tl'}")
    ip.run_line_magic("ckpt_wait", "")
    fig = ip.run_line_magic("ckpt_timeline", "")
    assert isinstance(fig, go.Figure)
    kinds = {trace.name for trace in fig.data}
    assert {"stall", "stage", "persist", "commit"} <= kinds
    assert list(fig.layout.yaxis.categoryarray) == ["async model opt · train", "async model opt · background"]
    # a session has no strategy's run: its time 0 is its own start
    assert fig.layout.xaxis.title.text == "seconds since this session started (%load_ext nbckpt)"
    ip.run_line_magic("ckpt_sync", f"model -d {tmp_path / 'tl2'}")
    lanes = list(ip.run_line_magic("ckpt_timeline", "").layout.yaxis.categoryarray)
    assert lanes == [
        "tl: async model opt · train",
        "tl: async model opt · background",
        "tl2: sync model · train",
        "tl2: sync model · background",
    ]


def test_restore_loads_in_place_and_rebinds_plain_values(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "rs"
    model = ip.user_ns["model"]
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    ip.run_line_magic("ckpt_sync", f"model opt epoch -d {target} --step 5")
    with torch.no_grad():
        model.weight.zero_()
    ip.user_ns["epoch"] = 99
    ip.run_line_magic("ckpt_restore", f"model opt epoch -d {target}")
    assert "restored step 5" in capsys.readouterr().out
    assert ip.user_ns["model"] is model
    assert torch.equal(model.weight, saved["weight"])
    assert ip.user_ns["epoch"] == 3
    with pytest.raises(CheckpointError, match="step 6"):
        ip.run_line_magic("ckpt_restore", f"model -d {target} --step 6")


def test_a_failed_restore_is_one_line_without_a_traceback(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "rs1"
    ip.run_line_magic("ckpt_sync", f"model -d {target} --step 5")
    capsys.readouterr()
    result = ip.run_cell(f"%ckpt_restore model -d {target} --step 6")
    assert isinstance(result.error_in_exec, CheckpointFailed)
    assert isinstance(result.error_in_exec.__cause__, CheckpointError)
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert text.startswith("CheckpointFailed: no committed checkpoint for step 6")
    assert "\n" not in text and "Traceback" not in text
    ip.user_ns["net"] = torch.nn.Linear(3, 3)
    result = ip.run_cell(f"%ckpt_restore net -d {target}")  # a name the checkpoint lacks
    captured = capsys.readouterr()
    text = (captured.out + captured.err).strip()
    assert isinstance(result.error_in_exec, UsageError) and "'net'" in text
    assert "\n" not in text and "Traceback" not in text
    ip.user_ns.pop("net")


def test_warnings_point_at_the_users_cell(ip: InteractiveShell, tmp_path: Path) -> None:
    target = tmp_path / "again"
    ip.run_line_magic("ckpt_sync", f"model -d {target} --step 1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ip.run_cell(f"%ckpt_sync model -d {target} --step 1").success
    replaced = [w for w in caught if "already exists" in str(w.message)]
    assert len(replaced) == 1, [str(w.message) for w in caught]
    assert "nbckpt" not in replaced[0].filename and "IPython" not in replaced[0].filename
    assert "ipython-input" in replaced[0].filename  # the cell, as IPython names it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ip.run_line_magic("ckpt_sync", f"model -d {target} --step 1")  # called from Python
    replaced = [w for w in caught if "already exists" in str(w.message)]
    assert [w.filename for w in replaced] == [__file__]


def test_config_shows_and_sets_session_defaults(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.run_line_magic("ckpt_config", "")
    assert str(tmp_path / "default") in capsys.readouterr().out  # from NBCKPT_DIR
    ip.run_line_magic("ckpt_async", "model").wait()
    magics = magics_of(ip)
    opened = magics.session.checkpointers[str(tmp_path / "default")]
    capsys.readouterr()
    ip.run_line_magic("ckpt_config", f"-d {tmp_path / 'other'} --keep 2 --no-verify")
    out = capsys.readouterr().out
    assert magics.session.defaults.dir == str(tmp_path / "other") and magics.session.defaults.keep == 2
    # the directory it replaced as the default is closed: its staging memory is given back
    assert "reopened" not in out and opened.closed and opened.host_bytes == 0
    assert str(tmp_path / "default") not in magics.session.checkpointers
    assert opened.config.keep is None and opened.config.verify is True  # a frozen config
    ip.run_line_magic("ckpt_async", "model").wait()
    assert (tmp_path / "other" / "step-000000").is_dir()
    ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'default'}").wait()
    reopened = magics.session.checkpointers[str(tmp_path / "default")]
    assert reopened is not opened and (reopened.config.keep, reopened.config.verify) == (2, False)
    ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'other'} --keep 1").wait()
    ip.run_line_magic("ckpt_config", "--writer-threads 3")  # leaves every keep alone
    assert magics.session.checkpointers[str(tmp_path / "default")].config.writer_threads == 3
    assert magics.session.checkpointers[str(tmp_path / "default")].config.keep == 2
    assert magics.session.checkpointers[str(tmp_path / "other")].config.keep == 1
    ip.run_line_magic("ckpt_config", "--keep none")
    assert magics.session.defaults.keep is None
    assert all(c.config.keep is None for c in magics.session.checkpointers.values())
    ip.run_line_magic("ckpt_config", "--reset")
    assert magics.session.defaults.dir == str(tmp_path / "default") and magics.session.defaults.verify


def test_an_option_changed_with_saves_in_flight_applies_once_they_commit(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.user_ns["big"] = torch.zeros(1 << 23)  # 32 MiB: still persisting when the next line runs
    target = tmp_path / "inflight"
    handle = ip.run_line_magic("ckpt_async", f"big -d {target} --step 1")
    magics = magics_of(ip)
    opened = magics.session.checkpointers[str(target)]
    capsys.readouterr()
    ip.run_line_magic("ckpt_config", "--keep 1")
    out = capsys.readouterr().out
    if not handle.done():  # the usual case; a fast disk may have committed it already
        assert "applies once its 1 save(s) in flight have committed" in out
        assert magics.session.checkpointers[str(target)] is opened  # the cell did not wait
    ip.run_line_magic("ckpt_async", f"big -d {target}")
    ip.run_line_magic("ckpt_wait", "")
    assert handle.done() and handle.error is None  # committed under the old options
    assert magics.session.checkpointers[str(target)].config.keep == 1
    assert opened.config.keep is None
    assert _eventually(lambda: sorted(p.name for p in target.glob("step-*")) == ["step-000002"])
    ip.user_ns.pop("big")


def test_new_run_saves_into_a_fresh_run_directory(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.run_line_magic("ckpt_sync", "model --step 3")
    ip.run_line_magic("ckpt_config", "--new-run")
    run = magics_of(ip).session.defaults.run
    assert run is not None and Path(run).parent == tmp_path / "default"
    assert Path(run).name.startswith("run-") and not list(Path(run).iterdir())
    handle = ip.run_line_magic("ckpt_sync", "model")
    assert handle.step == 0 and (Path(run) / "step-000000").is_dir()  # step 3 is elsewhere
    ip.run_line_magic("ckpt_config", f"-d {tmp_path / 'x'}")
    assert magics_of(ip).session.defaults.run is None


def test_a_refused_new_run_changes_no_option(ip: InteractiveShell, tmp_path: Path) -> None:
    """%ckpt_config sets the options it is given only once all of them are usable: a --new-run
    that cannot make its directory leaves --keep (given in the same line) as it was."""
    blocked = tmp_path / "blocked"
    ip.run_line_magic("ckpt_config", f"-d {blocked}")
    blocked.write_text("a file where the runs' directory would be")
    with pytest.raises(UsageError, match="blocked"):
        ip.run_line_magic("ckpt_config", "--keep 3 --new-run")
    defaults = magics_of(ip).session.defaults
    assert (defaults.keep, defaults.run, defaults.dir) == (None, None, str(blocked))


def test_wait_counts_this_sessions_saves(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (1, 2, 3):
        ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'w'} --step {step}")
    ip.run_line_magic("ckpt_sync", f"model -d {tmp_path / 'w2'}")
    capsys.readouterr()
    ip.run_line_magic("ckpt_wait", "")
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out.startswith("nbckpt: 4 of this session's 4 save(s) committed (")
    assert out.endswith("waited for); nothing in flight")
    ip.run_line_magic("ckpt_wait", "")
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "nbckpt: 4 of this session's 4 save(s) committed (0 waited for); nothing in flight"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("model --bogus", "unrecognized arguments: --bogus"),
        ("", "the following arguments are required: NAME"),
        ("nothere", "no variable named 'nothere'"),
        ("model nothere", "no variable named 'nothere'"),
        ("train", "train holds a function"),
        ("model --step x", "argument --step: must be a non-negative integer, not 'x'"),
        ("model --step -1", "argument --step: must be a non-negative integer, not '-1'"),
        ("model --keep 0", "argument --keep: must be a positive integer or 'none', not '0'"),
        ("model -d {file}", "cannot checkpoint to"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(
    ip: InteractiveShell, tmp_path: Path, line: str, message: str
) -> None:
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a directory")
    for magic in ("ckpt_async", "ckpt_sync"):
        with pytest.raises(UsageError) as caught:
            ip.run_line_magic(magic, line.format(file=a_file))
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)
    assert not list(tmp_path.glob("**/step-*"))


def test_usage_errors_print_no_traceback(ip: InteractiveShell, capsys: pytest.CaptureFixture[str]) -> None:
    result = ip.run_cell("%ckpt_async nothere")
    assert isinstance(result.error_in_exec, UsageError)
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "UsageError: no variable named 'nothere'" in text and "Traceback" not in text


@pytest.mark.parametrize(
    ("magic", "line"),
    [
        ("ckpt_restore", "model -d {missing}"),
        ("ckpt_restore", "model --step x"),
        ("ckpt_config", "--keep -3"),
        ("ckpt_config", "--writer-threads 0"),
        ("ckpt_wait", "extra"),
        ("ckpt_status", "--bogus"),
        ("ckpt_bench", "--steps x"),
        ("ckpt_bench", "--static --strategies nope --steps 2 --every 1"),
    ],
)
def test_other_magics_reject_bad_input(ip: InteractiveShell, tmp_path: Path, magic: str, line: str) -> None:
    with pytest.raises(UsageError):
        ip.run_line_magic(magic, line.format(missing=tmp_path / "missing"))


@pytest.mark.parametrize("name", MAGICS)
def test_every_magic_answers_help(
    ip: InteractiveShell, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for flag in ("--help", "-h"):
        # even with what would be an error otherwise (no NAME given, an unknown option)
        assert ip.run_line_magic(name, f"{flag} --bogus") is None
        out = capsys.readouterr().out
        assert out.startswith(f"usage: %{name} [-h]"), out
        assert "::" not in out and "``" not in out  # plain text, no reST
    doc = ip.find_line_magic(name).__doc__
    assert doc is not None and doc.strip() == out.strip()  # %ckpt_x? shows the same help
    assert not list(tmp_path.glob("**/step-*")) and not magics_of(ip).session.saves


def test_help_texts_name_the_defaults(ip: InteractiveShell) -> None:
    helps = {name: ip.find_line_magic(name).__doc__ or "" for name in MAGICS}
    assert "--step STEP" in helps["ckpt_async"] and "in the background" in helps["ckpt_async"]
    assert "(default: one past the newest step" in helps["ckpt_sync"]
    assert "(default: 1)" in helps["ckpt_config"] and "(default: 2)" in helps["ckpt_config"]
    assert "--strategies" in helps["ckpt_bench"] and "(default: 3)" in helps["ckpt_bench"]
    # -d as on the other magics; by default a temp folder, never beside the notebooks
    assert "-d DIR, --dir DIR" in helps["ckpt_bench"]
    assert f"(default: {BENCH_DIR})" in " ".join(helps["ckpt_bench"].split())
    assert BENCH_DIR.startswith(tempfile.gettempdir() + os.sep)


def test_handle_displayed_later_shows_a_status(
    ip: InteractiveShell, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ip.run_cell(f"h = %ckpt_sync model -d {tmp_path / 'd'}", store_history=True)
    capsys.readouterr()
    ip.run_cell("h", store_history=True)
    assert "nbckpt sync step 0" in capsys.readouterr().out


def test_load_twice_is_harmless_and_unload_releases_directories(ip: InteractiveShell, tmp_path: Path) -> None:
    first = magics_of(ip)
    ip.run_line_magic("load_ext", "nbckpt")  # already loaded: nothing new
    from nbckpt import load_ipython_extension

    load_ipython_extension(ip)
    assert magics_of(ip) is first
    handle = ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'r'}")
    ip.run_line_magic("reload_ext", "nbckpt")  # unload waits for the save and unlocks
    assert handle.done() and handle.error is None
    second = magics_of(ip)
    assert second is not first and not first.session.checkpointers
    again = ip.run_line_magic("ckpt_async", f"model -d {tmp_path / 'r'}")  # lock was released
    assert again.wait().step == 1
    assert isinstance(warnings.showwarning, OneLineWarnings)  # nbckpt's warnings: one line each
    assert not isinstance(warnings.showwarning.previous, OneLineWarnings)  # reload: not twice
    ip.run_line_magic("unload_ext", "nbckpt")
    assert ip.find_line_magic("ckpt_async") is None
    assert not isinstance(warnings.showwarning, OneLineWarnings)
    ip.run_line_magic("load_ext", "nbckpt")


def test_nbckpt_warnings_show_as_one_line_others_as_before() -> None:
    shown: list[tuple[Any, ...]] = []
    show = OneLineWarnings(lambda *args: shown.append(args))
    stream = io.StringIO()
    show(UserWarning("nbckpt: step 1 already exists\nand is replaced"), UserWarning, "/x/cell.py", 1, stream)
    assert stream.getvalue() == "UserWarning: nbckpt: step 1 already exists; and is replaced\n"
    show(UserWarning("torch: something"), UserWarning, "/x/cell.py", 1, stream, None)
    assert shown == [(shown[0][0], UserWarning, "/x/cell.py", 1, stream, None)]


def test_load_ext_shows_the_loggers_warnings_until_unload(
    ip: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("nbckpt")
    worker = threading.Thread(target=logger.warning, args=("nbckpt: a failure in the background",))
    worker.start()
    worker.join()
    logger.info("nbckpt: progress")  # below WARNING: not shown
    err = capsys.readouterr().err
    assert "nbckpt: a failure in the background\n" in err and "progress" not in err
    ip.run_line_magic("unload_ext", "nbckpt")
    logger.warning("nbckpt: after unload")
    assert "after unload" not in capsys.readouterr().err
    ip.run_line_magic("load_ext", "nbckpt")  # for the fixture, which unloads it


def test_bench_in_batch_runs_and_returns_the_comparison(ip: InteractiveShell, tmp_path: Path) -> None:
    comparison = ip.run_line_magic(
        "ckpt_bench",
        f"-d {tmp_path / 'b'} --size-mb 2 --compute-ms 1 --strategies none,nbckpt-async "
        "--steps 4 --every 2 --no-warmup --quiet",
    )
    assert comparison.results["strategy"].tolist() == ["none", "nbckpt-async"]
    assert int(comparison.results.loc[1, "checkpoints"]) == 2
    shown = ip.display_formatter.format(comparison)[0]["text/plain"]
    assert shown == comparison.table()  # a Comparison as a cell's value is its table


def test_bench_in_jupyterlab_shows_the_live_lab_and_starts_it(
    ip: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NBCKPT_BATCH", raising=False)
    # JupyterLab marks its execute requests with recordTiming; the test shell has no kernel
    monkeypatch.setattr(ip, "kernel", _Kernel({"recordTiming": False}), raising=False)
    result = ip.run_line_magic(
        "ckpt_bench",
        f"--dir {tmp_path / 'b'} --size-mb 1 --strategies nbckpt-async --steps 2 --every 1 --repeats 1",
    )
    assert result is None
    lab = magics_of(ip).lab
    assert lab is not None
    assert lab.wait(120) and lab.error is None and lab.comparison is not None
    assert lab.comparison.results["strategy"].tolist() == ["none", "nbckpt-async"]


class _Kernel:
    def __init__(self, metadata: dict[str, Any]) -> None:
        self.metadata = metadata

    def get_parent(self) -> dict[str, Any]:
        return {"metadata": self.metadata}


class _Shell:
    def __init__(self, kernel: _Kernel | None) -> None:
        self.kernel = kernel


def test_batch_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    from nbckpt.notebook._magics import _batch_run

    monkeypatch.delenv("NBCKPT_BATCH", raising=False)
    lab_request = {"cellId": "x", "deletedCells": [], "recordTiming": False}
    assert not _batch_run(_Shell(_Kernel(lab_request)))  # JupyterLab / Notebook 7
    assert _batch_run(_Shell(_Kernel({"cellId": "x"})))  # nbclient: papermill, nbconvert
    assert _batch_run(_Shell(None))  # terminal IPython
    monkeypatch.setenv("NBCKPT_BATCH", "1")
    assert _batch_run(_Shell(_Kernel(lab_request)))


def _notebook(path: Path, cells: list[str]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


def test_papermill_run_shows_static_bench_and_fails_when_a_magic_fails(tmp_path: Path) -> None:
    import papermill
    from papermill.exceptions import PapermillExecutionError

    source = tmp_path / "bad.ipynb"
    bench = (
        f"%ckpt_bench --dir {tmp_path / 'b'} --size-mb 1 --compute-ms 1 "
        "--strategies none,nbckpt-async --steps 2 --every 1 --no-warmup"
    )
    _notebook(source, ["%load_ext nbckpt", bench, f"%ckpt_async nothere -d {tmp_path / 'c'}"])
    output = tmp_path / "out.ipynb"
    with pytest.raises(PapermillExecutionError):
        papermill.execute_notebook(
            str(source), str(output), kernel_name="python3", progress_bar=False, cwd=str(tmp_path)
        )
    cells = [cell for cell in nbformat.read(output, as_version=4).cells if cell.cell_type == "code"]
    # a batch run gets the comparison in the foreground with static figures, not a live lab
    kinds = {key for out in cells[1].outputs for key in out.get("data", {})}
    assert "application/vnd.plotly.v1+json" in kinds
    assert "application/vnd.jupyter.widget-view+json" not in kinds
    assert any("[nbckpt-async]" in out.get("text", "") for out in cells[1].outputs)
    text = "".join(out.get("text", "") for out in cells[2].outputs)
    assert "UsageError: no variable named 'nothere'" in text and "Traceback" not in text


def test_status_updates_from_the_background_in_a_real_kernel(tmp_path: Path) -> None:
    """The display update sent by the commit callback (on the persist thread) reaches iopub."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(
        kernel_name="python3", cwd=str(tmp_path), env={**os.environ, "NBCKPT_DIR": str(tmp_path / "k")}
    )
    try:
        # The save's writes wait until the cell goes on past the magic, which has displayed the
        # status by then: the status shows the save in flight, and the commit comes as an update
        # (a save that committed before the status rendered showed "committed" from the start).
        code = (
            "import threading, torch\nfrom nbckpt.engine._faults import armed\n"
            "displayed = threading.Event()\narming = armed('store.sink', lambda *a: displayed.wait(120))\n"
            "arming.__enter__()\n"
            "%load_ext nbckpt\nx = torch.zeros(1 << 22)\nh = %ckpt_async x --step 4\ndisplayed.set()\n"
        )
        reply = kc.execute(code, reply=True, timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        shown: dict[str, str] = {}
        committed: str | None = None
        deadline_messages = 200
        while committed is None and deadline_messages:
            deadline_messages -= 1
            try:
                msg = kc.get_iopub_msg(timeout=30)
            except queue.Empty:
                break
            content: dict[str, Any] = msg["content"]
            display_id = content.get("transient", {}).get("display_id")
            text = content.get("data", {}).get("text/plain", "")
            if msg["msg_type"] == "display_data" and display_id:
                shown[display_id] = text
            if msg["msg_type"] == "update_display_data" and "committed" in text:
                committed = display_id
        assert shown, "the magic displayed no status"
        assert committed in shown, "no display update reported the commit"
        assert "step 4" in shown[committed] and "committed" not in shown[committed]
        assert "text/html" in content["data"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


LAB_CELL = """\
from nbckpt.notebook import Lab
lab = Lab(directory={directory!r}, preset="synthetic", size_mb=2.0, strategies=["nbckpt-async"],
          steps={steps}, every=5, repeats=1)
lab.run()
lab
"""


def test_rerunning_the_lab_cell_mid_run_stops_the_old_run_in_a_real_kernel(
    kernel: RealKernel, tmp_path: Path
) -> None:
    """The same cell twice in one kernel: the first lab's run is stopped (its directory's lock
    released), and the second lab runs in that directory without a lock error."""
    directory = str(tmp_path / "lab")
    assert kernel.run(LAB_CELL.format(directory=directory, steps=100_000)) == ""
    kernel.run(
        "import time\nfirst = lab\n"
        "while first.running and first.progress.value < 12:\n    time.sleep(0.01)\n"
        "assert first.running, first.error"
    )  # past its first save: the lock is held
    out = kernel.run(LAB_CELL.format(directory=directory, steps=12))
    assert out == "nbckpt: stopped the previous lab's run (its saves in flight committed) and closed it\n"
    checks = kernel.run(
        "lab.wait()\n"
        "print(first.closed, first.running, first.stopped, lab is not first)\n"
        "print(lab.error)\n"
        "print(int(lab.comparison.results.set_index('strategy').loc['nbckpt-async', 'checkpoints']))"
    )
    assert checks.splitlines() == ["True False True True", "None", "2"]


def test_rerunning_ckpt_bench_stops_the_previous_run_in_a_real_kernel(
    kernel: RealKernel, tmp_path: Path
) -> None:
    bench = (
        f"%ckpt_bench --dir {tmp_path / 'b'} --size-mb 2 --strategies nbckpt-async "
        "--every 5 --repeats 1 --steps {steps}"
    )
    kernel.run("%load_ext nbckpt")
    assert kernel.run(bench.format(steps=100_000), lab=True) == ""
    kernel.run(
        "import time\nfirst = get_ipython().magics_manager.registry['CheckpointMagics'].lab\n"
        "while first.running and first.progress.value < 12:\n    time.sleep(0.01)\n"
        "assert first.running, first.error"
    )
    out = kernel.run(bench.format(steps=12), lab=True)
    assert "nbckpt: stopped the previous lab's run" in out
    checks = kernel.run(
        "lab = get_ipython().magics_manager.registry['CheckpointMagics'].lab\n"
        "lab.wait()\nprint(first.closed, first.running, lab is not first, lab.error)"
    )
    assert checks.strip() == "True False True None"


def test_background_warnings_show_in_the_notebook_in_a_real_kernel(kernel: RealKernel) -> None:
    kernel.run("%load_ext nbckpt")
    cell = (
        "import logging, threading\n"
        "worker = threading.Thread(target=logging.getLogger('nbckpt').warning,\n"
        "                          args=('nbckpt: could not remove an old checkpoint',))\n"
        "worker.start(); worker.join()"
    )
    assert kernel.run(cell, stream="stderr") == "nbckpt: could not remove an old checkpoint\n"
    kernel.run("%unload_ext nbckpt")
    assert kernel.run(cell, stream="stderr") == ""


def test_extension_import_is_lazy() -> None:
    """``import nbckpt`` must not import IPython (it is loaded by %load_ext only)."""
    import subprocess

    code = "import sys, nbckpt; print('IPython' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.stdout.strip() == "False"


def _shown(kernel: RealKernel, code: str) -> tuple[str, list[str]]:
    """Run a cell in ``kernel``: its stdout and the text/plain of everything it displayed, the
    updates of those displays included (in order)."""
    msg_id = kernel.send(code)
    out, shown = [], []
    for kind, body in kernel._messages(msg_id, 180):
        if kind == "stream" and body["name"] == "stdout":
            out.append(body["text"])
        elif kind in ("display_data", "update_display_data"):
            shown.append(body["data"].get("text/plain", ""))
        elif kind == "error":
            raise AssertionError("\n".join(body["traceback"]))
    assert kernel.reply(msg_id)["status"] == "ok"
    return "".join(out), shown


def test_a_sync_saves_status_shows_all_the_time_the_cell_was_blocked_in_a_real_kernel(
    kernel: RealKernel,
) -> None:
    """Issue 29 defect 6: %ckpt_sync's status line gives the time save() blocked the cell, the
    write it waited for included (it showed only the part before the write: 1.43 s of 5.47 s)."""
    kernel.run("import time, torch\n%load_ext nbckpt\nx = torch.randn(1 << 24)")  # 64 MiB
    out, shown = _shown(
        kernel,
        "start = time.perf_counter()\nh = %ckpt_sync x\n"
        "print(time.perf_counter() - start, h.committed.result().stall_s)",
    )
    blocked, recorded = map(float, out.split())
    statuses = [text for text in shown if "committed" in text]
    assert statuses, shown
    for status in statuses:  # shown once committed, and updated by the commit callback
        stall_ms = float(re.search(r"stall ([0-9.]+) ms", status).group(1))  # type: ignore[union-attr]
        assert stall_ms == pytest.approx(recorded * 1e3, abs=0.051)
        assert 0.8 * blocked <= stall_ms / 1e3 <= blocked, (status, blocked)
    table = kernel.run("table = %ckpt_status\nprint(table.loc[0, 'stall_ms'])")
    assert float(table.splitlines()[-1]) == pytest.approx(recorded * 1e3, rel=0.01)


HELD = (
    "import gc\nfrom nbckpt import Checkpointer\n"
    "print(sum(c.host_bytes for c in gc.get_objects() if isinstance(c, Checkpointer)))"
)


def test_a_replaced_default_directory_gives_its_staging_memory_back_in_a_real_kernel(
    kernel: RealKernel, tmp_path: Path
) -> None:
    """Issue 29 defect 2: every %ckpt_config -d (each Run All of notebook 01) and --new-run kept
    one more staging copy of the state (151 -> 302 -> 453 -> 604 MB); the staging bytes every
    Checkpointer in the kernel holds stay those of one copy over four re-runs of each."""
    kernel.run("import torch\n%load_ext nbckpt\nx = torch.randn(1 << 20)")  # 4 MiB
    held = []
    for i in range(4):
        kernel.run(f"%ckpt_config -d {tmp_path / f'run{i}'}\nh = %ckpt_async x\n%ckpt_wait")
        held.append(int(kernel.run(HELD)))
    for _ in range(4):
        kernel.run("%ckpt_config --new-run\nh = %ckpt_async x\n%ckpt_wait")
        held.append(int(kernel.run(HELD)))
    assert held[0] >= 4 << 20
    assert held == [held[0]] * 8
    memory = kernel.run("%ckpt_status")
    assert memory.startswith("nbckpt: host memory held for staging: 4.2 MB ("), memory
