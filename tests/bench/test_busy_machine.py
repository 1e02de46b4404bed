"""The bench on a busy machine: another process keeps one of the cores busy while it measures."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch

from nbckpt import bench
from nbckpt.bench import _stats
from tests.helpers.load import spinning_core


@pytest.fixture
def one_torch_thread() -> object:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield None
    torch.set_num_threads(threads)


def test_beside_a_spinning_core_torch_save_is_measurably_slower(
    tmp_path: Path, one_torch_thread: object
) -> None:
    """8 MiB saved every 2 steps of about 0.1 ms: torch-save's write (about 30 ms here, far more
    under load) costs tens of times the steps' own time in every cycle. On this machine the
    repeats of such a run disagree by a factor of 2.7 and more (the write's time depends on what
    else the disk and the cores do), so the cost must be that large to be measurable from three
    repeats every time: then every repeat shows it on its own cycles. nbckpt-async's save stall
    (its copy) is a fraction of torch-save's.

    What is not asserted: that nbckpt-async's whole overhead is below torch-save's. With a
    process spinning on one of two cores and training on the other, its background write has no
    idle core: it waits behind both at its lower priority (writer_nice), and the turn's wait for
    it is then as long as torch-save's own write, or longer (on this project's machine:
    wait for the earlier save 0.1-0.9 s per 16-32 MiB checkpoint against torch-save's 0.1-0.4 s
    stall). The bench shows that wait under its own name.
    """
    workload = bench.synthetic(8, compute_ms=0.1)
    with spinning_core() as spinner:
        comparison = bench.compare(
            workload,
            ["torch-save", "nbckpt-async"],
            str(tmp_path),
            steps=8,
            every=2,
            repeats=3,
            progress=None,
        )
        spun = sum(psutil.Process(spinner.pid).cpu_times()[:2])
        spinning = spinner.poll() is None
    rows = comparison.results.set_index("strategy")
    torch_save, ours = rows.loc["torch-save"], rows.loc["nbckpt-async"]
    lo = torch_save["overhead_ci_pct"][0]
    assert lo > 0, comparison.table()  # measurably slower than none
    assert "no measurable" not in _stats.overhead_text(torch_save.to_dict())
    assert torch_save["overhead_basis"] == "3 repeats, 12 cycles"
    assert all(value > 0 for value in torch_save["overhead_by_repeat_pct"])
    # the stall of one save: nbckpt-async's copy against torch-save's whole write, paired by
    # repeat, the median of the three: a save held up once on a loaded machine must not decide
    # it (in one CI run nbckpt-async's stall had a 95th percentile of 0.37 s and a mean of
    # 0.036 s, against torch-save's 0.027 s; quiet or beside two spinning cores here, 2-5 ms)
    by_repeat = comparison.runs.pivot(index="repeat", columns="strategy", values="save_stall_s")
    assert (by_repeat["nbckpt-async"] / by_repeat["torch-save"]).median() < 0.5, comparison.table()
    for row in (torch_save, ours):
        assert -100 < row["overhead_ci_pct"][0] <= row["overhead_pct"] <= row["overhead_ci_pct"][1]
        assert row["stall_mean_s"] == pytest.approx(row["save_stall_s"] + row["wait_s"])
    # the spinner ran throughout (its share of a core depends on what else the machine runs)
    assert spinning and spun > 0, spun
