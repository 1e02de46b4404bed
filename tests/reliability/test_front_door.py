"""Reliability v3 at the front door: what a caller can pass in, and what a failed call leaves.

Each test is named after its item of the "Reliability v3" issue and failed before the fix:
a step too large to name (8), a constructor that fails (14), ``file://`` (15), the raw
exceptions of about 25 calls (16), a bad mirror (17), ``nbckpt verify`` of a typo (18).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.states import assert_holds, state_of
from torch.distributed.checkpoint.metadata import Metadata

import nbckpt
from nbckpt import Checkpointer, CheckpointError, ConfigError, run_directory
from nbckpt.cli import main as cli
from nbckpt.engine._format import MAX_STEP
from nbckpt.engine._manifest import sign

HUGE = 10**5000  # more digits than Python turns into text (4,300) without being told to


def nbckpt_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("nbckpt-"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and message, repr(message)
    return message


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- item 8: steps bounded at the front door ---------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_item08_a_step_too_large_to_name_is_refused_at_once(tmp_path: Path, mode: str) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory, mode=mode) as ckpt:
        ckpt.save(state_of(1), step=1).wait()
        for step in (HUGE, 10**300, MAX_STEP + 1):
            with pytest.raises(ConfigError, match="step must be a non-negative integer") as raised:
                ckpt.save(state_of(1), step=step)  # never hangs (sync), never a handle that never ends
            assert len(one_line(raised.value)) < 200  # the step is not printed in full
        calls: list[Callable[[Any], Any]] = [
            lambda s: ckpt.restore(state_of(0), step=s),
            ckpt.delete,
            ckpt.verify,
            ckpt.manifest,
            ckpt.load,
        ]
        for call in calls:
            with pytest.raises(ConfigError, match="step must be a non-negative integer"):
                call(HUGE)
        assert ckpt.handles == [] and sorted(os.listdir(directory)) == [".nbckpt.lock", "step-000001"]
        # The bound itself is a step like any other.
        ckpt.save(state_of(2), step=MAX_STEP).wait()
        assert ckpt.steps() == [1, MAX_STEP]
        assert_holds(ckpt, 1)
    # A directory named like a step beyond the bound (245 digits) is not a step.
    (directory / f"step-{'1' * 245}").mkdir()
    with Checkpointer(directory, read_only=True) as reader:
        assert reader.steps() == [1, MAX_STEP]


# -- item 14: a failed constructor gives back everything it took --------------------------------


def test_item14_a_failed_constructor_releases_the_directory_and_its_threads(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory) as ckpt:
        ckpt.save(state_of(1), step=1).wait()
    with Checkpointer(tmp_path / "other", mirror=str(tmp_path / "mirror")):
        pass  # the mirror is this other run's from now on
    threads, fds = nbckpt_threads(), open_fds()
    intent = directory / ".set-aside-intent.json"
    failing: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"mirror": str(tmp_path / "mirror")}, ConfigError, "belongs to the run"),  # refused after the lock
        ({}, CheckpointError, "set-aside-intent.json is not JSON nbckpt wrote"),  # a damaged intent
    ]
    for options, error, message in failing:
        if error is CheckpointError:
            intent.write_text("{")
        with pytest.raises(error, match=message):
            Checkpointer(directory, **options)
        assert nbckpt_threads() == threads  # the I/O, persist, retention, staging, mirror threads ended
        assert open_fds() == fds  # the lock's descriptor is closed
        assert nbckpt.close_all() == []  # nothing half-made is left registered
    intent.unlink()
    with Checkpointer(directory) as again:  # the directory is free: no "in use"
        assert_holds(again, 1)


# -- item 15: file:// -----------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["file://", "file://   "])
def test_item15_an_empty_file_url_is_refused_and_the_current_directory_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    lookalike = tmp_path / ".tmp-step-000001-0a1b2c"  # a user's own directory, named like a leftover
    lookalike.mkdir()
    with pytest.raises(ConfigError, match="names no directory") as raised:
        Checkpointer(url)
    one_line(raised.value)
    with pytest.raises(ConfigError, match="names no directory"):
        Checkpointer(tmp_path / "run", mirror=url)
    assert sorted(os.listdir(tmp_path)) == [lookalike.name]
    with Checkpointer(f"file://{tmp_path / 'run'}") as ckpt:  # a file:// URL with a path is that path
        ckpt.save(state_of(1), step=1).wait()
    assert (tmp_path / "run" / "step-000001" / "manifest.json").is_file()


# -- item 16: one line for every bad call, not a raw exception ---------------------------------


def test_item16_a_nul_in_a_path_is_a_config_error(tmp_path: Path) -> None:
    for bad in (f"{tmp_path}/run\0x", Path(f"{tmp_path}/run\0x")):
        with pytest.raises(ConfigError, match="NUL") as raised:
            Checkpointer(bad)
        one_line(raised.value)
    with pytest.raises(ConfigError, match="NUL"):
        Checkpointer(tmp_path / "run", mirror=f"{tmp_path}/m\0")
    with pytest.raises(ConfigError, match="NUL"):
        run_directory(f"{tmp_path}/nb\0")
    assert os.listdir(tmp_path) == []


def test_item16_read_only_on_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "notes.txt"
    file.write_text("not a run")
    with pytest.raises(CheckpointError, match="is a file, not a directory") as raised:
        Checkpointer(file, read_only=True)
    one_line(raised.value)
    for argv in (["ls", str(file)], ["show", str(file), "1"], ["verify", str(file)]):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "", (argv, out, err)
        assert err.count("\n") == 1 and "is a file, not a directory" in err, err


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_item16_a_lock_file_that_is_not_a_file_is_refused_without_leaking(tmp_path: Path, kind: str) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory) as ckpt:
        ckpt.save(state_of(1), step=1).wait()
    lock = directory / ".nbckpt.lock"
    lock.unlink()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    if kind == "symlink":
        lock.symlink_to(outside)
    elif kind == "directory":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    fds = open_fds()
    with pytest.raises(CheckpointError, match=r"\.nbckpt\.lock.*remove it") as raised:
        Checkpointer(directory)
    one_line(raised.value)
    assert open_fds() == fds  # the descriptor of a lock that was never taken is closed
    assert outside.read_text() == "keep me"  # a symlink is never followed
    with Checkpointer(directory, read_only=True) as reader:  # reading needs no lock
        assert_holds(reader, 1)


def test_item16_a_bad_map_location_is_a_config_error(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(state_of(1), step=1).wait()
        for bad in ("gpu9", "cuda:99", object()):
            with pytest.raises(ConfigError, match="map_location") as raised:
                ckpt.load(1, map_location=bad)  # type: ignore[arg-type]
            one_line(raised.value)
        assert torch.equal(ckpt.load(1, map_location="cpu")["w"], state_of(1)["w"])


def test_item16_save_on_signal_and_final_save_check_their_arguments(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(tmp_path / "run") as ckpt:
        bad: list[tuple[dict[str, Any], str]] = [
            ({"snapshot": 5}, "snapshot must be a function"),
            ({"snapshot": lambda: None, "signals": (signal.SIGKILL,)}, "SIGKILL cannot be caught"),
            ({"snapshot": lambda: None, "signals": (signal.SIGTERM, "SIGNOPE")}, "SIGNOPE"),
            ({"snapshot": lambda: None, "signals": signal.SIGTERM}, "signals must be a tuple"),
            ({"snapshot": lambda: None, "timeout_s": -1}, "timeout_s"),
        ]
        for kwargs, message in bad:
            with pytest.raises(ConfigError, match=message) as raised:
                ckpt.save_on_signal(**kwargs)
            one_line(raised.value)
            assert signal.getsignal(signal.SIGTERM) is before  # nothing half-installed
        with pytest.raises(ConfigError, match="snapshot must be a function"):
            ckpt.final_save(5)  # type: ignore[arg-type]
        undo = ckpt.save_on_signal(lambda: None, signals=("SIGTERM",))  # a signal's name works too
        assert signal.getsignal(signal.SIGTERM) is not before
        undo()
        assert signal.getsignal(signal.SIGTERM) is before
        line = ckpt.final_save(lambda: 5)  # type: ignore[arg-type, return-value]
        assert "the snapshot returned 5" in line and "\n" not in line


def test_item16_a_bad_snapshot_in_the_signal_handler_still_lets_the_signal_through(tmp_path: Path) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        with Checkpointer(tmp_path / "run") as ckpt:
            ckpt.save_on_signal(lambda: 5, signals=(signal.SIGUSR1,))  # type: ignore[arg-type, return-value]
            signal.raise_signal(signal.SIGUSR1)
        assert received == [signal.SIGUSR1]  # the handler before it ran, as without a final save
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_item16_autosave_and_run_directory_check_their_arguments(tmp_path: Path) -> None:
    from nbckpt.notebook import Autosave

    for bad in (5, [5], ["model", None]):
        with pytest.raises(ConfigError, match="names of notebook variables") as raised:
            Autosave(bad)  # type: ignore[arg-type]
        one_line(raised.value)
    for bad_dir in (5, None):
        with pytest.raises(ConfigError, match="workdir must be a path") as raised:
            run_directory(bad_dir)  # type: ignore[arg-type]
        one_line(raised.value)


def resign(step_dir: Path) -> None:
    """Re-hash every file and re-sign the manifest (as anyone who can write the files can)."""
    from nbckpt.engine._files import hash_blocks

    path = step_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    for name, meta in manifest["files"].items():
        data = (step_dir / name).read_bytes()
        meta.update(size=len(data), blocks=hash_blocks(data))
    path.write_bytes(sign(manifest))


def test_item16_odd_allow_listed_metadata_is_one_line_and_verify_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pickle

    directory = tmp_path / "run"
    with Checkpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(state_of(step), step=step).wait()
    odd = Metadata(state_dict_metadata=5, storage_data={})  # type: ignore[arg-type]  # only DCP's classes
    (directory / "step-000001" / ".metadata").write_bytes(pickle.dumps(odd))
    resign(directory / "step-000001")
    with Checkpointer(directory, read_only=True) as reader:
        with pytest.raises(CheckpointError, match="step-000001") as raised:
            reader.verify(1)
        one_line(raised.value)
    code, out, err = run_cli(capsys, "verify", str(directory))
    assert code == 1 and err == "", err
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("step 1: ") and lines[1] == "step 2: ok", out


@pytest.mark.s3
@pytest.mark.xdist_group("s3")
def test_item16_ls_of_s3_without_credentials_is_one_line(
    s3_server: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    bucket = f"nocreds-{uuid.uuid4().hex[:8]}"
    s3_server.make_bucket(bucket)
    code, out, err = run_cli(capsys, "ls", f"s3://{bucket}/run", "--endpoint-url", s3_server.endpoint_url)
    assert code == 2 and out == "", out
    assert err.count("\n") == 1 and "credentials" in err, err


# -- item 17: a bad mirror creates nothing ------------------------------------------------------


def test_item17_a_bad_mirror_creates_nothing(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    for mirror, error, message in (
        ("ftp://host/run", ConfigError, "ftp:// cannot hold checkpoints"),
        (str(file), ConfigError, "is a file, not a directory"),
    ):
        with pytest.raises(error, match=message) as raised:
            Checkpointer(tmp_path / "run", mirror=mirror)
        one_line(raised.value)
        assert sorted(os.listdir(tmp_path)) == ["a-file"]  # no run directory


# -- item 18: a typo is an error ----------------------------------------------------------------


def test_item18_a_missing_or_empty_directory_is_an_error_for_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, empty = str(tmp_path / "typo"), tmp_path / "empty"
    empty.mkdir()
    out_file = str(tmp_path / "out.pt")
    for argv in (
        ["verify", missing],
        ["ls", missing],
        ["show", missing, "1"],
        ["diff", missing, "1", "2"],
        ["export", f"{missing}/step-000001", out_file],
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and out == "", (argv, out)
        assert err.count("\n") == 1 and "does not exist" in err, (argv, err)
    for argv in (["verify", str(empty)], ["show", str(empty), "1"], ["diff", str(empty), "1", "2"]):
        code, out, err = run_cli(capsys, *argv)
        assert code != 0 and err.count("\n") == 1 and "no committed checkpoint" in err, (argv, out, err)
    assert not (tmp_path / "typo").exists() and not os.path.exists(out_file)


def test_item18_ls_of_a_parent_directory_names_the_runs_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for run in ("run-a", "run-b", ".nbckpt"):  # .nbckpt: where the Lightning plug-in saves
        with Checkpointer(tmp_path / run) as ckpt:
            ckpt.save(state_of(1), step=1).wait()
    (tmp_path / "notes").mkdir()
    code, out, err = run_cli(capsys, "ls", str(tmp_path))
    assert code == 0 and err == "", err
    assert "no committed checkpoint" in out and "it holds runs: .nbckpt, run-a, run-b" in out, out
    code, out, err = run_cli(capsys, "verify", str(tmp_path))
    assert code != 0 and "it holds runs: .nbckpt, run-a, run-b" in err, err
