"""Incremental saves (issue 32): a tensor whose bytes did not change since the previous save is
neither staged nor written; every retained step stays a whole checkpoint (plain ``dcp.load``,
``verify``, restore) whatever other step is deleted, and whatever way a tensor was changed, a
changed tensor is written."""

from __future__ import annotations

import os
import random
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.finetune import Adapted, setup, snapshot, tune
from helpers.hostile import run_child
from torch import nn

from nbckpt import Checkpointer, ConfigError
from nbckpt.engine._incremental import device_print


def files_of(step_dir: Path) -> dict[str, os.stat_result]:
    return {p.name: p.stat() for p in step_dir.iterdir() if p.name != "manifest.json"}


def check_whole(directory: Path, ckpt: Checkpointer, step: int, expected: dict[str, torch.Tensor]) -> None:
    """Step ``step`` verifies, restores bit-exactly, and a plain ``dcp.load`` reads it."""
    ckpt.verify(step)
    model, optim, state = setup(seed=99)
    tune(model, optim, 0)  # the optimizer has state to load into
    ckpt.restore(state, step=step)
    assert_same(snapshot(state), expected)
    target = {
        "model": {
            k.removeprefix("model."): torch.zeros_like(v)
            for k, v in expected.items()
            if k.startswith("model.")
        }
    }
    dcp.load(target, checkpoint_id=str(directory / f"step-{step:06d}"))
    assert_same(
        {f"model.{k}": v for k, v in target["model"].items()},
        {k: v for k, v in expected.items() if k.startswith("model.")},
    )


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def test_a_frozen_base_is_written_once(tmp_path: Path) -> None:
    model, optim, state = setup()
    trainable = sum(p.nbytes for p in (model.down, model.up)) * 3  # weights and AdamW's two moments
    base = sum(p.nbytes for p in model.base.parameters())
    assert base > 20 * trainable
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        first = ckpt.save(state, step=1).wait()
        assert first.bytes_skipped == 0 and first.bytes_written > base
        for step in range(2, 6):
            tune(model, optim, step)
            state["step"] = step
            record = ckpt.save(state, step=step).wait()
            before = {s.st_ino for s in files_of(tmp_path / f"step-{step - 1:06d}").values()}
            now = files_of(tmp_path / f"step-{step:06d}")
            new = {name: s for name, s in now.items() if s.st_ino not in before}
            shared = {name: s for name, s in now.items() if s.st_ino in before}
            # Bytes counted from the files: what is new in this step is the files of the adapters
            # and their optimizer state, the values and DCP's metadata; the files of the base
            # are the previous step's inodes, each now one more step's (st_nlink).
            items = ckpt.manifest(step)["items"]
            base_files = {items[f"model.base.{k}"][0][0] for k in model.base.state_dict()}
            assert set(new) == set(now) - base_files and set(shared) == base_files
            assert sum(s.st_size for s in new.values()) < trainable + 40_000 < base / 10
            assert sum(s.st_size for s in shared.values()) > base
            assert all(s.st_nlink == step for s in shared.values())  # shared by every step so far
            assert record.bytes_written == sum(s.st_size for s in new.values())
            assert record.bytes_skipped == sum(s.st_size for s in shared.values())
        manifest = ckpt.verify(5)
        base_files = {manifest["items"][f"model.base.{k}"][0][0] for k in model.base.state_dict()}
        first_inodes = {s.st_ino for s in files_of(tmp_path / "step-000001").values()}
        assert {files_of(tmp_path / "step-000005")[name].st_ino for name in base_files} <= first_inodes
        check_whole(tmp_path, ckpt, 5, snapshot(state))


def _optimizer_step(param: torch.Tensor) -> None:
    param.grad = torch.ones_like(param)
    torch.optim.SGD([param], lr=0.5).step()
    param.grad = None


def _fused_adamw(param: torch.Tensor) -> None:  # torch 2.13 on CPU: leaves the version counter as it was
    param.grad = torch.ones_like(param)
    torch.optim.AdamW([param], lr=0.5, fused=True).step()
    param.grad = None


def _load_state_dict(model: Adapted) -> None:
    changed = model.base[0].state_dict()
    changed["weight"] = changed["weight"] + 1
    model.base[0].load_state_dict(changed)


def _replace_object(model: Adapted) -> None:
    model.base[0].weight = nn.Parameter(model.base[0].weight.detach() + 1, requires_grad=False)


def _inference_mode(param: torch.Tensor) -> None:
    with torch.inference_mode():
        param.add_(1)


def _copy_back_same_bytes(param: torch.Tensor) -> None:
    """Changed and changed back: the bytes are the old ones (the step shares them, rightly)."""
    with torch.no_grad():
        param.copy_(param.clone())


CHANGES: dict[str, Callable[[Adapted], None]] = {
    "optimizer_step": lambda m: _optimizer_step(m.base[0].weight),
    "fused_adamw": lambda m: _fused_adamw(m.base[0].weight),
    "load_state_dict": _load_state_dict,
    "copy_under_no_grad": lambda m: torch.no_grad()(m.base[0].weight.copy_)(m.base[0].weight * 2),
    "through_data": lambda m: m.base[0].weight.data.add_(1),
    "data_assigned": lambda m: setattr(m.base[0].weight, "data", m.base[0].weight.data + 1),
    "through_numpy": lambda m: m.base[0].weight.detach().numpy().__iadd__(1),
    "one_element_through_data": lambda m: m.base[0].weight.data[3, 7].add_(1e-7),
    "replaced_by_another_object": _replace_object,
    "inference_mode": lambda m: _inference_mode(m.base[0].weight),
}


@pytest.mark.parametrize("how", sorted(CHANGES))
def test_every_way_of_changing_a_tensor_is_caught(tmp_path: Path, how: str) -> None:
    model, optim, state = setup()
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        ckpt.save(state, step=1)
        tune(model, optim, 2)
        ckpt.save(state, step=2)
        kept = snapshot(state)
        weight = model.base[0].weight
        before = weight.detach().clone()
        CHANGES[how](model)
        assert not torch.equal(model.base[0].weight, before)
        tune(model, optim, 3)
        record = ckpt.save(state, step=3).wait()
        name = ckpt.manifest(3)["items"]["model.base.0.weight"][0][0]
        assert (tmp_path / "step-000003" / name).stat().st_ino != (
            tmp_path / "step-000002" / name
        ).stat().st_ino
        assert record.bytes_written > weight.nbytes
        check_whole(tmp_path, ckpt, 3, snapshot(state))
        check_whole(tmp_path, ckpt, 2, kept)


def test_bytes_changed_and_changed_back_are_shared(tmp_path: Path) -> None:
    model, _, state = setup()
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        ckpt.save(state, step=1)
        _copy_back_same_bytes(model.base[0].weight)  # the version counter moved, the bytes did not
        record = ckpt.save(state, step=2).wait()
        assert record.bytes_skipped > sum(p.nbytes for p in model.base.parameters())
        check_whole(tmp_path, ckpt, 2, snapshot(state))


def test_every_step_stays_whole_when_the_others_are_deleted_in_random_order(tmp_path: Path) -> None:
    model, optim, state = setup()
    expected = {}
    with Checkpointer(tmp_path, mode="async", incremental=True) as ckpt:
        for step in range(1, 7):
            tune(model, optim, step)
            if step == 4:  # a frozen layer changes once, in the middle
                with torch.no_grad():
                    model.base[1].bias.add_(1)
            state["step"] = step
            ckpt.save(state, step=step)
            expected[step] = snapshot(state)
        ckpt.wait()
        order = list(expected)
        random.Random(32).shuffle(order)
        for gone in order[:-1]:
            ckpt.delete(gone)
            for step in ckpt.steps():
                check_whole(tmp_path, ckpt, step, expected[step])
        assert ckpt.steps() == [order[-1]]
        left = files_of(tmp_path / f"step-{order[-1]:06d}")
        assert all(s.st_nlink == 1 for s in left.values())  # the last holder of every byte


def test_off_by_default_and_refused_with_several_saves_in_flight(tmp_path: Path) -> None:
    _, _, state = setup()
    with Checkpointer(tmp_path / "plain", mode="sync") as ckpt:
        ckpt.save(state, step=1)
        record = ckpt.save(state, step=2).wait()
    assert record.bytes_skipped == 0
    assert all(s.st_nlink == 1 for s in files_of(tmp_path / "plain" / "step-000002").values())
    with pytest.raises(ConfigError, match="incremental=True needs max_inflight=1"):
        Checkpointer(tmp_path / "two", incremental=True, max_inflight=2)
    with pytest.raises(ConfigError, match="incremental"):
        Checkpointer(tmp_path / "flag", incremental="yes")


def test_the_device_fingerprint_sees_every_element() -> None:
    """The fingerprint CUDA tensors get, computed here on the CPU (the same torch operations):
    equal bytes give equal prints; one element changed anywhere, or two swapped, do not."""
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(5003, generator=generator)  # over one chunk's worth is too slow here; odd size
    print_ = device_print(tensor).tolist()
    assert device_print(tensor.clone()).tolist() == print_
    for index in (0, 1, 2500, 5002):
        changed = tensor.clone()
        changed.view(torch.int32)[index] ^= 1  # the lowest bit of one float
        assert device_print(changed).tolist() != print_, index
    swapped = tensor.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert device_print(swapped).tolist() != print_
    odd = torch.arange(7, dtype=torch.uint8)  # not a whole number of 32-bit words
    assert device_print(odd).tolist() != device_print(odd.flip(0)).tolist()
    shifted = torch.arange(9, dtype=torch.bfloat16)[1:5]  # 2 bytes into its storage
    assert device_print(shifted).tolist() == device_print(shifted.clone()).tolist()


CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers.finetune import setup, tune
from nbckpt import Checkpointer
from nbckpt.engine._store import arm_crash
directory, crash_at, crash_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, optim, state = setup()
ckpt = Checkpointer(directory, mode="sync", incremental=True, keep=2)
for step in range(1, 7):
    tune(model, optim, step)
    state["step"] = step
    if step == crash_step:
        arm_crash(crash_at)
    ckpt.save(state, step=step)
    ckpt.wait()
"""


@pytest.mark.parametrize(
    ("crash_at", "crash_step"), [("after_data", 4), ("before_rename", 4), ("during_delete", 4)]
)
def test_a_kill_in_a_save_or_a_delete_leaves_every_step_readable(
    tmp_path: Path, crash_at: str, crash_step: int
) -> None:
    tests = str(Path(__file__).parents[1])
    done = run_child(textwrap.dedent(CHILD).format(tests=tests), str(tmp_path), crash_at, str(crash_step))
    assert done.returncode == -9, done.stderr
    model, optim, state = setup()
    expected = {}
    for step in range(1, crash_step + 1):
        tune(model, optim, step)
        state["step"] = step
        expected[step] = snapshot(state)
    with pytest.warns(UserWarning, match="leftover"):
        ckpt = Checkpointer(tmp_path, mode="sync", incremental=True, keep=2)
    with ckpt:
        steps = ckpt.steps()
        assert steps == ([3, 4] if crash_at == "during_delete" else [2, 3])
        for step in steps:
            check_whole(tmp_path, ckpt, step, expected[step])


def test_a_step_saved_again_shares_the_files_it_replaces(tmp_path: Path) -> None:
    """A re-save of the step saved last links that step's files before the swap removes it."""
    model, optim, state = setup()
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        ckpt.save(state, step=1)
        tune(model, optim, 2)
        record = ckpt.save(state, step=1, overwrite=True).wait()
        assert record.bytes_skipped > sum(p.nbytes for p in model.base.parameters())
        assert ckpt.steps() == [1]
        check_whole(tmp_path, ckpt, 1, snapshot(state))


def test_a_file_holding_a_changed_tensor_is_not_fingerprinted(tmp_path: Path) -> None:
    """A trained tensor that stood still (no gradient reached it) shares its file with ones that
    changed: the file is written anyway, so none of its tensors is read for a fingerprint; the
    frozen base alone is, save after save."""
    model, optim, state = setup()
    model.idle = nn.Parameter(torch.ones(8))  # trained, but unused: its version never moves
    base = sum(p.nbytes for p in model.base.parameters())
    with Checkpointer(tmp_path, mode="sync", incremental=True) as ckpt:
        for step in range(1, 4):
            tune(model, optim, step)
            ckpt.save(state, step=step)
        compared = [e for e in ckpt.timeline.events if e.kind == "compare"]
        assert [e.bytes for e in compared[-2:]] == [base, base]
        items = ckpt.manifest(3)["items"]
        assert items["model.idle"][0][0] == items["model.down"][0][0]  # one file with the adapters


def test_a_mirror_uploads_only_the_files_a_step_did_not_share(tmp_path: Path) -> None:
    """A mirror's copy of an incremental step shares there the files the step shares here (a
    hard link to the mirror's previous step's file): after the first upload only the adapters'
    files, the values and the metadata travel; each mirrored step stays whole when the steps
    before it are deleted."""
    model, optim, state = setup()
    base = sum(p.nbytes for p in model.base.parameters())
    expected = {}
    local, mirror = tmp_path / "local", tmp_path / "mirror"
    with Checkpointer(local, mirror=str(mirror), mode="sync", incremental=True) as ckpt:
        for step in range(1, 5):
            tune(model, optim, step)
            state["step"] = step
            ckpt.save(state, step=step)
            expected[step] = snapshot(state)
        ckpt.wait()  # includes the uploads
        uploaded = [
            e.bytes for e in sorted(ckpt.timeline.events, key=lambda e: e.step or 0) if e.kind == "upload"
        ]
    assert len(uploaded) == 4 and uploaded[0] > base
    assert all(sent < base / 10 for sent in uploaded[1:]), uploaded  # counted as sent, not shared
    first, last = files_of(mirror / "step-000001"), files_of(mirror / "step-000004")
    shared = [name for name, info in last.items() if name in first and first[name].st_ino == info.st_ino]
    assert sum(last[name].st_size for name in shared) > base
    shutil.rmtree(local)
    for gone in (1, 3, 2):
        shutil.rmtree(mirror / f"step-{gone:06d}")  # what a delete does to a step's names
    with Checkpointer(mirror, read_only=True) as copy:
        assert copy.steps() == [4]
        copy.verify(4)
    target = {
        "model": {
            k.removeprefix("model."): torch.zeros_like(v)
            for k, v in expected[4].items()
            if k.startswith("model.")
        }
    }
    dcp.load(target, checkpoint_id=str(mirror / "step-000004"))
    assert_same(
        {f"model.{k}": v for k, v in target["model"].items()},
        {k: v for k, v in expected[4].items() if k.startswith("model.")},
    )
