"""AcceleratorCheckpointer with a real accelerate.Accelerator: the state it tracks, saved and restored."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch
from accelerate import Accelerator

from nbckpt import ConfigError, NbckptError
from nbckpt.integrations.accelerate import AcceleratorCheckpointer


class Counter:
    """An object registered for checkpointing, as accelerate wants it: state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = state["seen"]


def test_everything_the_accelerator_tracks_round_trips(tmp_path: Path) -> None:
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)

    def step() -> None:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        accelerator.step += 1

    with AcceleratorCheckpointer(accelerator, tmp_path, mode="sync") as ckpt:
        assert ckpt.restore() == 0  # nothing saved yet
        assert set(ckpt.state()) == {"model", "optimizer", "scheduler", "custom", "accelerator_step"}
        step()
        ckpt.save(1)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        draws = torch.rand(3)  # what the RNG gives after the save
        step()
        step()
        assert ckpt.restore() == 1
        assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
        assert counter.seen == 1 and accelerator.step == 1 and sched.scheduler.last_epoch == 1
        assert opt.state_dict()["state"][0]["step"] == 1
        assert torch.equal(torch.rand(3), draws)  # capture_rng is on


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must be an accelerate\.Accelerator"):
        AcceleratorCheckpointer(object(), tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decides capture_rng"):
        AcceleratorCheckpointer(Accelerator(cpu=True), tmp_path, capture_rng=False)


def test_the_private_lists_read_are_those_of_the_installed_accelerate(tmp_path: Path) -> None:
    """accelerate has no public view of what save_state saves (its pre-hook sees the models only):
    nbckpt reads five private lists, in _accelerate_compat alone. A release that renames one
    fails here, naming it, and AcceleratorCheckpointer says the same in one line."""
    import accelerate

    from nbckpt.integrations._accelerate_compat import missing, tracked

    accelerator = Accelerator(cpu=True)
    assert not missing(accelerator), (
        f"accelerate {accelerate.__version__} renamed {missing(accelerator)}: "
        "update nbckpt/integrations/_accelerate_compat.py"
    )
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert tracked(accelerator).models == [model]
    del accelerator._optimizers  # as a release that renamed the list would have it
    with (
        pytest.raises(
            NbckptError, match=rf"^accelerate {accelerate.__version__} keeps no Accelerator\._optimizers"
        ),
        AcceleratorCheckpointer(accelerator, tmp_path) as ckpt,
    ):
        ckpt.state()


def test_a_cell_run_again_takes_the_directory_over_unless_a_loop_runs_on_another_thread(
    tmp_path: Path,
) -> None:
    """Issue 31: a cell that makes an AcceleratorCheckpointer and trains, stopped by Ctrl-C before
    ``ckpt.close()`` and run again, made a second one on the directory while the first (still
    bound) held it: refused. The new one takes over (the first's saves committed); a loop still
    running on a thread of its own refuses it, by name."""
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 1))
    first = AcceleratorCheckpointer(accelerator, tmp_path)
    first.save(1)  # in flight: the cell's loop stopped here
    second = AcceleratorCheckpointer(accelerator, tmp_path)  # the cell again, `first` still bound
    assert second.restore() == 1 and first._ckpt is None

    saved, release = threading.Event(), threading.Event()

    def loop() -> None:
        second.save(2)
        saved.set()
        release.wait(120)

    running = threading.Thread(target=loop, name="loop")
    running.start()
    assert saved.wait(120)
    refused = "earlier AcceleratorCheckpointer of this process, training on thread 'loop'"
    with pytest.raises(ConfigError, match=refused):
        AcceleratorCheckpointer(accelerator, tmp_path)
    release.set()
    running.join()
    with AcceleratorCheckpointer(accelerator, tmp_path) as third:
        assert third.ckpt.steps() == [1, 2]
    first.close()  # taken over: nothing left to close
