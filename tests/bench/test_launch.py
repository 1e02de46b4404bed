"""The pieces of ``nbckpt.bench._launch`` that need no torchrun: the events' line format on a real
pipe, a rank whose reader falls behind or goes, and the one line that names a dead rank
(``tests/notebook/test_lab_ranks.py`` runs them under torchrun)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from helpers.sync import until

from nbckpt import CheckpointError, ConfigError
from nbckpt.bench import _launch
from nbckpt.bench._launch import EventWriter, decode, failure_line
from nbckpt.engine import Event

# torchrun's account of a failure, as it prints it on stderr (torch 2.x).
ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_07:16:30
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 10654)
  error_file: <N/A>
======================================================
"""


def test_a_ranks_events_and_lines_cross_a_pipe_as_one_json_line_each() -> None:
    read_fd, write_fd = os.pipe()
    writer = EventWriter(rank=3, fd=write_fd)
    now = time.perf_counter_ns()
    writer.event(Event("persist", now, now + 2_000_000, step=4, bytes=1 << 20, label="nbckpt-async"))
    writer.event(Event("step", now, now + 1000, label="none"))
    writer.line("[nbckpt-async] repeat 1/1, step 2/4 " + "x" * 5000)  # cut to fit one atomic write
    writer.close()  # written, and the pipe closed
    with os.fdopen(read_fd) as pipe:
        lines = pipe.readlines()
    assert len(lines) == 3 and all(len(line.encode()) <= 4096 for line in lines)
    persist, step, text = (decode(line) for line in lines)
    assert isinstance(persist, Event) and isinstance(step, Event)
    assert (persist.kind, persist.rank, persist.step, persist.bytes, persist.label) == (
        "persist",
        3,
        4,
        1 << 20,
        "nbckpt-async",
    )
    assert persist.end_ns - persist.start_ns == 2_000_000
    assert abs(persist.start_ns - time.time_ns()) < 60e9  # on the wall clock the ranks share
    assert step.step is None and step.label == "none"
    assert isinstance(text, str) and text.startswith("[nbckpt-async] repeat 1/1") and len(text) == 500
    # What is not a rank's record passes as text: a stray print, another JSON value.
    assert decode("hello\n") == "hello\n"
    assert decode(json.dumps({"other": 1})) == json.dumps({"other": 1})


def test_a_writer_whose_reader_is_gone_drops_its_events_and_the_run_goes_on() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    writer = EventWriter(rank=0, fd=write_fd)
    writer.line("nobody reads this")  # no BrokenPipeError into the bench
    writer.close()
    assert writer.closed


def test_a_reader_that_falls_behind_never_blocks_the_rank_and_is_told_what_it_missed() -> None:
    """Lines past the pipe's buffer and the writer's queue are dropped on the rank's thread at once
    (it blocked in ``os.write`` once 64 KiB were unread); the reader, once it reads, gets every
    other line in order and one line saying how many were dropped: the two add up."""
    read_fd, write_fd = os.pipe()
    writer = EventWriter(rank=1, fd=write_fd, queued=100)
    total = 2000  # about 200 KB of events: three times a pipe's buffer, and the queue's 100 more
    for step in range(total):  # the reader reads nothing meanwhile
        writer.event(Event("step", step, step + 1, step=step, label="none"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(os.fdopen(read_fd).readlines()))
    reader.start()
    writer.close()
    reader.join()
    decoded = [decode(line) for line in lines]
    steps = [item.step for item in decoded if isinstance(item, Event)]
    said = [item for item in decoded if isinstance(item, str)]
    assert steps == sorted(steps) and len(steps) < total, len(steps)
    assert len(said) >= 1 and all("events dropped: the reader fell 100 lines behind" in s for s in said), said
    assert len(steps) + sum(int(s.split()[2]) for s in said) == total, said


RANK_WITH_A_STALLED_READER = """
import sys, time
from nbckpt.bench._launch import EventWriter
from nbckpt.engine import Event
writer = EventWriter.on_stdout()  # as `nbckpt bench --events` does in each rank
for step in range(int(sys.argv[1])):  # a training loop: an event a step, 200 bytes each
    now = time.perf_counter_ns()
    writer.event(Event("step", now, now + 1000, step=step, label="none"))
open(sys.argv[2], "w").close()  # every step done, before the reader has read a line
writer.close()
"""


@pytest.mark.timeout(300)
def test_a_rank_whose_reader_does_not_read_still_finishes_its_steps(tmp_path: Path) -> None:
    """A real process writing its events to a pipe nobody reads yet (the notebook busy): it finishes
    its 2,000 steps (it blocked at the pipe's 64 KiB, after about 300), then, once the reader
    reads, every event arrives (none is lost while the reader lives), in order."""
    done = tmp_path / "done"
    with (tmp_path / "stderr").open("w") as errors:
        rank = subprocess.Popen(
            [sys.executable, "-c", RANK_WITH_A_STALLED_READER, "2000", str(done)],
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        try:
            finished = until(done.exists, timeout=120)
            out, _ = rank.communicate(timeout=120)
        finally:
            rank.kill()
    assert finished, (tmp_path / "stderr").read_text()[-2000:]
    assert rank.returncode == 0, (tmp_path / "stderr").read_text()[-2000:]
    steps = [item.step for item in map(decode, out.splitlines()) if isinstance(item, Event)]
    assert steps == list(range(2000))


def test_a_dead_rank_is_named_with_its_exit_and_its_last_line_on_stderr(tmp_path: Path) -> None:
    log = tmp_path / "run_abc" / "attempt_0" / "1" / "stderr.log"
    log.parent.mkdir(parents=True)
    log.write_text("[nbckpt-async] repeat 1/1\nRuntimeError: the disk is gone\n\n")
    assert failure_line(2, 1, ROOT_CAUSE.format(code=1), str(tmp_path)) == (
        "rank 1 of 2 died (exit code 1), its last line on stderr: RuntimeError: the disk is gone; "
        "torchrun ended the other ranks"
    )
    log.write_text("")
    assert failure_line(4, 1, ROOT_CAUSE.format(code=-9), str(tmp_path)) == (
        "rank 1 of 4 died (exit code -9: SIGKILL), nothing on stderr; torchrun ended the other ranks"
    )
    # No account of a rank (torchrun itself failed): its own last line.
    assert failure_line(2, 1, "starting\nValueError: bad rendezvous\n", str(tmp_path)) == (
        "torchrun with 2 ranks exited with code 1: ValueError: bad rendezvous"
    )


# torchrun's stand-in: a rank whose child (``sleep`` in a process of its own, its stderr elsewhere)
# holds the events pipe, its stdout, after the rank and torchrun have ended (started after the
# rank's last line: the launch may not have noted it); the child's pid goes to the file argv[1] names.
TORCHRUN_WITH_A_RANKS_CHILD = """
import subprocess, sys
print("rank 0 failed", file=sys.stderr, flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stderr=subprocess.DEVNULL)
with open(sys.argv[1], "w") as file:
    file.write(str(child.pid))
sys.exit(3)
"""


def test_a_ranks_child_holding_the_events_pipe_is_killed_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch ends its ranks and its events' reader whatever a rank's children do: a child
    left holding the pipe is killed (it is in the launch's process group) and named. Before, the
    reader waited for the pipe's end, and run_local_ranks with it, for ever (found by review)."""
    pid_file = tmp_path / "child.pid"
    monkeypatch.setattr(
        _launch,
        "torchrun_local",
        lambda size: [sys.executable, "-c", TORCHRUN_WITH_A_RANKS_CHILD, str(pid_file)],
    )
    lines: list[str] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            _launch.run_local_ranks(
                1, [], str(tmp_path / "run"), on_event=lambda event: None, on_line=lines.append
            )
        except BaseException as exc:
            raised.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(60)
    pid = int(pid_file.read_text())
    try:
        assert not runner.is_alive(), "run_local_ranks still waits for the events pipe"
        assert until(lambda: not running(pid))  # killed (its new parent reaps it)
        assert len(raised) == 1 and isinstance(raised[0], CheckpointError), raised
        assert "exited with code 3: rank 0 failed" in str(raised[0])
        assert any(f"killed pid {pid} " in line for line in lines), lines
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            if running(pid):
                psutil.Process(pid).kill()


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_directory_that_cannot_be_written_is_refused_before_torchrun_starts(tmp_path: Path) -> None:
    """``%ckpt_bench --ranks 2 -d`` and ``Lab(ranks=2)`` under a file: one line, no rank started."""
    target = str(tmp_path / "a-file" / "ckpt")
    (tmp_path / "a-file").write_text("not a directory")
    reached: list[str] = []
    _launch.arm_launch_seam(lambda point, launch: reached.append(point))
    try:
        with pytest.raises(ConfigError, match=f"^directory {re.escape(target)} is not writable"):
            _launch.run_local_ranks(2, ["--dir", target], target, on_event=print, on_line=print)
    finally:
        _launch.arm_launch_seam(None)
    assert reached == []  # torchrun never started
