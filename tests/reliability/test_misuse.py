"""The Checkpointer under misuse and pressure: bad arguments, two writers, a dropped
Checkpointer, Ctrl-C, exit with a save in flight, a directory removed mid-save, a failing
writer thread, memory over many saves, a slow target; and the CLI's usage errors.

Crashes are in test_reliability_crash.py, storage faults in test_reliability_disk.py, corrupt
and hostile checkpoints in test_reliability_corruption.py.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers.states import assert_holds, state_of
from helpers.storage import Throttle
from helpers.sync import ctrl_c_raises, press_ctrl_c_once_blocked

from nbckpt import Checkpointer, CheckpointError, ConfigError, SaveHandle
from nbckpt.engine._faults import armed


def leftovers(directory: Path) -> list[str]:
    """The temporary directories of saves not (yet) committed."""
    return [n for n in os.listdir(directory) if n.startswith(".tmp-")]


def step_2_held(ckpt: Checkpointer, throttle: Throttle) -> SaveHandle:
    """Step 1 committed, then step 2 saved with its writes held back (``throttle.release`` frees them)."""
    ckpt.save(state_of(1), step=1).wait()
    throttle.hold()
    return ckpt.save(state_of(2), step=2)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"mode": "fast"}, "mode"),
        ({"mode": "SYNC"}, "mode"),
        ({"keep": 0}, "keep"),
        ({"keep": True}, "keep"),
        ({"keep": 2.5}, "keep"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"max_inflight": "2"}, "max_inflight"),
        ({"writer_threads": 0}, "writer_threads"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_options_create_nothing(tmp_path: Path, options: dict[str, Any], named: str) -> None:
    target = tmp_path / "run"
    with pytest.raises(ConfigError) as raised:
        Checkpointer(target, **options)
    message = str(raised.value)
    assert named in message and "\n" not in message, message
    assert not target.exists()


@pytest.mark.parametrize("directory", ["", None, 3])
def test_bad_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory: Any) -> None:
    monkeypatch.chdir(tmp_path)  # an empty path must not mean "here"
    with pytest.raises(ConfigError, match="directory must be a non-empty path or URL"):
        Checkpointer(directory)
    assert os.listdir(tmp_path) == []


def test_bad_save_and_restore_arguments_leave_nothing_behind(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    good = state_of(1, 100)
    bad_calls: list[tuple[Any, Any, str]] = [
        (good, -1, "step must be a non-negative integer"),
        (good, True, "step must be a non-negative integer"),
        (good, 1.5, "step must be a non-negative integer"),
        (good, "3", "step must be a non-negative integer"),
        ([torch.ones(3)], 1, "state must be a dict, not list"),
        ({"fn": lambda: 0}, 1, "fn holds a function, which nbckpt cannot checkpoint"),
        ({"deep": {"x": [1, object()]}}, 1, "deep.x.1 holds a object"),
        ({"w": {1.5: torch.ones(2)}}, 1, "w has a key of type float"),
        ({"w": torch.ones(4).to_sparse()}, 1, "dense tensors only"),
    ]
    with Checkpointer(directory, mode="async") as ckpt:
        for state, step, message in bad_calls:
            with pytest.raises(ConfigError, match=message) as raised:
                ckpt.save(state, step=step)
            assert "\n" not in str(raised.value)
        assert os.listdir(directory) == [".nbckpt.lock"]
        assert ckpt.handles == []
        with pytest.raises(ConfigError, match="state must be a dict"):
            ckpt.restore([])  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match="no committed checkpoint for step 5"):
            ckpt.restore({"w": torch.zeros(100)}, step=5)
        ckpt.save(good, step=1).wait()  # the bad calls broke nothing
        assert_holds(ckpt, 1, 100)
    with pytest.raises(CheckpointError, match="is closed"):
        ckpt.save(good, step=2)


# -- two writers --------------------------------------------------------------------------------


def test_second_writer_in_the_same_process(tmp_path: Path, throttle: Throttle) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory, mode="async") as first:
        handle = step_2_held(first, throttle)
        assert throttle.entered.wait(30)
        in_flight = leftovers(directory)
        with pytest.raises(CheckpointError) as raised:
            Checkpointer(directory)
        assert str(raised.value) == (
            f"{directory} is in use by another Checkpointer in this process; close it "
            "(ckpt.close()) or call nbckpt.close_all()"
        )
        assert leftovers(directory) == in_flight  # untouched
        throttle.release.set()
        handle.wait()
        assert first.steps() == [1, 2]
    with Checkpointer(directory) as again:  # the lock went with close()
        assert_holds(again, 1)
        assert_holds(again, 2)


HOLDS_THE_DIRECTORY = """
import sys, torch
from nbckpt import Checkpointer
with Checkpointer(sys.argv[1], mode="sync") as ckpt:
    ckpt.save({"w": torch.arange(1000, dtype=torch.float32) + 1, "step": 1}, step=1)
    print("holding", flush=True)
    sys.stdin.readline()
    ckpt.save({"w": torch.arange(1000, dtype=torch.float32) + 2, "step": 2}, step=2)
"""


def test_second_writer_in_another_process(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDS_THE_DIRECTORY, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline() == "holding\n"
    with pytest.raises(CheckpointError, match=rf"in use by another Checkpointer \(pid {child.pid}\)"):
        Checkpointer(directory)
    _, err = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, err
    with Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert_holds(ckpt, 1)
        assert_holds(ckpt, 2)


def test_a_dropped_checkpointer_frees_the_directory(tmp_path: Path) -> None:
    """Re-running a notebook cell ``ckpt = Checkpointer(d)`` must not lock the user out."""
    directory = tmp_path / "run"
    ckpt = Checkpointer(directory, mode="async")
    ckpt.save(state_of(1), step=1)  # still in flight when the reference goes
    del ckpt
    deadline = time.monotonic() + 60
    while True:  # the old one lets go once its save has committed and it is collected
        gc.collect()
        try:
            again = Checkpointer(directory, mode="async")
            break
        except CheckpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    with again:
        assert_holds(again, 1)


class _Said(logging.Handler):
    """Sets ``seen`` once nbckpt logs a line holding ``words``."""

    def __init__(self, words: str, seen: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.words, self.seen = words, seen

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.seen.set()


def test_a_dropped_checkpointer_hands_its_run_over_only_once_its_upload_is_over(tmp_path: Path) -> None:
    """A Checkpointer dropped unclosed while its mirror uploads (a cell run again): a new writer
    of the run waits for that upload before it cleans the mirror up, so it never deletes the
    upload's files under it (before: the lock was given back at once, the new open's clean-up
    removed the ``.tmp-step-`` folder being written, and the upload failed)."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    entered, release = threading.Event(), threading.Event()

    def held(location: str, name: str) -> None:
        entered.set()
        assert release.wait(60), "the test never released the upload"

    progressed = threading.Event()  # the new open waits, or has opened
    handler = _Said("waiting for a Checkpointer of this process that was dropped", progressed)
    logger = logging.getLogger("nbckpt")
    logger.addHandler(handler)
    opened: Future[Checkpointer] = Future()

    def open_again() -> None:
        try:
            opened.set_result(Checkpointer(run, mirror=str(mirror)))
        except BaseException as exc:
            opened.set_exception(exc)
        progressed.set()

    opener = threading.Thread(target=open_again)
    try:
        with armed("mirror.upload", held), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            ckpt = Checkpointer(run, mirror=str(mirror))
            ckpt.save(state_of(1), step=1).wait()
            assert entered.wait(60)  # its upload is held, its files half-written on the mirror
            uploading = [p.name for p in mirror.iterdir() if p.name.startswith(".tmp-step-")]
            assert uploading
            del ckpt
            gc.collect()
            opener.start()
            assert progressed.wait(60)
            assert not opened.done(), "a new writer opened the run while the dropped one uploaded"
            assert [p.name for p in mirror.iterdir() if p.name.startswith(".tmp-step-")] == uploading
            release.set()
            opener.join(60)
            with opened.result() as again:
                again.wait()
                assert_holds(again, 1)
        assert not [w for w in said if "not on the mirror" in str(w.message)], [str(w.message) for w in said]
    finally:
        release.set()
        logger.removeHandler(handler)
        opener.join(60) if opener.is_alive() else None
    with Checkpointer(mirror, read_only=True) as copy:
        assert copy.steps() == [1]
        copy.verify(1)


def test_a_new_writer_waits_for_a_dropped_checkpointers_upload_only_as_long_as_timeout_s(
    tmp_path: Path,
) -> None:
    """An upload of a dropped Checkpointer that never ends fails the next writer's open after
    ``timeout_s``, naming why, instead of holding it for ever (on a thread of its own no Ctrl-C
    reaches it); once the upload is over, the run opens."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    entered, release = threading.Event(), threading.Event()

    def held(location: str, name: str) -> None:
        entered.set()
        assert release.wait(60), "the test never released the upload"

    try:
        with armed("mirror.upload", held):
            ckpt = Checkpointer(run, mirror=str(mirror))
            ckpt.save(state_of(1), step=1).wait()
            assert entered.wait(60)
            del ckpt
            gc.collect()
            expected = r"dropped unclosed on .* still finishing its work .* after 0\.5 s \(timeout_s\)"
            with pytest.raises(CheckpointError, match=expected):
                Checkpointer(run, mirror=str(mirror), timeout_s=0.5)
            release.set()
            with Checkpointer(run, mirror=str(mirror)) as again:
                assert_holds(again, 1)
    finally:
        release.set()
    with Checkpointer(mirror, read_only=True) as copy:
        copy.verify(1)


EXITS_WHILE_A_DROPPED_ONE_UPLOADS = """
import gc, logging, sys, threading, torch
from nbckpt import Checkpointer
from nbckpt.engine._faults import armed
logging.basicConfig()  # nbckpt's warnings to stderr
go = threading.Event()
def held(location, name):
    print("uploading", flush=True)
    go.wait()
class Going(logging.Handler):
    def emit(self, record):
        if "dropped unclosed before exit" in record.getMessage():
            go.set()  # the exit has said it waits for the upload: let it go now
logging.getLogger("nbckpt").addHandler(Going())
arming = armed("mirror.upload", held)  # held until the exit waits for it, then let go
arming.__enter__()
ckpt = Checkpointer(sys.argv[1], mirror=sys.argv[2])
ckpt.save({"w": torch.arange(16 << 20, dtype=torch.float32), "step": 1}, step=1).wait()
del ckpt  # dropped unclosed (a cell run again): its release waits behind the upload
gc.collect()
"""


def test_a_process_exiting_as_a_dropped_checkpointer_uploads_finishes_the_upload_first(
    tmp_path: Path,
) -> None:
    """A Checkpointer dropped unclosed hands its release to its persist thread, after its
    upload; a script ending then waits for both before the interpreter's teardown. Before, the
    teardown began under the daemon thread: the upload was cut short, and a thread freeing a save's
    staging memory then aborted the process (SIGABRT, ``terminate called without an active
    exception``: 2 of 31 runs of the HF Trainer's torchrun test under load)."""
    run, mirror = tmp_path / "run", tmp_path / "mirror"
    done = subprocess.run(
        [sys.executable, "-c", EXITS_WHILE_A_DROPPED_ONE_UPLOADS, str(run), str(mirror)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("uploading")  # the exit began with the upload held
    assert "finishing the work of Checkpointers dropped unclosed" in done.stderr
    with Checkpointer(mirror, read_only=True) as copy:
        assert copy.steps() == [1]
        copy.verify(1)
    assert not [p.name for p in mirror.iterdir() if p.name.startswith(".tmp-")]  # nothing cut short


FORK_CHILD_DROPS_ITS_COPY = """
import gc, os, signal, sys, torch
from nbckpt import Checkpointer
ckpt = Checkpointer(sys.argv[1])
ckpt.save({"w": torch.zeros(4), "step": 1}, step=1).wait()
pid = os.fork()
if pid == 0:  # the child drops its copy of the parent's Checkpointer, then exits as a script does
    signal.alarm(60)  # a child that hangs at its exit ends (SIGALRM: exit code -14), none left over
    del ckpt
    gc.collect()
    sys.exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
ckpt.save({"w": torch.ones(4), "step": 2}, step=2).wait()  # the parent's threads and lock untouched
ckpt.close()
"""


FORK_CHILD_EXITS_WITH_A_SAVE_IN_FLIGHT = """
import os, signal, sys, threading, torch
from nbckpt import Checkpointer
from nbckpt.engine._faults import armed
entered, go = threading.Event(), threading.Event()
def held(location, name):
    entered.set()
    go.wait()
with armed("store.sink", held):
    ckpt = Checkpointer(sys.argv[1], mode="async")
    handle = ckpt.save({"w": torch.zeros(4), "step": 1}, step=1)
    entered.wait()  # its persist thread writes (held)
    pid = os.fork()
    if pid == 0:  # the child exits as a script does, its copy of the Checkpointer still referenced
        signal.alarm(60)  # a child that hangs at its exit ends (SIGALRM: exit code -14)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    go.set()
    handle.wait()
ckpt.close()
"""


@pytest.mark.parametrize(
    ("script", "steps"),
    [(FORK_CHILD_DROPS_ITS_COPY, [1, 2]), (FORK_CHILD_EXITS_WITH_A_SAVE_IN_FLIGHT, [1])],
    ids=["dropping-it", "with-a-save-in-flight"],
)
def test_a_forked_child_exits_whatever_became_of_its_copy_of_a_checkpointer(
    tmp_path: Path, script: str, steps: list[int]
) -> None:
    """A child of ``os.fork`` exits whether it dropped its copy of the parent's Checkpointer or
    still held it with a save in flight at the fork: the release and the close are the parent's
    (the threads and the lock are there). Before, the dropped copy's release was handed to a
    persist thread the child does not have, and the held one's close at exit waited for the
    parent's save; either way the child's exit waited for ever."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "child 0\n", done.stdout  # before: "child -14", hung at its exit
    with Checkpointer(tmp_path / "run", read_only=True) as ckpt:
        assert ckpt.steps() == steps


def test_a_save_in_flight_holds_a_dropped_checkpointer_alive(tmp_path: Path, throttle: Throttle) -> None:
    """A Checkpointer dropped unclosed as its save writes lives until the save is over (the
    persist job holds it), then frees the directory: the step is there for the next writer."""
    directory = tmp_path / "run"
    ckpt = Checkpointer(directory, mode="async")
    alive = weakref.ref(ckpt)
    with throttle.released_after():
        throttle.hold()
        handle = ckpt.save(state_of(1), step=1)
        assert throttle.entered.wait(60)  # its persist thread writes (held)
        del ckpt
        gc.collect()
        assert alive() is not None, "a save in flight lost its Checkpointer"
        with pytest.raises(CheckpointError, match="in use by another Checkpointer in this process"):
            Checkpointer(directory)
        gone = threading.Event()
        # on what only the Checkpointer holds: freed once the Checkpointer's own finalizer ran
        weakref.finalize(alive()._grace, gone.set)  # type: ignore[union-attr]
    handle.wait()
    assert gone.wait(60)  # dropped once its save is over (no collection needed)
    with Checkpointer(directory) as again:  # its release is waited for, never refused
        assert_holds(again, 1)


# -- interrupts and exit ------------------------------------------------------------------------


@pytest.mark.parametrize("blocked_in", ["handle.wait", "ckpt.wait", "save"])
def test_keyboard_interrupt_while_persisting(tmp_path: Path, throttle: Throttle, blocked_in: str) -> None:
    """Ctrl-C while waiting for a save: the save stays tracked and completes in the background."""
    with ctrl_c_raises(), Checkpointer(tmp_path / "run", mode="async") as ckpt:
        with throttle.released_after():  # step 2's writes wait for the end of this block, not for a clock
            handle = step_2_held(ckpt, throttle)
            with pytest.raises(KeyboardInterrupt):
                press_ctrl_c_once_blocked(throttle.entered)
                if blocked_in == "handle.wait":
                    handle.wait()
                elif blocked_in == "ckpt.wait":
                    ckpt.wait()
                else:
                    ckpt.save(state_of(3), step=3)  # waits for step 2 (max_inflight=1)
            assert not handle.done() and handle.phase == "persisting", handle.error
            assert ckpt.steps() == [1]  # a save in progress never counts
        assert [r.step for r in ckpt.wait()] == [2]  # still tracked: wait() waits for it
        assert ckpt.steps() == [1, 2]
        assert_holds(ckpt, 2)


EXITS_WITH_A_SAVE_IN_FLIGHT = """
import multiprocessing, os, sys, torch
from nbckpt import Checkpointer
def save():
    global ckpt  # held, never closed (Lightning's plug-in in its trainer)
    ckpt = Checkpointer(sys.argv[1], mode="async", writer_threads=1)
    handle = ckpt.save({"w": torch.arange(16 << 20, dtype=torch.float32) + 1, "step": 1}, step=1)
    print(f"in flight at exit: {not handle.done()}", flush=True)
if sys.argv[2] == "fork":  # Lightning's ddp_fork: the child leaves by os._exit after its finalizers
    child = multiprocessing.get_context("fork").Process(target=save)
    child.start()
    child.join()
    sys.exit(child.exitcode)
save()
if sys.argv[2] == "hard":
    os._exit(0)  # no atexit: the save is abandoned wherever it was
"""


def test_exit_with_a_save_in_flight(tmp_path: Path) -> None:
    """A normal exit finishes the save (with a warning), and so does a multiprocessing fork child
    returning from its target (it leaves by os._exit, running multiprocessing's finalizers, not
    atexit's); a hard one leaves nothing that counts."""
    children = {
        how: subprocess.Popen(
            [sys.executable, "-c", EXITS_WITH_A_SAVE_IN_FLIGHT, str(tmp_path / how), how],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how in ("normal", "fork", "hard")
    }
    outputs = {how: child.communicate(timeout=300) for how, child in children.items()}
    for how, child in children.items():
        assert child.returncode == 0, outputs[how][1]
    for how in ("normal", "fork"):
        out, err = outputs[how]
        if out.strip() == "in flight at exit: True":
            assert err.count("nbckpt: finishing save(s) of step 1 before exit") == 1, err
        with Checkpointer(tmp_path / how) as ckpt:
            assert ckpt.steps() == [1], how
            assert_holds(ckpt, 1, 16 << 20)
    abandoned = leftovers(tmp_path / "hard")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = Checkpointer(tmp_path / "hard")
    with ckpt:
        for step in ckpt.steps():
            assert_holds(ckpt, step, 16 << 20)
    cleaned = " ".join(str(w.message) for w in caught if "leftover(s) of interrupted saves" in str(w.message))
    assert all(name in cleaned for name in abandoned), (abandoned, cleaned)
    assert leftovers(tmp_path / "hard") == []


# -- the directory or a writer failing mid-save -------------------------------------------------


CTRL_C_TWICE_AT_EXIT = """
import logging, os, signal, sys, threading, warnings, torch
from nbckpt import Checkpointer
from nbckpt.engine._faults import armed
logging.basicConfig()  # nbckpt's warnings to stderr
exiting, pressed = threading.Event(), threading.Event()
def writing(*args):
    print("writing", flush=True)
    exiting.wait()
    if not pressed.is_set():
        pressed.set()
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C as the exit waits for the save
    threading.Event().wait()  # its storage hangs: the save never ends
join = threading.Thread.join
def pressed_again(self, timeout=None):
    if pressed.is_set() and self.name.startswith("nbckpt-"):
        signal.raise_signal(signal.SIGINT)  # and again as the close waits for its threads
    return join(self, timeout)
threading.Thread.join = pressed_again
arming = armed("store.sink", writing)
arming.__enter__()
ckpt = Checkpointer(sys.argv[1])
show = warnings.showwarning
def shown(message, *args, **kwargs):
    show(message, *args, **kwargs)
    if "before exit" in str(message):
        exiting.set()  # the close at exit has said it waits for the save: press Ctrl-C now
warnings.showwarning = shown
ckpt.save({"w": torch.arange(16 << 20, dtype=torch.float32)}, step=1)
"""


def test_a_ctrl_c_pressed_twice_as_the_exit_waits_for_a_save_ends_the_process_by_sigint(
    tmp_path: Path,
) -> None:
    """A Ctrl-C as the close at exit waits for a save, and again as it waits for its threads,
    leaves a save running on its daemon threads: the process ends by SIGINT once nbckpt's exit
    work is done, without the interpreter's teardown under those threads. Before, it exited 0
    with the save cut short (the KeyboardInterrupt only printed as ignored in an atexit
    callback), or hung in multiprocessing's finalizer closing it again (2 runs of 6); with the
    threads copying a tensor in the teardown, that aborts the process (SIGABRT)."""
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_TWICE_AT_EXIT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # a core dump, if any, never lands in the worktree
    )
    assert done.stdout.startswith("writing")
    assert done.returncode == -signal.SIGINT, done.stderr[-3000:]
    assert "finishing save(s) of step 1 before exit" in done.stderr
    assert "the process ends now (by SIGINT)" in done.stderr
    with Checkpointer(tmp_path / "run", read_only=True) as run:
        assert run.steps() == []  # the save never counts


def test_directory_removed_under_a_running_save(tmp_path: Path, throttle: Throttle) -> None:
    directory = tmp_path / "run"
    with Checkpointer(directory, mode="async") as ckpt:
        handle = step_2_held(ckpt, throttle)
        assert throttle.entered.wait(30)
        shutil.rmtree(directory)
        throttle.release.set()
        with pytest.raises(CheckpointError, match=r"save of step 2 .* \[ENOENT\]"):
            handle.wait()
        assert ckpt.steps() == []
        ckpt.save(state_of(3), step=3).wait()  # the directory comes back with the next save
        assert ckpt.steps() == [3]
        assert_holds(ckpt, 3)


def test_a_failing_writer_thread_is_never_swallowed(
    tmp_path: Path, throttle: Throttle, capfd: pytest.CaptureFixture[str]
) -> None:
    """A write error in either writer thread fails the save, naming errno and file, and only there."""

    def failing(name: str) -> OSError | None:
        return OSError(errno.EIO, os.strerror(errno.EIO), name) if name == "__0_1.distcp" else None

    directory = tmp_path / "run"
    with Checkpointer(directory, mode="async", writer_threads=2) as ckpt:
        ckpt.save({**state_of(0, 1 << 16), "v": torch.ones(1 << 16)}, step=0).wait()
        throttle.fail = failing
        for step in range(1, 4):
            with pytest.raises(CheckpointError, match=r"\[EIO\] \(.*__0_1\.distcp\)"):
                ckpt.save({**state_of(step, 1 << 16), "v": torch.ones(1 << 16)}, step=step).wait()
        assert ckpt.steps() == [0]
        assert leftovers(directory) == []
    assert capfd.readouterr().err == ""  # one error, raised to the caller; nothing printed


# -- resource bounds ----------------------------------------------------------------------------


@pytest.fixture
def fast_dir(tmp_path: Path) -> Iterator[Path]:
    """RAM-backed when available: the test is about the engine's memory, not the disk's speed."""
    if not os.path.isdir("/dev/shm"):
        yield tmp_path / "run"
        return
    directory = Path("/dev/shm") / f"nbckpt-test-{os.getpid()}-{time.monotonic_ns()}"
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_memory_stays_flat_over_50_async_saves(fast_dir: Path) -> None:
    process = psutil.Process()
    state = {f"layer{i}": torch.randn(4 << 20) for i in range(4)}  # 64 MiB
    rss = {}
    with Checkpointer(fast_dir, mode="async", keep=2, max_inflight=1) as ckpt:
        for step in range(1, 51):
            for tensor in state.values():
                tensor.add_(1.0)  # training changes the state between saves
            ckpt.save(state, step=step)
            if step in (5, 50):
                ckpt.wait()
                rss[step] = process.memory_info().rss
        assert ckpt.steps() == [49, 50]
        assert len(ckpt.records) == 50
    growth = rss[50] / rss[5] - 1
    print(
        f"\nRSS after save 5: {rss[5] / 2**20:.0f} MiB, after save 50: {rss[50] / 2**20:.0f} MiB "
        f"({growth:+.1%}); state 64 MiB"
    )
    assert growth < 0.05, f"host memory grew {growth:.1%} between save 5 and save 50"


@pytest.mark.parametrize("max_inflight", [1, 2])
def test_slow_target_makes_save_wait(tmp_path: Path, throttle: Throttle, max_inflight: int) -> None:
    throttle.delay_s = 0.05
    handles = []
    with Checkpointer(tmp_path / "run", mode="async", max_inflight=max_inflight) as ckpt:
        for step in range(1, 7):
            handles.append(ckpt.save(state_of(step), step=step))
            in_flight = sum(not h.done() for h in handles)
            assert in_flight <= max_inflight, f"{in_flight} saves in flight after save {step}"
        records = ckpt.wait()
        assert ckpt.steps() == list(range(1, 7))
    waited = [h.wait_s for h in handles]
    assert all(w > 0 for w in waited[max_inflight:]), waited  # backpressure, not a queue
    assert all(h.stall_s >= h.wait_s for h in handles)  # the wait counts as stall
    assert ckpt.timeline.to_pandas().query("kind == 'wait'").shape[0] >= 6 - max_inflight
    assert len(records) <= max_inflight


# -- the command line's generic errors ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: command"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["bench", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
        (["bench", "--size-mb", "lots"], "argument --size-mb: invalid float value: 'lots'"),
        (["bench", "--colour", "red"], "unrecognized arguments: --colour red"),
        (["probe"], "the following arguments are required: target"),
    ],
)
def test_cli_usage_errors_exit_2_and_touch_nothing(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    from nbckpt.cli import main

    monkeypatch.chdir(tmp_path)  # the defaults (data/checkpoints/bench) are relative to here
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("nbckpt") and "error: " in last and message.lower() in last.lower(), last
    assert os.listdir(tmp_path) == []
