"""``%ckpt_bench --ranks 2`` and ``Lab(ranks=2)``: the notebook faces on local ranks under torchrun.

Real torchrun, gloo, 1 MiB per rank, one strategy. Each launch earns its time: one run to the end
(the lanes of every rank and the job's figures), the others ended on purpose (Stop, Kernel >
Interrupt, a killed rank, a newer lab), each checked to leave no process behind by pid.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from helpers.kernel import RealKernel
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from nbckpt import ConfigError
from nbckpt.notebook._lab import SYNTHETIC, Lab, live_lab

BENCH = (
    "%ckpt_bench --ranks 2 -d {dir} --size-mb 1 --compute-ms 1 --strategies nbckpt-async "
    "--every {every} --repeats 1 --no-warmup --steps {steps}"
)
# Rank 0's progress line at a checkpoint of the first run that saves: every rank is writing.
IN_A_TURN = "[nbckpt-async] repeat 1/1, step "


def poll(condition: Callable[[], bool], timeout: float) -> None:
    """Until ``condition()`` holds: a state the run reaches (a safety net, not a limit)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _alive(processes: list[psutil.Process]) -> list[str]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{process.pid} {' '.join(process.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _files(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()] if folder.exists() else []


def _launched(parent: psutil.Process) -> list[psutil.Process]:
    """torchrun and every process under it, started by ``parent``."""
    found = []
    for child in parent.children():
        try:
            if "torch.distributed.run" in " ".join(child.cmdline()):
                found += [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:  # a child that ended meanwhile
            pass
    return found


def _rank(parent: psutil.Process, rank: int) -> psutil.Process | None:
    for process in _launched(parent):
        try:
            if process.environ().get("RANK") == str(rank):
                return process
        except psutil.NoSuchProcess:
            pass
    return None


# In JupyterLab's kernel: the live lab of the last %ckpt_bench, run until every rank writes.
_LAB = "from nbckpt.notebook._lab import live_lab\nlab = live_lab()"
_UNTIL_EVERY_RANK_WRITES = (
    "import time\ndeadline = time.monotonic() + 120\n"
    "lanes = lambda: list(lab.figure.layout.yaxis.categoryarray or ())\n"
    "while lab.running and not ('nbckpt-async r1 · background' in lanes() and lab.progress.value > 0):\n"
    "    assert time.monotonic() < deadline, 'the ranks wrote nothing in 120 s'\n"
    "    time.sleep(0.01)\n"
    "assert lab.running, lab.error"
)
_LAB_ENDED = (
    "deadline = time.monotonic() + 120\n"
    "while lab.running and time.monotonic() < deadline:\n    time.sleep(0.01)\n"
    "print(lab.running, lab.stopped, lab.interrupted, lab.error)\nprint(lab.message.value)"
)
INTERRUPTED = "the run on 2 ranks was interrupted; every rank has ended"
# Kernel > Interrupt pressed again while the ranks end (torchrun has just been sent SIGTERM).
PRESS_AGAIN = (
    "import signal\nfrom nbckpt.bench._launch import arm_launch_seam\n"
    "arm_launch_seam(lambda point, launch: point == 'ending' and signal.raise_signal(signal.SIGINT))"
)


def _interrupt(kernel: RealKernel, pid: int) -> list[psutil.Process]:
    """Kernel > Interrupt to the kernel (process ``pid``); what ran under its torchrun then."""
    launched = _launched(psutil.Process(pid))
    assert len(launched) >= 3  # torchrun and its 2 ranks at least
    kernel.km.interrupt_kernel()
    return launched


@pytest.mark.timeout(400)
def test_ckpt_bench_on_two_ranks_shows_a_lane_per_rank_and_the_job_and_an_interrupt_ends_every_rank(
    tmp_path: Path,
) -> None:
    """Kernel > Interrupt in %ckpt_bench --ranks 2 (the cell waits; pressed twice) and in its live
    lab (the kernel idle, the run in the lab's threads): every rank and torchrun end, by pid,
    nothing is left on disk, and the kernel goes on: a next cell, a whole run to the end."""
    kernel = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1"})
    try:
        kernel.run("%load_ext nbckpt")
        pid = int(kernel.evaluate("__import__('os').getpid()"))
        # In the foreground, while the ranks write, and again while they end (an impatient user):
        # one line, no process or file left, and the kernel runs the next cell.
        kernel.run(PRESS_AGAIN)
        msg_id = kernel.send(BENCH.format(dir=tmp_path / "i", every=5, steps=100_000))
        kernel.output(msg_id, until=lambda out: IN_A_TURN in out, timeout=240)
        launched = _interrupt(kernel, pid)
        assert kernel.outputs(msg_id, timeout=120)["error"] == f"KeyboardInterrupt: {INTERRUPTED}\n"
        assert kernel.reply(msg_id)["status"] == "error"
        assert _alive(launched) == [] and _files(tmp_path / "i") == []
        assert kernel.run("arm_launch_seam(None)\nprint(6 * 7)") == "42\n"

        # The next run goes to the end (no JupyterLab: static figures from every rank's events).
        msg_id = kernel.send("c = " + BENCH.format(dir=tmp_path / "b", every=2, steps=4))
        figures = {}
        for kind, body in kernel._messages(msg_id, timeout=240):
            if kind == "display_data" and "application/vnd.plotly.v1+json" in body["data"]:
                layout = body["data"]["application/vnd.plotly.v1+json"]["layout"]
                figures[layout["title"]["text"]] = layout
        assert kernel.reply(msg_id)["status"] == "ok"
        timeline = next(layout for title, layout in figures.items() if title.startswith("Timeline"))
        assert {"nbckpt-async r0 · train", "nbckpt-async r1 · background"} <= set(
            timeline["yaxis"]["categoryarray"]
        )
        assert any("straggler" in title for title in figures)  # the stall over ranks
        assert any("Aggregate write rate" in title for title in figures)
        job = json.loads(kernel.run("import json\nprint(json.dumps(c.job, default=str))"))
        assert job["world_size"] == 2
        (row,) = [row for row in job["strategies"] if row["strategy"] == "nbckpt-async"]
        assert row["aggregate_write_gbs"] > 0 and row["stall_s"]["max"] >= row["stall_s"]["median"] > 0
        assert "on 2 ranks, 1 host(s)" in kernel.run("print(c.table())")

        # The live lab in JupyterLab, the kernel idle: its run on ranks ends as Stop's does.
        kernel.run(BENCH.format(dir=tmp_path / "lab", every=5, steps=100_000), lab=True)
        kernel.run(_LAB + "\n" + _UNTIL_EVERY_RANK_WRITES)  # returns at its idle status
        launched = _interrupt(kernel, pid)
        state, message = kernel.run(_LAB_ENDED).splitlines()
        assert state == "False True True None", message  # stopped, interrupted, no error
        assert "Interrupted (Kernel &gt; Interrupt): the run on 2 ranks was stopped" in message
        assert _alive(launched) == [] and _files(tmp_path / "lab") == []
        assert kernel.run("lab.close()\nprint(6 * 7)") == "42\n"
    finally:
        kernel.close()


@pytest.mark.timeout(300)
def test_a_lab_on_two_ranks_streams_every_rank_and_stop_a_dead_rank_or_a_new_lab_ends_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = psutil.Process()
    lab = Lab(
        str(tmp_path / "lab"),
        preset=SYNTHETIC,
        size_mb=1.0,
        strategies=("nbckpt-async",),
        steps=100_000,
        every=5,
        repeats=1,
        compute_ms=1.0,
        warmup=False,
        refresh_s=0.05,
        ranks=2,
    )

    def lanes() -> list[str]:
        return list(lab.figure.layout.yaxis.categoryarray or ())

    # Stop while every rank writes: their lanes grew live; every rank ends, nothing left on disk.
    assert lab.run(), lab.error
    # The lanes and the progress bar change in one update of the lab's thread: wait for both.
    poll(
        lambda: ("nbckpt-async r1 · background" in lanes() and lab.progress.value > 0) or not lab.running, 240
    )
    assert "nbckpt-async r0 · train" in lanes() and lab.progress.value > 0, lab.error
    launched = _launched(me)
    assert len(launched) >= 3
    lab.stop_button.click()
    assert lab.wait(120) and lab.stopped and lab.error is None
    assert "Stopped: the run on 2 ranks was stopped; every rank has ended" in lab.message.value
    assert _alive(launched) == [] and _files(tmp_path / "lab") == []

    # A rank that dies: named in one line, the other ended by torchrun.
    assert lab.run(), lab.error
    poll(lambda: _rank(me, 1) is not None, timeout=120)
    launched = _launched(me)
    victim = _rank(me, 1)
    assert victim is not None
    os.kill(victim.pid, signal.SIGKILL)
    assert lab.wait(120)
    assert lab.error == (
        "Checkpoint failed: rank 1 of 2 died (exit code -9: SIGKILL), nothing on stderr; "
        "torchrun ended the other ranks"
    )
    assert _alive(launched) == []

    # Re-running the cell: the new lab ends the old one's ranks.
    assert lab.run(), lab.error
    poll(lambda: _rank(me, 1) is not None, timeout=120)
    launched = _launched(me)
    capsys.readouterr()
    newer = Lab(str(tmp_path / "lab"), ranks=2)
    assert "stopped the previous lab's run" in capsys.readouterr().out
    assert lab.closed and not lab.running and live_lab() is newer
    assert _alive(launched) == []
    newer.close()


def test_a_lab_shows_a_run_on_many_ranks_with_a_lane_per_rank_and_the_jobs_figures(tmp_path: Path) -> None:
    """What a run on ranks ends with, from a torchrun JSON (rank 1 made slow: the straggler)."""
    from nbckpt.bench import Comparison
    from nbckpt.notebook._magic_args import bench_parser

    # What %ckpt_bench --ranks N shows in JupyterLab: a lab with N in its ranks field.
    lab = Lab.from_args(bench_parser(None).parse_argstring(f"--ranks 2 --size-mb 1 -d {tmp_path / 'lab'}"))
    assert lab.ranks.value == 2 and lab.preset.value == SYNTHETIC
    lab.show(Comparison.from_json(Path(__file__).parents[1] / "data" / "bench_job_2ranks.json"))
    lanes = set(lab.figure.layout.yaxis.categoryarray)
    assert {"nbckpt-async r0 · train", "nbckpt-async r1 · background", "dcp-sync r1 · train"} <= lanes
    assert "Job: 2 ranks on 1 host(s)" in lab.results.value and "aggregate write GB/s" in lab.results.value
    assert "straggler rank 1 on vm" in lab.results.value  # the conclusions under the job's table
    assert lab.job_figure is not None and lab.job_box.children == (lab.job_figure,)
    symbols = [getattr(trace.marker, "symbol", None) or () for trace in lab.job_figure.data]
    assert any("star" in symbol for symbol in symbols)  # the straggler
    assert lab.job_figure.layout.title.text.startswith("Stall per checkpoint on each rank")
    shown = lab.job_figure
    lab.ranks.value = 0
    assert not lab.run() and lab.error == "ranks must be a positive integer, not 0"
    lab.close()
    assert shown.comm is None  # closed with the lab: nothing of it stays in the kernel
    with pytest.raises(ConfigError, match="ranks must be a positive integer, not -1"):
        Lab(str(tmp_path / "lab"), ranks=-1)


def test_more_ranks_than_gpus_is_one_line_before_anything_starts(
    ip: InteractiveShell, tmp_path: Path
) -> None:
    import torch

    gpus = torch.cuda.device_count()
    ranks = max(gpus + 1, 2)
    with pytest.raises(UsageError, match=f"^{ranks} ranks on cuda want a GPU each; torch sees {gpus}$"):
        ip.run_line_magic("ckpt_bench", f"--ranks {ranks} --device cuda -d {tmp_path / 'b'}")
    assert _launched(psutil.Process()) == [] and not (tmp_path / "b").exists()
