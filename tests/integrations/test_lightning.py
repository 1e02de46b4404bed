"""NbckptCheckpointIO under a real Lightning Trainer: top-k, last, resume, load, DDP rank 0 alone."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

import pytest

pytest.importorskip("lightning")

import lightning.pytorch as pl
import torch
from helpers.faults import armed
from helpers.ranks import RankProcess, finish_all, free_port
from integrations.lit_app import TinyModel, data, digest, fit, trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from nbckpt import Checkpointer, CheckpointError, ConfigError, CustomSteps, SaveSchedule
from nbckpt.integrations import export, load
from nbckpt.integrations._common import pointer_bytes, read_pointer
from nbckpt.integrations.lightning import (
    ROOT_NAME,
    NbckptCheckpointIO,
    ScheduledCheckpoint,
    load_checkpoint,
    load_from_checkpoint,
)

WORKER = Path(__file__).with_name("lit_app.py")


def _names(directory: Path) -> dict[str, int]:
    """Each pointer in ``directory`` (a file naming a step of its nbckpt directory) and that step;
    neither reservations nor Lightning's own links."""
    out = {}
    for path in directory.iterdir():
        pointer = None if path.is_symlink() else read_pointer(path)
        if pointer is not None and pointer[1]:
            out[path.name] = pointer[0]
    return out


def _steps(directory: Path) -> list[int]:
    with Checkpointer(directory / ROOT_NAME, read_only=True, ranks="local") as ckpt:
        return ckpt.steps()


@pytest.mark.parametrize("save_last", [True, "link"])
def test_topk_and_last_resume_bit_identical(tmp_path: Path, save_last: bool | Literal["link"]) -> None:
    straight, t = fit(tmp_path / "straight", 4, save_last=save_last)
    callback = t.checkpoint_callback
    names = _names(tmp_path / "straight")
    kept = {Path(p).name for p in callback.best_k_models}  # type: ignore[union-attr]
    assert len(kept) == 2
    if save_last is True:
        assert set(names) == kept | {"last.ckpt"}
        # last and the newest epoch are one state: one step carries both names
        assert names["last.ckpt"] == names["epoch=3-step=32.ckpt"]
    else:
        assert set(names) == kept
        link = tmp_path / "straight" / "last.ckpt"
        assert link.is_symlink() and os.readlink(link) == "epoch=3-step=32.ckpt"
        assert load_checkpoint(link)["global_step"] == 32  # Lightning's link to a pointer reads through
    # top-k removals and moved names left no step behind, and every name has its step
    assert _steps(tmp_path / "straight") == sorted(set(names.values()))

    fit(tmp_path / "resumed", 2, save_last=save_last)
    resumed, t2 = fit(tmp_path / "resumed", 4, resume=True, save_last=save_last)
    assert t2.global_step == t.global_step == 32
    assert digest(resumed) == digest(straight)
    # the optimizer and scheduler came back too (their state drives the last two epochs)
    assert t2.lr_scheduler_configs[0].scheduler.last_epoch == 4
    state = t2.optimizers[0].state_dict()["state"]
    expected = t.optimizers[0].state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"], expected[k]["exp_avg"]) for k in expected)


def test_load_from_checkpoint_and_export(tmp_path: Path) -> None:
    model, t = fit(tmp_path, 2)
    best = t.checkpoint_callback.best_model_path  # type: ignore[union-attr]
    assert Path(best).name in _names(tmp_path)
    loaded = load_from_checkpoint(TinyModel, best)
    assert loaded.hparams["tag"] == tmp_path  # a pathlib.Path hyperparameter comes back a Path
    assert digest(loaded) != digest(TinyModel())
    # a real Lightning checkpoint, loadable by Lightning alone
    out = export(best, tmp_path / "best-export.ckpt")
    plain = TinyModel.load_from_checkpoint(out, weights_only=False)
    assert digest(plain) == digest(loaded)
    assert torch.load(out, weights_only=False)["global_step"] == int(best.split("step=")[1].split(".")[0])
    # the plug-in itself reads what it wrote, and a file Lightning wrote itself
    io = NbckptCheckpointIO()
    assert io.load_checkpoint(best)["state_dict"].keys() == model.state_dict().keys()
    assert (
        io.load_checkpoint(out, weights_only=False)["global_step"]
        == torch.load(out, weights_only=False)["global_step"]
    )


def test_a_pointer_is_a_small_file_that_torch_load_refuses_naming_what_reads_it(tmp_path: Path) -> None:
    """Issue 31, item 5: every ``.ckpt`` was a symlink to a step directory (``os.path.isfile``
    False, ``torch.load`` raised IsADirectoryError; 48 of Lightning's own tests failed on it). A
    pointer is a regular file of a few hundred bytes, and ``torch.load`` of it (weights-only too,
    so it holds no global) and Lightning's own ``load_from_checkpoint`` raise a message that
    names what reads it."""
    model, t = fit(tmp_path, 2)
    best = Path(t.checkpoint_callback.best_model_path)  # type: ignore[union-attr]
    for path in (best, tmp_path / "last.ckpt"):
        assert path.is_file() and not path.is_symlink() and path.stat().st_size < 1024
        assert os.path.isfile(os.path.realpath(path))
    said = r"nbckpt pointer to \.nbckpt/step-0*\d+ beside it: read it with nbckpt\.integrations\.lightning\."
    for weights_only in (True, False):
        with pytest.raises(RuntimeError, match=said):
            torch.load(best, weights_only=weights_only)
    with pytest.raises(RuntimeError, match=r"load_from_checkpoint\(Model, path\)"):
        TinyModel.load_from_checkpoint(best)
    # torch's legacy magic number, pickled, opens every pointer (as docs/format.md spells it)
    assert best.read_bytes()[:15].hex(" ") == "80 02 8a 0a 6c fc 9c 46 f9 20 6a a8 50 19 2e"
    assert digest(load_from_checkpoint(TinyModel, tmp_path / "last.ckpt")) == digest(model)
    # a pointer copied away from its .nbckpt folder says what travels alone
    (tmp_path / "away").mkdir()
    (tmp_path / "away" / "copy.ckpt").write_bytes(best.read_bytes())
    with pytest.raises(ConfigError, match=r"which is not there .*nbckpt\.integrations\.export"):
        load(tmp_path / "away" / "copy.ckpt")


def test_a_file_that_is_not_a_pointer_is_never_taken_for_one(tmp_path: Path) -> None:
    """A pointer is a regular file, as Lightning's own checkpoint is: a name holding a file nbckpt
    did not write (Lightning's torch.save, a pointer torn short or grown long, a FIFO) names no
    step, is left where it is by the plug-in, and loads with Lightning's own IO where it is one."""
    torch.save({"epoch": 7, "w": torch.ones(2)}, tmp_path / "lightning.ckpt")
    whole = pointer_bytes(1)
    (tmp_path / "torn.ckpt").write_bytes(whole[:-9])
    (tmp_path / "long.ckpt").write_bytes(whole + b" " * 4096)
    os.mkfifo(tmp_path / "fifo.ckpt")
    for name in ("lightning.ckpt", "torn.ckpt", "long.ckpt", "fifo.ckpt", "missing.ckpt", ""):
        assert read_pointer(tmp_path / name) is None, name  # "": the directory itself
    io = NbckptCheckpointIO(mode="sync")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a.ckpt")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "lightning.ckpt", weights_only=True)["epoch"] == 7
    io.teardown()
    assert _steps(tmp_path) == [2] and _names(tmp_path) == {"b.ckpt": 2}
    left = ["b.ckpt", "fifo.ckpt", "lightning.ckpt", "long.ckpt", "torn.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ROOT_NAME, *left]
    with pytest.raises(ConfigError, match=r"torn\.ckpt is neither an nbckpt step directory nor a pointer"):
        load(tmp_path / "torn.ckpt")


class _SavesWhileACommitIsHeld(pl.Callback):
    """After epoch 1's first step, holds the commit of the saves that follow and saves through the
    Trainer: what the name holds when ``trainer.save_checkpoint`` returns (a save that finished
    before returning would have waited for the held commit, up to 60 s, and then failed)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.returned: tuple[int, bool] | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.current_epoch != 1 or self.returned is not None:
            return
        ckpt = trainer.strategy.checkpoint_io._roots[str(self.root / ROOT_NAME)]  # type: ignore[attr-defined]
        ckpt.wait()  # the epoch's own save committed: the next one may start at once
        gate, commit = threading.Event(), ckpt.store.commit

        def held_commit(*args: Any) -> Any:
            assert gate.wait(60)
            return commit(*args)

        ckpt.store.commit = held_commit
        trainer.save_checkpoint(self.root / "inside.ckpt")
        self.returned = read_pointer(self.root / "inside.ckpt")
        gate.set()


def test_a_save_outside_a_run_is_durable_and_leaves_no_thread(tmp_path: Path) -> None:
    """Lightning's conftest fails a test that leaves a thread (10 of its tests): a
    ``trainer.save_checkpoint`` after ``fit`` opened the directory again, and its threads stayed
    until the next fit's end or the exit. No teardown follows such a save, so it finishes before
    returning; one inside ``fit`` returns before its commit, as every save of a run does."""
    model = TinyModel()
    held = _SavesWhileACommitIsHeld(tmp_path)
    t = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=tmp_path), held],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(model, data())
    assert held.returned is not None and held.returned[1] is False  # reserved, not committed yet
    before = set(threading.enumerate())
    t.save_checkpoint(tmp_path / "after.ckpt")
    assert set(threading.enumerate()) <= before  # nbckpt's threads ended with the save
    assert read_pointer(tmp_path / "after.ckpt") == (max(_steps(tmp_path)), True)
    assert digest(load_from_checkpoint(TinyModel, tmp_path / "after.ckpt")) == digest(model)
    assert _names(tmp_path)["inside.ckpt"] == held.returned[0]


def test_pointer_written_only_after_commit(tmp_path: Path) -> None:
    io = NbckptCheckpointIO()
    net = torch.nn.Linear(8, 8)
    gate = threading.Event()
    io.save_checkpoint({"state_dict": net.state_dict(), "epoch": 0}, tmp_path / "warm.ckpt")
    ckpt = io._roots[str(tmp_path / ROOT_NAME)]
    ckpt.wait()
    store = ckpt.store
    commit = store.commit

    def held_commit(*args: Any) -> str:
        assert gate.wait(60)
        return commit(*args)

    store.commit = held_commit  # type: ignore[method-assign,assignment]
    with torch.no_grad():
        net.weight.add_(1)
    target = tmp_path / "epoch=1.ckpt"
    io.save_checkpoint({"state_dict": net.state_dict(), "epoch": 1}, target)
    # copied, not committed: no pointer yet, but the name is taken (ModelCheckpoint's version
    # counter asks whether it exists: it handed a name out again while its save was in flight)
    assert "epoch=1.ckpt" not in _names(tmp_path) and target.exists() and not target.is_symlink()
    again = tmp_path / "warm.ckpt"
    io.save_checkpoint({"state_dict": net.state_dict(), "epoch": 1}, again)
    assert _names(tmp_path)["warm.ckpt"] == 1  # a name in use keeps its old pointer until the commit
    gate.set()
    io.teardown()
    assert _names(tmp_path)["epoch=1.ckpt"] == _names(tmp_path)["warm.ckpt"] == max(_steps(tmp_path))
    assert torch.equal(io.load_checkpoint(target)["state_dict"]["weight"], net.weight)


def test_a_version_counted_name_is_never_handed_out_twice(tmp_path: Path) -> None:
    """Issue 31, item 2: ``filename="test"``, a monitor and ``save_top_k=-1`` over 4 epochs keep
    test, test-v1, test-v2 and test-v3, as Lightning's own IO does (nbckpt kept two: a name whose save was in
    flight did not exist yet, so it was reused and the step it named deleted); each name holds
    its own epoch, and one saved a moment ago loads at once."""
    model = TinyModel()
    trainer = pl.Trainer(
        max_epochs=4,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="test", monitor="train_loss", save_top_k=-1)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())
    names = _names(tmp_path)
    assert sorted(names) == ["test-v1.ckpt", "test-v2.ckpt", "test-v3.ckpt", "test.ckpt"], names
    assert len(set(names.values())) == 4 and _steps(tmp_path) == sorted(names.values())
    epochs = [load(tmp_path / name)["epoch"] for name in ("test.ckpt", "test-v1.ckpt", "test-v2.ckpt")]
    assert epochs == [0, 1, 2]


def test_a_name_saved_a_moment_ago_loads_at_once(tmp_path: Path) -> None:
    """Issue 31, item 2: ``trainer.save_checkpoint(p)`` then ``load_from_checkpoint(Model, p)``
    (or ``fit(ckpt_path=p)``) found no ``p`` while its save was in flight."""
    model, trainer = fit(tmp_path / "run", 1)
    target = tmp_path / "run" / "manual.ckpt"
    trainer.save_checkpoint(target)
    loaded = load_from_checkpoint(TinyModel, target)
    assert digest(loaded) == digest(model)
    trainer.strategy.checkpoint_io.teardown()


def test_remove_and_rename_free_steps(tmp_path: Path) -> None:
    io = NbckptCheckpointIO(mode="sync")
    net = torch.nn.Linear(4, 4)
    io.save_checkpoint({"w": net.state_dict(), "epoch": 0}, tmp_path / "a.ckpt")
    io.save_checkpoint({"w": net.state_dict(), "epoch": 0}, tmp_path / "last.ckpt")  # same state
    assert _names(tmp_path) == {"a.ckpt": 1, "last.ckpt": 1}
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert _steps(tmp_path) == [1]  # still named by last
    with torch.no_grad():
        net.weight.mul_(2)  # in place: same storage, new version: a new step
    io.save_checkpoint({"w": net.state_dict(), "epoch": 1}, tmp_path / "last.ckpt")
    io.save_checkpoint({"w": net.state_dict(), "epoch": 1}, tmp_path / "b.ckpt")
    assert _names(tmp_path) == {"last.ckpt": 2, "b.ckpt": 2}
    # the same tensors with a value changed: a step of its own (a pointer names a step, no more)
    with pytest.warns(UserWarning, match=r"step 3 holds 'epoch', 'tag', 'w', the newest step \(2\) holds"):
        io.save_checkpoint({"w": net.state_dict(), "epoch": 2, "tag": None}, tmp_path / "c.ckpt")
    assert _steps(tmp_path) == [2, 3]  # a key more is another shape: a step of its own
    io.save_checkpoint({"w": net.state_dict(), "epoch": 5, "tag": "x"}, tmp_path / "d.ckpt")
    assert _names(tmp_path)["d.ckpt"] == 4
    assert io.load_checkpoint(tmp_path / "d.ckpt")["epoch"] == 5 and load(tmp_path / "c.ckpt")["tag"] is None
    io.remove_checkpoint(tmp_path / "b.ckpt")
    io.remove_checkpoint(tmp_path / "c.ckpt")
    io.wait()
    assert io.host_bytes >= 2 * net.weight.nbytes  # staging held until teardown
    io.teardown()
    assert io.host_bytes == 0
    assert [r.step for r in io.records] == [1, 2, 3, 4]  # six names, four writes
    assert _names(tmp_path) == {"last.ckpt": 2, "d.ckpt": 4}
    assert _steps(tmp_path) == [2, 4]
    assert load(tmp_path / "d.ckpt")["tag"] == "x" and load(tmp_path / "last.ckpt")["epoch"] == 1


def test_a_removed_name_frees_its_step_at_the_next_commit_without_waiting(tmp_path: Path) -> None:
    # The engine's retention deletes (keep=CustomSteps of the named steps): a removal while a
    # save is in flight neither waits for it nor leaves the unnamed step behind once it commits.
    io = NbckptCheckpointIO()
    net = torch.nn.Linear(4, 4)
    io.save_checkpoint({"w": net.state_dict()}, tmp_path / "a.ckpt")
    io.wait()
    ckpt = io._roots[str(tmp_path / ROOT_NAME)]
    assert isinstance(ckpt.config.keep, CustomSteps)
    gate = threading.Event()
    commit = ckpt.store.commit

    def held_commit(*args: Any) -> str:
        assert gate.wait(60)
        return commit(*args)

    ckpt.store.commit = held_commit  # type: ignore[method-assign,assignment]
    with torch.no_grad():
        net.weight.add_(1)
    io.save_checkpoint({"w": net.state_dict()}, tmp_path / "b.ckpt")  # held before its commit
    remover = threading.Thread(target=io.remove_checkpoint, args=(tmp_path / "a.ckpt",))
    remover.start()
    remover.join(60)
    assert not remover.is_alive()  # the removal did not wait for the save in flight
    gate.set()
    io.wait()  # not teardown: the commit's own retention pass deleted step 1
    assert _steps(tmp_path) == [2] and _names(tmp_path) == {"b.ckpt": 2}
    io.teardown()


def test_a_name_removed_by_a_plugin_that_never_opened_its_folder_takes_its_step(tmp_path: Path) -> None:
    """``ddp_fork`` (issue 31, item 1): rank 0's forked worker saves the final weights to a
    temporary ``.temp.ckpt``; the main process, whose plug-in never opened that folder, loads and
    removes it. No commit follows there, so the step stayed: a copy of the weights per fit. A
    folder another plug-in holds is left to that plug-in's next commit."""
    writer = NbckptCheckpointIO()  # the forked worker's plug-in: its folder holds that one step
    writer.save_checkpoint({"w": torch.ones(4)}, tmp_path / "alone" / ".temp.ckpt")
    writer.teardown()
    NbckptCheckpointIO().remove_checkpoint(tmp_path / "alone" / ".temp.ckpt")
    assert _steps(tmp_path / "alone") == []  # the newest step too (retention never deletes it)
    writer = NbckptCheckpointIO()
    writer.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a" / ".temp.ckpt")
    writer.save_checkpoint({"w": torch.ones(4)}, tmp_path / "a" / "kept.ckpt")
    writer.teardown()
    main = NbckptCheckpointIO()
    main.remove_checkpoint(tmp_path / "a" / ".temp.ckpt")
    assert _steps(tmp_path / "a") == [2] and _names(tmp_path / "a") == {"kept.ckpt": 2}
    assert main._roots == {}  # released at once: no thread, no lock left in the main process
    holder = NbckptCheckpointIO()
    holder.save_checkpoint({"w": torch.ones(4)}, tmp_path / "b" / "x.ckpt")
    holder.wait()
    main.remove_checkpoint(tmp_path / "b" / "x.ckpt")  # no error: the holder deletes its step
    assert _names(tmp_path / "b") == {} and main._roots == {}
    holder.save_checkpoint({"w": torch.zeros(4)}, tmp_path / "b" / "y.ckpt")
    holder.teardown()
    assert _steps(tmp_path / "b") == [2]


def test_orphan_steps_of_a_killed_run_are_collected(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / ROOT_NAME, mode="sync") as ckpt:
        ckpt.save({"x": torch.ones(3)}, step=7)  # committed, but its pointer was never written
    io = NbckptCheckpointIO()
    io.save_checkpoint({"x": torch.zeros(3)}, tmp_path / "new.ckpt")
    io.teardown()
    assert _steps(tmp_path) == [8]
    assert _names(tmp_path) == {"new.ckpt": 8}


def test_earlier_releases_pointers_keep_loading_and_become_pointer_files(tmp_path: Path) -> None:
    """The previous release's pointers are symlinks to their steps, the one before's JSON files:
    a symlink loads as it is (every reader), and the next plug-in on the directory rewrites both
    as this release's pointer files naming the same steps, which retention keeps."""
    with Checkpointer(tmp_path / ROOT_NAME, mode="sync") as ckpt:
        ckpt.save({"x": torch.full((3,), 4.0)}, step=4)
        ckpt.save({"x": torch.full((3,), 5.0)}, step=5)
    old = {"format": "nbckpt-pointer/1", "root": ROOT_NAME, "step": 5}
    (tmp_path / "last.ckpt").write_text(json.dumps(old))
    os.symlink(os.path.join(ROOT_NAME, "step-000004"), tmp_path / "epoch=3.ckpt")
    assert torch.equal(load(tmp_path / "epoch=3.ckpt")["x"], torch.full((3,), 4.0))
    assert torch.equal(load_checkpoint(tmp_path / "epoch=3.ckpt")["x"], torch.full((3,), 4.0))
    assert NbckptCheckpointIO().load_checkpoint(tmp_path / "epoch=3.ckpt")["x"][0] == 4.0
    with pytest.raises(ConfigError, match="a pointer file of an earlier nbckpt"):
        load(tmp_path / "last.ckpt")
    io = NbckptCheckpointIO()
    io.save_checkpoint({"x": torch.zeros(3)}, tmp_path / "new.ckpt")  # opens the directory
    io.teardown()
    assert _names(tmp_path) == {"epoch=3.ckpt": 4, "last.ckpt": 5, "new.ckpt": 6}
    assert _steps(tmp_path) == [4, 5, 6] and not (tmp_path / "epoch=3.ckpt").is_symlink()
    assert torch.equal(io.load_checkpoint(tmp_path / "last.ckpt")["x"], torch.full((3,), 5.0))


def test_a_directory_at_a_name_is_removed_whole(tmp_path: Path) -> None:
    (tmp_path / "epoch=0.ckpt").mkdir()  # as an older run may have left it
    (tmp_path / "epoch=0.ckpt" / "data").write_bytes(b"x")
    io = NbckptCheckpointIO()
    io.remove_checkpoint(tmp_path / "epoch=0.ckpt")
    io.teardown()
    assert not (tmp_path / "epoch=0.ckpt").exists()


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="decides keep"):
        NbckptCheckpointIO(keep=3)
    with pytest.raises(ConfigError, match="max_inflight"):
        NbckptCheckpointIO(max_inflight=0)
    io = NbckptCheckpointIO()
    with pytest.raises(ConfigError, match="URL"):
        io.save_checkpoint({"x": 1}, "s3://bucket/last.ckpt")
    with pytest.raises(ConfigError, match="storage_options"):
        io.save_checkpoint({"x": 1}, tmp_path / "a.ckpt", storage_options={"a": 1})
    with pytest.raises(ConfigError, match=r"hparams\.bad holds a object"):
        io.save_checkpoint({"hparams": {"bad": object()}}, tmp_path / "a.ckpt")
    io.teardown()
    assert not (tmp_path / "a.ckpt").exists()


def test_background_failure_is_raised_by_teardown(tmp_path: Path) -> None:
    io = NbckptCheckpointIO()
    io.save_checkpoint({"x": torch.ones(4)}, tmp_path / "a.ckpt")
    ckpt = io._roots[str(tmp_path / ROOT_NAME)]
    ckpt.wait()
    store = ckpt.store

    def broken_commit(*args: Any) -> str:
        raise OSError(28, "No space left on device")

    store.commit = broken_commit  # type: ignore[method-assign,assignment]
    io.save_checkpoint({"x": torch.zeros(4)}, tmp_path / "b.ckpt")
    with pytest.raises(CheckpointError, match="No space left"):
        io.teardown()
    assert set(_names(tmp_path)) == {"a.ckpt"}  # no name for the checkpoint that never committed


def test_ddp_two_processes_rank0_saves_alone(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "NODE_RANK": "0",
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        RankProcess.start([sys.executable, str(WORKER), str(tmp_path)], {**env, "LOCAL_RANK": str(rank)})
        for rank in range(2)
    ]
    results = []
    try:
        for code, out, err in finish_all(procs, timeout=300):
            assert code == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["resumed"] == results[0]["straight"] == results[1]["resumed"]
    assert results[0]["global_step"] == 16
    names = _names(tmp_path / "resumed")
    assert set(names) == {"epoch=2-step=12.ckpt", "epoch=3-step=16.ckpt", "last.ckpt"}
    assert _steps(tmp_path / "resumed") == sorted(set(names.values()))


IN_A_NOTEBOOK = """
import json, torch, lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from integrations.lit_app import TinyModel, data, digest
from nbckpt.integrations.lightning import NbckptCheckpointIO
torch.manual_seed(0)
model = TinyModel()
t = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, plugins=[NbckptCheckpointIO()],
               callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)], logger=False,
               enable_progress_bar=False, enable_model_summary=False)
t.fit(model, data())
print(json.dumps({"start_method": t.strategy.launcher._start_method, "digest": digest(model)}))
"""


@pytest.mark.slow  # about 25 s; the default suite proves a fork child's save commits (test_misuse)
@pytest.mark.timeout(300)
def test_devices_2_in_a_real_kernel_forks_and_every_save_commits(tmp_path: Path) -> None:
    """Issue 31, item 1: in a notebook Lightning runs ``devices=2`` as ``ddp_fork``; rank 0's
    forked worker saves the final weights through the plug-in and leaves by ``os._exit``. The
    save in flight never committed ("ConfigError: .../.temp.ckpt does not exist" in the kernel,
    a ``.tmp-step-*`` left behind). Now fit ends in the kernel with the trained weights, every
    name is a committed step and nothing else is left, the temporary weights' step included."""
    from helpers.kernel import RealKernel

    tests = str(Path(__file__).parents[1])
    path = os.pathsep.join([tests, str(Path(tests).parent), os.environ.get("PYTHONPATH", "")])
    temporary = tmp_path / "tmp"  # where Lightning's mkdtemp puts the worker's .temp.ckpt
    temporary.mkdir()
    kernel = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1", "PYTHONPATH": path, "TMPDIR": str(temporary)})
    try:
        seen = json.loads(kernel.run(IN_A_NOTEBOOK, timeout=240).strip().splitlines()[-1])
    finally:
        kernel.close()
    assert seen["start_method"] == "fork"  # Lightning's own choice in a kernel: the case at issue
    names = _names(tmp_path / "ckpt")
    assert {"epoch=1-step=8.ckpt", "last.ckpt"} <= set(names) and _steps(tmp_path / "ckpt") == sorted(
        set(names.values())
    )
    assert digest(load_from_checkpoint(TinyModel, tmp_path / "ckpt" / "last.ckpt")) == seen["digest"]
    assert not [name for name in os.listdir(tmp_path / "ckpt" / ROOT_NAME) if name.startswith(".tmp")]
    assert list(temporary.rglob(ROOT_NAME))  # the worker saved its final weights there: the check bites
    assert [path.name for path in temporary.rglob("*") if "step-" in path.name] == []  # no copy left


def test_pytorch_lightning_trainer_accepts_the_plugin(tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    trainer = pl.Trainer(
        plugins=[NbckptCheckpointIO()], logger=False, accelerator="cpu", default_root_dir=tmp_path
    )
    assert isinstance(trainer.strategy.checkpoint_io, NbckptCheckpointIO)


def test_an_event_whose_two_saves_are_equal_is_one_write(tmp_path: Path) -> None:
    # save_top_k=2, save_last=True: Lightning saves twice per event and changes last_model_path
    # in between, so at the first event the two checkpoint dicts differ in that string.
    _, t = fit(tmp_path / "one", 3)
    io = t.strategy.checkpoint_io
    assert isinstance(io, NbckptCheckpointIO)
    assert [r.step for r in io.records] == [1, 2, 3, 4]  # three events, four writes: two at the first
    names = _names(tmp_path / "one")
    assert names["last.ckpt"] == names["epoch=2-step=24.ckpt"] == 4
    assert names["epoch=1-step=16.ckpt"] == 3

    # the first event on its own: the top-k name holds last_model_path "" and last.ckpt its own path
    fit(tmp_path / "first", 1)
    first = NbckptCheckpointIO()
    top_k = first.load_checkpoint(tmp_path / "first" / "epoch=0-step=8.ckpt")
    last = first.load_checkpoint(tmp_path / "first" / "last.ckpt")
    key = next(k for k in last["callbacks"] if "ModelCheckpoint" in k)
    assert top_k["callbacks"][key]["last_model_path"] == ""
    assert last["callbacks"][key]["last_model_path"] == str(tmp_path / "first" / "last.ckpt")
    assert _steps(tmp_path / "first") == [1, 2]
    # what plain load and export see too
    assert load(tmp_path / "first" / "last.ckpt")["callbacks"][key]["last_model_path"].endswith("last.ckpt")
    first.teardown()


class _Validated(TinyModel):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))


@pytest.mark.parametrize("top_k", [False, True])
def test_a_save_at_every_validation_as_lightnings_own_checkpoint_frequency_tests(
    tmp_path: Path, top_k: bool
) -> None:
    """What Lightning's test_default_checkpoint_freq and test_top_k check beyond their count of
    ``torch.save`` calls (which nbckpt does not make per checkpoint): validation four times an
    epoch (``val_check_interval=0.25``) is four events, each saved through the plug-in; the
    default callback keeps the newest name, top-k (every event a new best, as the loss of
    Lightning's test) the best two and ``last``, each name on its step."""
    options: dict[str, Any] = {"monitor": "step", "mode": "max", "save_top_k": 2, "save_last": True}
    callback = ModelCheckpoint(dirpath=tmp_path, **(options if top_k else {}))
    t = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        callbacks=[callback],
        val_check_interval=0.25,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t.fit(_Validated(), data(), data())
    io = t.strategy.checkpoint_io
    assert isinstance(io, NbckptCheckpointIO)
    # one write per event; with last, the first event's two saves differ (last_model_path)
    assert [r.step for r in io.records] == ([1, 2, 3, 4, 5] if top_k else [1, 2, 3, 4])
    names = _names(tmp_path)
    if top_k:
        assert set(names) == {"epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"}, names
        assert names["last.ckpt"] == names["epoch=0-step=8.ckpt"] == 5
    else:
        assert names == {"epoch=0-step=8.ckpt": 4}, names
    assert _steps(tmp_path) == sorted(set(names.values()))


def test_reservations_a_killed_run_left_are_settled(tmp_path: Path) -> None:
    """A name reserved by a save that a kill cut short: its pointer if the step committed, no
    name if it never did (the next plug-in on the directory settles them)."""
    io = NbckptCheckpointIO(mode="sync")
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a.ckpt")
    io.teardown()
    (tmp_path / "b.ckpt").write_bytes(pointer_bytes(1, committed=False))
    (tmp_path / "c.ckpt").write_bytes(pointer_bytes(7, committed=False))
    with pytest.raises(
        ConfigError, match=r"c\.ckpt is reserved for \.nbckpt/step-000007, whose save has not"
    ):
        load(tmp_path / "c.ckpt")
    for name, step in (("e.ckpt", 1), ("f.ckpt", 8)):  # as the previous release reserved names
        (tmp_path / name).write_text(json.dumps({"format": "nbckpt-reserved/1", "step": step}))
    (tmp_path / "g.ckpt.nbckpt-tmp").write_bytes(pointer_bytes(1))  # a pointer a kill cut short
    io = NbckptCheckpointIO(mode="sync")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "d.ckpt")
    io.teardown()
    assert _names(tmp_path) == {"a.ckpt": 1, "b.ckpt": 1, "d.ckpt": 2, "e.ckpt": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [ROOT_NAME, "a.ckpt", "b.ckpt", "d.ckpt", "e.ckpt"]


def test_the_plugin_can_be_copied_and_pickled(tmp_path: Path) -> None:
    """Issue 31, item 4: ``strategy="ddp_spawn"`` pickles the Trainer with its plug-in, as do
    ``copy.deepcopy(trainer)`` and ``torch.save(trainer)`` ("cannot pickle '_thread.lock'").
    A copy is a new plug-in with the same options that saves on its own."""
    import copy
    import pickle

    io = NbckptCheckpointIO(mode="sync", writer_threads=3)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a.ckpt")  # holds a directory, a lock, threads
    for twin in (copy.deepcopy(io), pickle.loads(pickle.dumps(io))):
        assert twin._config == io._config and twin._roots == {}
        twin.save_checkpoint({"w": torch.ones(2)}, tmp_path / "other" / "b.ckpt")
        twin.teardown()
    io.teardown()
    assert torch.equal(load(tmp_path / "other" / "b.ckpt")["w"], torch.ones(2))


def test_hydra_hyperparameters_are_saved_and_come_back_as_they_were(tmp_path: Path) -> None:
    """Issue 31, item 3: ``save_hyperparameters(DictConfig)`` (Hydra) made the first checkpoint
    fail ("hparams_type holds a ABCMeta"); Lightning's own IO saves it. Saved as plain
    containers and the class's name, they load back as a DictConfig, interpolation included."""
    omegaconf = pytest.importorskip("omegaconf")
    config = omegaconf.OmegaConf.create({"hidden": 8, "lr": 0.05, "tags": ["a", "b"], "twice": "${hidden}"})

    class HydraModel(TinyModel):
        def __init__(self, cfg: Any) -> None:
            super().__init__(hidden=cfg.hidden, lr=cfg.lr)
            self.save_hyperparameters(cfg)

    model = HydraModel(config)
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        logger=False,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data())
    trainer.strategy.checkpoint_io.teardown()
    loaded = load_from_checkpoint(HydraModel, tmp_path / "last.ckpt")
    assert isinstance(loaded.hparams, omegaconf.DictConfig)
    assert loaded.hparams == config and loaded.hparams.twice == 8
    assert digest(loaded) == digest(model)


@pytest.mark.parametrize(("mtbf", "rare"), [("1000h", True), (1e-3, False)])
def test_a_scheduled_checkpoint_saves_when_its_schedule_says(tmp_path: Path, mtbf: Any, rare: bool) -> None:
    """ScheduledCheckpoint in place of a step count: its first save at once (step 1); with an
    MTBF of 1000 h nothing more in 16 steps, with 1 ms (sync saves, durable on return) as often as
    the write allows (the next save due once the time since this one began reaches the recent
    saves' median: at most a few steps apart, these steps being shorter than a save). Lightning's
    names point to the saved steps (its save_last also saves at each epoch's end: left out where
    only the schedule's saves count)."""
    callback = ScheduledCheckpoint(SaveSchedule(mtbf=mtbf), dirpath=tmp_path, save_last=not rare)
    io = NbckptCheckpointIO(mode="sync")
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        plugins=[io],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModel(tag=tmp_path), data())
    names = _names(tmp_path)
    saved = [record.step for record in io.records]  # nbckpt's steps, one per save
    assert trainer.global_step == 16 and saved[0] == 1
    if rare:
        assert saved == [1] and names == {"epoch=0-step=1.ckpt": 1}, names
    else:
        assert len(saved) >= 3 and names["last.ckpt"] == saved[-1], (saved, names)
        interval = callback.save_interval
        assert interval is not None and interval.bound == "persist"
    assert _steps(tmp_path) == sorted(set(names.values()))  # nothing kept that no name points to


def test_a_scheduled_checkpoint_needs_the_plugin_and_no_other_trigger(tmp_path: Path) -> None:
    schedule = SaveSchedule(mtbf="1h")
    with pytest.raises(ConfigError, match="drop every_n_train_steps"):
        ScheduledCheckpoint(schedule, dirpath=tmp_path, every_n_train_steps=5)
    with pytest.raises(ConfigError, match="schedule must be a SaveSchedule"):
        ScheduledCheckpoint("1h", dirpath=tmp_path)  # type: ignore[arg-type]
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        callbacks=[ScheduledCheckpoint(schedule, dirpath=tmp_path)],
        logger=False,
    )
    with pytest.raises(ConfigError, match=r"plugins=\[NbckptCheckpointIO\(\)\]"):
        trainer.fit(TinyModel(), data())


def test_wrapped_in_async_checkpoint_io_is_refused_in_one_line(tmp_path: Path) -> None:
    # AsyncCheckpointIO clones each checkpoint, saves it on a thread of its own and removes
    # top-k names before their queued saves (a third top-k name stayed), and its teardown never
    # reaches the plug-in (nbckpt's threads and lock outlived the fit): nbckpt is async already.
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    before = set(threading.enumerate())
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        plugins=[AsyncCheckpointIO(NbckptCheckpointIO())],
        callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="train_loss", save_top_k=2)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ConfigError, match="saves asynchronously itself") as caught:
        trainer.fit(TinyModel(), data())
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing saved, nothing reserved
    assert set(threading.enumerate()) <= before  # no thread of nbckpt's (or the wrapper's) left


def test_a_wrapper_between_async_checkpoint_io_and_the_plugin_hides_nothing(tmp_path: Path) -> None:
    """Lightning's own test_async_checkpoint_plugin wraps the plug-in's ``save_checkpoint`` in a
    ``Mock(wraps=...)``: three frames of mock between the wrapper's thread and the plug-in hid the
    wrapper, the save went through and nbckpt's threads outlived the fit (the wrapper's teardown
    never reaches the plug-in). A caller in between hides nothing now."""
    from unittest import mock

    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    io = NbckptCheckpointIO()
    io.save_checkpoint = mock.Mock(wraps=io.save_checkpoint)  # type: ignore[method-assign]
    wrapper = AsyncCheckpointIO(io)
    try:
        with pytest.raises(ConfigError, match="saves asynchronously itself"):
            try:  # the wrapper raises its thread's error at the next save or at its teardown
                wrapper.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
            finally:
                wrapper.teardown()
    finally:
        io.teardown()
    assert io.save_checkpoint.call_count == 1  # the wrapper's thread did call it
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing saved, nothing reserved


class _Interrupted(TinyModel):
    """Ctrl-C (a KeyboardInterrupt) in the training loop, or in ``setup`` with ``early=True``."""

    def __init__(self, early: bool = False) -> None:
        super().__init__()
        self.early = early

    def setup(self, stage: str) -> None:
        if self.early:
            raise KeyboardInterrupt

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 1 and batch_idx == 2:
            raise KeyboardInterrupt
        return super().training_step(batch, batch_idx)


def test_a_ctrl_c_in_fit_commits_what_was_saved_and_says_when_lightning_leaves_it_ignored(
    tmp_path: Path,
) -> None:
    """Ctrl-C in ``fit``: Lightning (trainer/call.py) sets SIGINT to SIG_IGN for its shutdown and
    raises SystemExit(1). In the training loop, its teardown puts back the handler the run found
    (its signal connector); the plug-in's teardown, in that shutdown, commits the saves it
    accepted and leaves no thread. In ``setup`` (before the run records the handlers) SIGINT
    stays ignored, and the line docs/integrations.md gives makes Ctrl-C raise again."""
    before = set(threading.enumerate())
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            trainer(tmp_path, 3).fit(_Interrupted(), data())
        assert signal.getsignal(signal.SIGINT) is previous
        with pytest.raises(SystemExit):
            trainer(tmp_path / "early", 3).fit(_Interrupted(early=True), data())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # the installed Lightning's doing
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the docs' workaround
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    names = _names(tmp_path)
    assert set(names) == {"epoch=0-step=8.ckpt", "last.ckpt"}, names
    assert _steps(tmp_path) == sorted(set(names.values()))
    assert set(threading.enumerate()) <= before


INTERRUPTED_IN_A_NOTEBOOK = """
import time
from integrations.lit_app import TinyModel, data, trainer
class Slow(TinyModel):
    def setup(self, stage):
        print("in setup", flush=True)
        time.sleep(120)
try:
    trainer("ckpt", 3).fit(Slow(), data())
finally:
    print("then", repr(__import__("signal").getsignal(2)), flush=True)  # in this cell: ignored
"""


@pytest.mark.slow  # about 20 s: a kernel and Lightning's import in it
@pytest.mark.timeout(300)
def test_kernel_interrupt_works_in_the_next_cell_after_lightning_left_ctrl_c_ignored(tmp_path: Path) -> None:
    """What docs/integrations.md says of Kernel > Interrupt after Lightning left SIGINT ignored (a
    Ctrl-C in ``setup``, before the run records the handlers it puts back): ipykernel sets
    Python's handler around each cell, so the next cell is interrupted as any other."""
    from helpers.kernel import RealKernel

    tests = str(Path(__file__).parents[1])
    path = os.pathsep.join([tests, str(Path(tests).parent), os.environ.get("PYTHONPATH", "")])
    kernel = RealKernel(tmp_path, {"OMP_NUM_THREADS": "1", "PYTHONPATH": path})
    try:
        cell = kernel.send(INTERRUPTED_IN_A_NOTEBOOK)
        kernel.output(cell, until=lambda out: "in setup" in out)
        kernel.km.interrupt_kernel()
        assert kernel.reply(cell)["ename"] == "SystemExit"  # Lightning's sys.exit(1)
        assert "then <Handlers.SIG_IGN: 1>" in kernel.output(cell)  # the check below bites
        cell = kernel.send("import time; print('asleep', flush=True); time.sleep(120)")
        kernel.output(cell, until=lambda out: "asleep" in out)
        began = time.monotonic()
        kernel.km.interrupt_kernel()
        assert kernel.reply(cell)["ename"] == "KeyboardInterrupt"
        assert time.monotonic() - began < 60  # not the sleep's 120 s
    finally:
        kernel.close()


class _Troubled(TinyModel):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 1:
            raise RuntimeError("Trouble!")
        return super().training_step(batch, batch_idx)


def test_a_save_on_exception_commits_before_fit_raises(tmp_path: Path) -> None:
    """Lightning's test_model_checkpoint_on_exception_*: the checkpoint ModelCheckpoint saves
    when training raises is named, and loads, once fit has raised."""
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        plugins=[NbckptCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="exception", save_on_exception=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RuntimeError, match="Trouble!"):
        trainer.fit(_Troubled(), data())
    saved = load_checkpoint(tmp_path / "exception.ckpt")  # no wait: the fit's teardown committed it
    assert _names(tmp_path)["exception.ckpt"] in _steps(tmp_path)
    assert saved["state_dict"] and saved["global_step"] == 8  # the first step of epoch 1 raised


def test_resuming_into_a_new_folder_leaves_the_old_names(tmp_path: Path) -> None:
    """Lightning's test_resume_training_preserves_old_ckpt_last: a fit resumed from a name of
    another folder saves into its own and never removes the old folder's names or steps."""
    fit(tmp_path / "old", 2)
    before = _names(tmp_path / "old")
    torch.manual_seed(0)
    t = trainer(tmp_path / "new", 4)
    t.fit(TinyModel(), data(), ckpt_path=tmp_path / "old" / "epoch=0-step=8.ckpt")
    assert _names(tmp_path / "old") == before and _steps(tmp_path / "old") == sorted(set(before.values()))
    assert "last.ckpt" in _names(tmp_path / "new")


def test_a_missing_ckpt_path_is_lightnings_file_not_found(tmp_path: Path) -> None:
    """Lightning's test_hpc_restore_attempt: fit(ckpt_path=<nothing there>) is the
    FileNotFoundError Lightning's own IO raises (and one of nbckpt's ConfigErrors)."""
    t = trainer(tmp_path, 1)
    with pytest.raises(FileNotFoundError, match=r"Checkpoint file not found: .*missing\.ckpt") as caught:
        t.fit(TinyModel(), data(), ckpt_path=tmp_path / "missing.ckpt")
    assert isinstance(caught.value, ConfigError)


def test_a_save_that_waits_for_the_one_before_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One save in flight (max_inflight=1): the next save waits for the previous write and fsync.
    That wait is part of the stall the training loop sees, so it is said in the log (a warning
    the first time), with SaveRecord.wait_s."""
    io = NbckptCheckpointIO()
    io.save_checkpoint({"x": torch.ones(4)}, tmp_path / "a.ckpt")
    io.wait()
    ckpt = io._roots[str(tmp_path / ROOT_NAME)]
    release, waiting = threading.Event(), threading.Event()
    commit = ckpt.store.commit

    def held_commit(*args: Any) -> Any:
        release.wait()
        return commit(*args)

    ckpt.store.commit = held_commit  # type: ignore[method-assign]
    io.save_checkpoint({"x": torch.zeros(4)}, tmp_path / "b.ckpt")  # in flight until released
    reached: list[bool] = []  # whether c's save reached the wait (a bound, not a clock: it is prompt)
    threading.Thread(target=lambda: (reached.append(waiting.wait(60)), release.set()), daemon=True).start()
    assert not [r for r in caplog.records if "waited" in r.getMessage()]
    with armed("save.wait", lambda step: waiting.set()):  # c's save waits for room: b goes on
        io.save_checkpoint({"x": torch.full((4,), 2.0)}, tmp_path / "c.ckpt")  # waits for b's commit
    io.teardown()
    assert reached == [True], "the third save never waited for room"
    said = [r for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING" and "max_inflight" in said[0].getMessage()
    assert [r.wait_s > 0 for r in io.records] == [False, False, True]


class _FailAt(pl.Callback):
    """An error at the end of epoch ``epoch`` (a bug in the cell's training code)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("the cell's bug")


def test_a_cell_run_again_after_a_failed_fit_resumes_with_a_new_plug_in(tmp_path: Path) -> None:
    """Issue 31: the plug-in holds its directories from a fit's first save to its teardown, which
    Lightning runs after a fit that failed too: a cell run again, its new Trainer and plug-in on the
    same dirpath (the old ones still bound), resumes from its last.ckpt."""
    _, done = fit(tmp_path, 1)
    torch.manual_seed(0)
    failed = trainer(tmp_path, 4)
    failed.callbacks.append(_FailAt(2))
    with pytest.raises(RuntimeError, match="the cell's bug"):
        failed.fit(TinyModel(tag=tmp_path), data(), ckpt_path="last")
    assert done.strategy.checkpoint_io._roots == failed.strategy.checkpoint_io._roots == {}
    _, again = fit(tmp_path, 4, resume=True)  # the cell again
    assert again.current_epoch == 4 and again.global_step == 32
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == [
        "epoch=2-step=24.ckpt",
        "epoch=3-step=32.ckpt",
        "last.ckpt",
    ]
