"""Local ranks as a child process: ``torchrun --standalone --nproc-per-node N -m nbckpt bench``.

The sweep (``nbckpt bench --ranks 1,2,4``) and the notebook faces (``%ckpt_bench --ranks N``,
``Lab(ranks=N)``) start the bench's ranks through :class:`RankLaunch` and end them the same way,
whatever ends the run (it finished, a rank died, Stop, Ctrl-C, a closed Lab, the interpreter's
exit): torchrun starts in a session of its own (a Ctrl-C or Kernel > Interrupt reaches the caller
alone), every process under it is noted while it runs, and :meth:`RankLaunch.end` sends torchrun
SIGTERM (it passes it to its ranks, which clean up as after Ctrl-C), waits, and kills whatever
noted process is left; a Ctrl-C pressed again meanwhile kills what is left at once, and one while
torchrun starts is held until the launch can be ended. A rank that dies is named in one line
(:meth:`RankLaunch.failure`): which rank, its exit code or signal, and its last line on stderr
(torchrun tees each rank's stderr into a log folder of the launch's own, removed at the end).

With ``events``, every rank streams what it measures as it happens: ``nbckpt bench --events``
makes each rank write one JSON line per event and per progress line to its stdout
(:class:`EventWriter`; what else it prints goes to stderr), a pipe the caller reads
(:meth:`RankLaunch.read_events`). Each line is one ``write`` of at most ``PIPE_BUF`` bytes, so the
ranks' lines never interleave; the reader blocks on the pipe, it never polls. A rank never waits
for the reader: its lines go through a bounded queue to a writer thread of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import IO, Any

import psutil
import torch

from .._errors import CheckpointError, ConfigError
from .._util import run_target
from ..engine import Event
from ..engine._internal import deferred_interrupt
from ._compare import ComparisonInterrupted
from ._comparison import Comparison

__all__ = [
    "EVENT_KEY",
    "FLUSH_S",
    "QUEUED_LINES",
    "TERMINATE_S",
    "EventWriter",
    "RankLaunch",
    "arm_launch_seam",
    "decode",
    "failure_line",
    "last_line",
    "run_local_ranks",
    "torchrun_local",
]


def torchrun_local(size: int) -> list[str]:
    """The command that starts ``size`` ranks on this host under torchrun (what follows it: the
    script or ``-m module`` and their arguments)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(size)]


#: How long torchrun has to end its ranks after SIGTERM before every process left is killed.
TERMINATE_S = 20.0
#: The key that marks a rank's JSON line on the events pipe.
EVENT_KEY = "nbckpt"
#: A progress line longer than this is cut (JSON may spell a character in 6 bytes: PIPE_BUF).
_LINE_CHARS = 500
#: The lines a rank holds for a reader that fell behind (an event's is about 200 bytes, none
#: over PIPE_BUF: about 1 MiB, 16 MiB at most); more are counted and dropped (:class:`EventWriter`).
QUEUED_LINES = 4096
#: How long a rank's end waits for the reader to take the lines still queued.
FLUSH_S = 10.0
# torchrun's account of the first failure: "rank : 1 (local_rank: 1)", "exitcode : -9 (pid: 42)".
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", re.MULTILINE)
_ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
# How often at most the events' reader notes the processes under torchrun (a /proc walk).
_NOTE_EVERY_S = 0.5

# Launches not ended yet: ended at the interpreter's exit (a kernel shut down or restarted).
_running: weakref.WeakSet[RankLaunch] = weakref.WeakSet()
#: The test-only seam: ``seam(point, launch)`` at "started" (torchrun has just started, on the
#: caller's thread) and "ending" (torchrun has just been sent SIGTERM by :meth:`RankLaunch.end`).
_seam: Callable[[str, RankLaunch], None] | None = None


def arm_launch_seam(seam: Callable[[str, RankLaunch], None] | None) -> None:
    """Arm (None: disarm) the test-only seam, to press Ctrl-C at a defined point of a launch."""
    global _seam
    _seam = seam


def _reached(point: str, launch: RankLaunch) -> None:
    if _seam is not None:
        _seam(point, launch)


class EventWriter:
    """One rank's end of the events pipe (``nbckpt bench --events``): its events, their times on
    the wall clock (which the local ranks share), and its progress lines.

    The rank's threads (training, nbckpt's writers) only queue a line: a thread of the writer's
    own writes it, so a reader that falls a pipe's buffer (64 KiB) behind never blocks training.
    While the reader lives no line is lost unless it falls ``queued`` lines behind (memory stays
    bounded): the lines beyond are dropped, and their number is written on the stream as a progress
    line. A reader gone (the pipe closed) drops every line from then on and the run goes on.
    :meth:`close` gives the reader ``FLUSH_S`` to take what is queued, and says on stderr what it
    did not take."""

    def __init__(self, rank: int, fd: int, *, queued: int = QUEUED_LINES) -> None:
        self.rank, self.fd = rank, fd
        self.closed = False  # the reader is gone: the run goes on, its events are dropped
        self.dropped = 0  # lines dropped, the reader being ``queued`` lines behind, not yet said
        self._lock = threading.Lock()  # ``dropped``: counted on the rank's threads, said on the writer's
        self._lines: queue.Queue[bytes | None] = queue.Queue(queued)
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        self._writer = threading.Thread(target=self._write_all, name="nbckpt-events-writer", daemon=True)
        self._writer.start()

    @classmethod
    def on_stdout(cls) -> EventWriter:
        """Take this process's stdout for the events; what else it prints goes to stderr (a
        table, a warning: nothing can split a JSON line), and so do its children's."""
        sys.stdout.flush()
        fd = os.dup(1)  # not inheritable: the rank's own children never write to the pipe
        os.dup2(2, 1)
        return cls(int(os.environ.get("RANK", "0")), fd)

    def event(self, event: Event) -> None:
        self._write(
            {
                "kind": event.kind,
                "label": event.label,
                "step": event.step,
                "start_ns": event.start_ns + self._offset_ns,
                "end_ns": event.end_ns + self._offset_ns,
                "bytes": event.bytes,
            }
        )

    def line(self, text: str) -> None:
        self._write({"line": text[:_LINE_CHARS]})

    def close(self, timeout_s: float = FLUSH_S) -> None:
        """Write what is queued, the reader given ``timeout_s`` to take it, and close the pipe;
        what it did not take is said on stderr (the run has ended: nothing waits any longer)."""
        if not self._writer.is_alive():
            return
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):
            self._lines.put(None, timeout=timeout_s)
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():  # stuck in a write the reader does not take: left behind
            left = self._lines.qsize() + self.dropped
            print(
                f"nbckpt: rank {self.rank}: {left} events not delivered, the reader took none "
                f"for {timeout_s:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            return
        os.close(self.fd)

    def _write(self, record: dict[str, Any]) -> None:
        if self.closed:
            return
        try:
            self._lines.put_nowait(self._encoded(record))
        except queue.Full:
            with self._lock:
                self.dropped += 1

    def _encoded(self, record: dict[str, Any]) -> bytes:
        return (json.dumps({EVENT_KEY: self.rank, **record}) + "\n").encode()

    def _write_all(self) -> None:
        """The writer thread: each queued line in turn, then the number dropped meanwhile."""
        while (data := self._lines.get()) is not None:
            self._send(data)
            with self._lock:
                dropped, self.dropped = self.dropped, 0
            if dropped:
                behind = self._lines.maxsize
                said = f"rank {self.rank}: {dropped} events dropped: the reader fell {behind} lines behind"
                self._send(self._encoded({"line": said}))

    def _send(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            os.write(self.fd, data)  # <= PIPE_BUF: all at once, never between another's bytes
        except OSError:  # the reader is gone
            self.closed = True


def decode(line: str) -> Event | str:
    """A line of the events pipe: a rank's :class:`~nbckpt.Event` (``rank`` set, times on the
    wall clock), else the text to show (a rank's progress line, or a line not of the bench)."""
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or not isinstance(record.get(EVENT_KEY), int):
        return line
    if "line" in record:
        return str(record["line"])
    return Event(
        kind=str(record["kind"]),
        start_ns=int(record["start_ns"]),
        end_ns=int(record["end_ns"]),
        step=None if record.get("step") is None else int(record["step"]),
        rank=int(record[EVENT_KEY]),
        bytes=int(record.get("bytes") or 0),
        label=str(record.get("label", "")),
    )


def _signal_text(code: int) -> str:
    if code < 0 and -code in signal.valid_signals():
        return f": {signal.Signals(-code).name}"
    return ""


def last_line(log_dir: str, local_rank: int) -> str:
    """The last line local rank ``local_rank`` wrote on stderr: torchrun's log of it (``--tee 2
    --log-dir log_dir``), ``""`` when it wrote none."""
    pattern = os.path.join(glob.escape(log_dir), "*", "attempt_*", str(local_rank), "stderr.log")
    logs = glob.glob(pattern)
    if not logs:
        return ""
    with open(max(logs, key=os.path.getmtime), encoding="utf-8", errors="replace") as file:
        lines = [line.strip() for line in file if line.strip()]
    return lines[-1] if lines else ""


def failure_line(size: int, code: int, tail: str, log_dir: str) -> str:
    """One line for a torchrun of ``size`` ranks that exited with ``code``: which rank died, how,
    and its last line on stderr (from torchrun's root cause, ``tail`` its last stderr lines);
    else torchrun's own last line."""
    root = tail[tail.rfind("Root Cause") :] if "Root Cause" in tail else ""
    rank, exit_code = _ROOT_RANK.search(root), _ROOT_EXIT.search(root)
    if rank is None:
        last = [line for line in tail.splitlines() if line.strip()]
        return (
            f"torchrun with {size} ranks exited with code {code}"
            f"{_signal_text(code)}: {last[-1].strip() if last else 'no output'}"
        )
    how = ""
    if exit_code is not None:
        number = int(exit_code.group(1))
        how = f" (exit code {number}{_signal_text(number)})"
    said = last_line(log_dir, int(rank.group(2) or rank.group(1)))
    words = f"its last line on stderr: {said}" if said else "nothing on stderr"
    return f"rank {rank.group(1)} of {size} died{how}, {words}; torchrun ended the other ranks"


class RankLaunch:
    """``nbckpt bench`` on ``size`` local ranks under torchrun, started at once; read it with
    :meth:`stream` (stderr) and, with ``events``, :meth:`read_events` (stdout), end it with
    :meth:`end` (always: it is what leaves no process behind)."""

    def __init__(self, size: int, bench_argv: Sequence[str], json_path: str, *, events: bool = False) -> None:
        self.size = size
        self.log_dir = tempfile.mkdtemp(prefix="nbckpt-torchrun-")
        command = [
            *torchrun_local(size),
            "--tee",
            "2",  # each rank's stderr to the console (prefixed [defaultN]:) and to log_dir
            "--log-dir",
            self.log_dir,
            "-m",
            "nbckpt",
            "bench",
            *bench_argv,
            "--json",
            json_path,
            *(["--events"] if events else []),
        ]
        # Without events, rank 0's table: the caller prints its own.
        self._out: IO[str] | None = None if events else tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._events = events
        self._started = time.time()  # a process of the launch's group is no older
        try:
            self.proc = subprocess.Popen(
                command,
                stdout=subprocess.PIPE if events else self._out,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env={**os.environ},
            )
        except BaseException:
            shutil.rmtree(self.log_dir, ignore_errors=True)
            raise
        self.seen: dict[int, psutil.Process] = {}
        self._seen_lock = threading.Lock()  # noted from the readers, Stop's thread and end()
        self.tail: deque[str] = deque(maxlen=200)
        self.stopped = False  # by terminate(): its end is no failure
        self.orphans: list[str] = []  # the processes end() found left after torchrun, killed
        self._noted_at = 0.0
        self._reader: threading.Thread | None = None  # read_in_background's
        _running.add(self)
        _reached("started", self)

    def note(self) -> None:
        """Note every process under torchrun now (they are orphaned if torchrun dies first)."""
        self._noted_at = time.monotonic()
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(self.proc.pid).children(recursive=True)
            with self._seen_lock:
                for child in children:
                    self.seen.setdefault(child.pid, child)

    def stream(self, on_line: Callable[[str], None]) -> int:
        """Every line torchrun and its ranks print on stderr, to ``on_line`` as it comes, until
        torchrun ends; its exit code."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.note()
            self.tail.append(line)
            on_line(line)
        return self.proc.wait()

    def read_events(self, on_event: Callable[[Event], None], on_line: Callable[[str], None]) -> None:
        """Every rank's events and progress lines (``events``), as they come, until the ranks and
        torchrun have closed the pipe."""
        assert self.proc.stdout is not None
        # The reader closes the pipe, not end(): a close waits for the read under way, which a
        # process outside the launch still holding the pipe would make endless.
        with self.proc.stdout:
            for line in self.proc.stdout:
                if time.monotonic() - self._noted_at > _NOTE_EVERY_S:
                    self.note()
                item = decode(line)
                if isinstance(item, Event):
                    on_event(item)
                else:
                    on_line(item)

    def read_in_background(self, on_event: Callable[[Event], None], on_line: Callable[[str], None]) -> None:
        """:meth:`read_events` on a thread of its own; :meth:`end` waits for it."""
        self._reader = threading.Thread(
            target=self.read_events, args=(on_event, on_line), name="nbckpt-rank-events", daemon=True
        )
        self._reader.start()

    def reading(self) -> bool:
        """Whether the events' reader still reads (after :meth:`end`: a process that left the
        launch's group holds the pipe)."""
        return self._reader is not None and self._reader.is_alive()

    def terminate(self) -> None:
        """Ask torchrun to end its ranks, from any thread, at once; :meth:`end` waits for them."""
        self.stopped = True
        self.note()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def end(self) -> bool:
        """End torchrun (SIGTERM: it ends its ranks), then kill whatever noted is still running,
        wait for all of it and for the events' reader; remove the log folder. A Ctrl-C meanwhile
        (Kernel > Interrupt pressed again while the ranks clean up) kills what is left at once:
        True then, for the caller to raise once nothing is left (raised here, it would leave the
        ranks running)."""
        cut = False
        while True:
            try:
                self._end(kill=cut)
                return cut
            except KeyboardInterrupt:
                cut = True

    def _end(self, *, kill: bool) -> None:
        self.note()
        if self.proc.poll() is None and not kill:
            self.proc.terminate()
            _reached("ending", self)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=TERMINATE_S)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with self._seen_lock:
            noted = list(self.seen.values())
        left = [child for child in noted if child.is_running()]
        left += self._unnoted(left)
        for child in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.orphans.append(f"pid {child.pid} ({' '.join(child.cmdline())[:120]})")
                child.kill()  # psutil checks it is still the same process (no reused pid)
        psutil.wait_procs(left, timeout=TERMINATE_S)
        if self._reader is not None:  # every writer of the pipe is gone: it reads to the end
            self._reader.join(FLUSH_S)  # at most: a process that left the launch's group may hold it
        # A reader closes the events pipe itself (see read_events): closed here, the close would
        # wait for its read, endless while a process outside the launch still holds the pipe.
        for stream in (self.proc.stderr, None if self._reader else self.proc.stdout, self._out):
            if stream is not None:
                stream.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        _running.discard(self)

    def _unnoted(self, noted: list[psutil.Process]) -> list[psutil.Process]:
        """The processes of the launch's group (torchrun's session: every rank and what it
        started, unless it left the group) still running and not among ``noted``: a rank's child
        started after the last note, orphaned when the rank ended. Left running, one holding the
        events pipe kept the reader, and the launch, waiting for ever."""
        pids = {child.pid for child in noted}
        found = []
        for proc in psutil.process_iter(["create_time"]):
            try:
                ours = proc.pid not in pids and os.getpgid(proc.pid) == self.proc.pid
            except ProcessLookupError:
                continue
            if ours and proc.info["create_time"] >= self._started - 1:  # not a reused group id's
                found.append(proc)
        return found

    def failure(self, code: int) -> str:
        """One line: which rank died, how, and its last line on stderr."""
        return failure_line(self.size, code, "".join(self.tail), self.log_dir)


@atexit.register
def _end_running() -> None:
    """At the interpreter's exit (a kernel shut down or restarted): no rank outlives it."""
    for launch in list(_running):
        launch.end()


def run_local_ranks(
    size: int,
    bench_argv: Sequence[str],
    directory: str,
    *,
    on_event: Callable[[Event], None],
    on_line: Callable[[str], None],
    on_start: Callable[[RankLaunch], None] | None = None,
    json_path: str | None = None,
    device: str = "cpu",
) -> Comparison:
    """``nbckpt bench`` on ``size`` local ranks (``bench_argv``: its options, ``--dir
    directory`` among them), every rank's events to ``on_event`` and every line on stderr and
    progress line to ``on_line`` as they come; rank 0's comparison, with the job's figures
    (also written to ``json_path`` if given). ``on_start(launch)`` gets the launch to stop it
    from another thread (:meth:`RankLaunch.terminate`). With ``device="cuda"`` each rank takes
    a GPU of its own: more ranks than GPUs is a :class:`ConfigError`, before anything starts, as
    is a ``directory`` that cannot be written.

    A rank that dies: :class:`CheckpointError` naming it in one line. Stopped, or Ctrl-C here:
    :class:`~._compare.ComparisonInterrupted`. Either way no process is left and a ``directory``
    the run created is removed, as a one-process run's is.
    """
    if device == "cuda" and size > (gpus := torch.cuda.device_count()):
        raise ConfigError(f"{size} ranks on cuda want a GPU each; torch sees {gpus}")
    interrupted = f"the run on {size} ranks was interrupted; every rank has ended"
    with run_target(directory, "directory"), tempfile.TemporaryDirectory(prefix="nbckpt-ranks-") as scratch:
        out = json_path if json_path is not None else os.path.join(scratch, "bench.json")
        launch: RankLaunch | None = None
        try:
            with deferred_interrupt():  # a Ctrl-C raised once ``launch`` is set, and so ended below
                launch = RankLaunch(size, bench_argv, out, events=True)
            comparison = _follow(launch, out, on_event, on_line, on_start)
        except KeyboardInterrupt as exc:
            if isinstance(exc, ComparisonInterrupted):
                raise
            raise ComparisonInterrupted(interrupted) from None
        finally:
            cut = launch is not None and _end(launch, on_line)
        if cut:  # Ctrl-C as the finished run's ranks ended
            raise ComparisonInterrupted(interrupted)
    return comparison


def _follow(
    launch: RankLaunch,
    json_path: str,
    on_event: Callable[[Event], None],
    on_line: Callable[[str], None],
    on_start: Callable[[RankLaunch], None] | None,
) -> Comparison:
    """The launch's lines and events until torchrun ends; rank 0's comparison (its caller's
    :func:`_end` waits for the last events before it returns it)."""
    launch.read_in_background(on_event, on_line)
    if on_start is not None:
        on_start(launch)
    code = launch.stream(on_line)
    if code != 0 and launch.stopped:
        raise ComparisonInterrupted(f"the run on {launch.size} ranks was stopped; every rank has ended")
    if code != 0:
        raise CheckpointError(launch.failure(code))
    return Comparison.from_json(json_path)


def _end(launch: RankLaunch, on_line: Callable[[str], None]) -> bool:
    """End the launch (every process of it, a rank's orphans too) and wait for its events' reader,
    ``FLUSH_S`` at most: every event is in before the result. Says what it killed that torchrun
    left, and a pipe still held open (its events are left). True: a Ctrl-C cut the end short."""
    said = len(launch.orphans)
    cut = launch.end()
    for orphan in launch.orphans[said:]:
        on_line(f"nbckpt: killed {orphan}, a rank's process still running after torchrun ended")
    if launch.reading():
        on_line(f"nbckpt: the ranks' events pipe is still open after {FLUSH_S:g} s; its last events are lost")
    return cut
