"""Reliability v4 (issue 34), the native manifest and the restore that applies it: items 3, 7 and
8b, each named after its item.

What must hold: a step nbckpt commits is a step it reads back; a restore that fails (damage, or
a state that cannot take the step) changes not one byte of the caller's state, and damage falls
back to the older step; and every check ``restore`` makes, ``verify`` makes too, so the readers
never disagree about a step ``verify`` calls good.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.hostile import (
    assert_falls_back,
    assert_is_step,
    blank,
    node,
    rewrite_manifest,
    state_of,
)
from helpers.ranks import run_ranks

from nbckpt import Checkpointer, CheckpointError, ConfigError
from nbckpt.engine._format import checksum

# -- item 3: an empty tensor whose leading sizes are not zero is a step like any other -------------

#: Every dtype nbckpt saves (the quantized ones it refuses at save).
SAVED_DTYPES = sorted(
    {
        dtype
        for name in dir(torch)
        if isinstance(dtype := getattr(torch, name), torch.dtype)
        and not str(dtype).startswith(("torch.qint", "torch.quint"))
    },
    key=str,
)
#: A zero first, in the middle and last.
EMPTY_SHAPES = [(0,), (0, 3), (4096, 0), (3, 0, 2), (2, 3, 0), (1 << 20, 1 << 20, 0)]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _empty_state() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "experimental"
        tensors = {
            f"{_name(dtype)}_{'x'.join(map(str, shape))}": torch.empty(shape, dtype=dtype)
            for dtype in SAVED_DTYPES
            for shape in EMPTY_SHAPES
        }
    return {**tensors, "array": np.zeros((4096, 0), dtype=np.float32), "w": torch.arange(8.0), "step": 1}


def _assert_same(out: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        got = out[key]
        assert type(got) is type(value), key
        if isinstance(value, (torch.Tensor, np.ndarray)):
            assert got.dtype == value.dtype and tuple(got.shape) == tuple(value.shape), key
    assert torch.equal(out["w"], saved["w"]) and out["step"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_item03_empty_tensors_of_every_dtype_and_shape_round_trip(tmp_path: Path, mode: str) -> None:
    saved = _empty_state()
    assert len(SAVED_DTYPES) >= 30  # the list is torch's, not a few picked by hand
    with Checkpointer(tmp_path, mode=mode) as ckpt:
        ckpt.save(saved, step=1).wait()
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        target = {
            key: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for key, v in saved.items()
        }
        target |= {"w": torch.zeros(8), "step": 0, "array": np.ones((4096, 0), dtype=np.float32)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback, said or not: step 1 itself
            assert ckpt.restore(target) == 1  # before the fix: every read refused the step
        _assert_same(target, saved)
        ckpt.verify(1)
        _assert_same(ckpt.load(1), saved)
    plain = {key: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for key, v in saved.items()}
    plain |= {"w": torch.zeros(8), "array": torch.zeros((4096, 0))}
    dcp.load(plain, checkpoint_id=tmp_path / "step-000001", no_dist=True)
    assert torch.equal(plain["w"], saved["w"])


# -- item 7: a failed restore changes nothing of the caller's -------------------------------------


def _trained(seed: int) -> tuple[torch.nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    return model, optim


def _scheduler_pair(saved_model: torch.nn.Module, model: torch.nn.Module) -> tuple[Any, Any]:
    saved_optim = torch.optim.SGD(saved_model.parameters(), lr=0.1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = [torch.optim.lr_scheduler.StepLR(optim, 2), torch.optim.lr_scheduler.StepLR(optim, 3)]
    return torch.optim.lr_scheduler.StepLR(saved_optim, 2), torch.optim.lr_scheduler.SequentialLR(
        optim, steps, milestones=[2]
    )


def _apply_time_case(case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(saved, target): a model, then an object whose load_state_dict refuses the saved state."""
    saved_model, saved_optim = _trained(0)
    model, _ = _trained(1)
    if case == "scaler":  # a disabled GradScaler's state is {}; an enabled one refuses it
        saved, target = torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu")
    elif case == "scheduler":
        saved, target = _scheduler_pair(saved_model, model)
    else:  # SGD's momentum state into Adam (no "step")
        saved, target = saved_optim, torch.optim.Adam(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        target.step()
    return {"model": saved_model, "x": saved, "n": 1}, {"model": model, "x": target, "n": 0}


def _snapshot(value: Any) -> Any:
    """A deep copy of what restore might change: every tensor cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    if callable(getattr(value, "state_dict", None)):
        return _snapshot(value.state_dict())
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("scaler", "x: GradScaler refuses the saved state (RuntimeError: The source state dict is empty"),
        ("scheduler", "x: SequentialLR refuses the saved state of a StepLR (KeyError: '_schedulers')"),
        ("optimizer", "x: Adam refuses the saved state (KeyError: 'step')"),
    ],
)
def test_item07_an_object_that_refuses_its_state_leaves_everything_as_it_was(
    tmp_path: Path, case: str, message: str
) -> None:
    saved, target = _apply_time_case(case)
    before = _snapshot(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler on the CPU
        with Checkpointer(tmp_path, mode="sync") as ckpt:
            ckpt.save(saved, step=1)
            expected = re.escape(f"cannot restore step-000001 into this state: {message}")
            with pytest.raises(ConfigError, match=expected) as raised:
                ckpt.restore(target)
    assert "\n" not in str(raised.value)
    assert _same(_snapshot(target), before)  # before the fix: the model was loaded, then the error


def test_item07_the_objects_loaded_before_the_one_that_refuses_are_put_back(tmp_path: Path) -> None:
    model, optim = _trained(0)
    schedule = torch.optim.lr_scheduler.StepLR(optim, 2)
    for _ in range(3):
        optim.step()
        schedule.step()
    fresh, fresh_optim = _trained(1)
    target = {
        "model": fresh,
        "schedule": torch.optim.lr_scheduler.StepLR(fresh_optim, 2),  # loads, then is put back
        "scaler": torch.amp.GradScaler("cpu"),  # refuses a disabled scaler's state
    }
    before = _snapshot(target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradScaler on the CPU
        with Checkpointer(tmp_path, mode="sync") as ckpt:
            disabled = torch.amp.GradScaler("cpu", enabled=False)
            ckpt.save({"model": model, "schedule": schedule, "scaler": disabled}, step=1)
            with pytest.raises(ConfigError, match="scaler: GradScaler refuses the saved state"):
                ckpt.restore(target)
    assert target["schedule"].last_epoch == 0  # before the fix: 3, the saved schedule's
    assert _same(_snapshot(target), before)


def test_item07_a_refusal_on_one_rank_puts_back_every_rank(tmp_path: Path) -> None:
    results = run_ranks("refused_on_one_rank", tmp_path / "run")
    for rank, (code, seen, err) in results.items():
        assert code == 0, err
        said = "ConfigError: " + ("" if rank == 1 else "rank 1: ")
        assert seen["outcome"].startswith(said + "cannot restore step-000001 into this state: scaler: "), seen
        # before the fix: rank 0 kept the saved schedule (last_epoch 3) and both loaded the model
        assert seen["last_epoch"] == 0 and seen["step"] == 2 and seen["untouched"], seen


def _two_steps_with_bfloat16(directory: Path) -> Path:
    with Checkpointer(directory, mode="sync") as ckpt:
        for step in (1, 2):
            ckpt.save({**state_of(step), "h": torch.full((8,), float(step), dtype=torch.bfloat16)}, step=step)
    return directory


def test_item07_a_bfloat16_tensor_relabelled_as_an_array_is_damage_refused_before_anything_changes(
    tmp_path: Path,
) -> None:
    run = _two_steps_with_bfloat16(tmp_path / "run")
    rewrite_manifest(run / "step-000002", lambda m: node(m, "h").update(t="ndarray"))
    message = "manifest.json names an array of dtype bfloat16, which numpy lacks"
    with Checkpointer(run, read_only=True) as ckpt:
        for read in (ckpt.verify, ckpt.load):  # before the fix: verify said ok, load a raw TypeError
            with pytest.raises(CheckpointError, match=message):
                read(2)
        state = {**blank(), "h": np.zeros(8, dtype=np.float32)}
        with pytest.raises(CheckpointError, match=message):
            ckpt.restore(state, step=2)
        assert not state["w"].any() and state["step"] == -1  # before the fix: w was overwritten
        with pytest.warns(UserWarning, match=message):
            assert ckpt.restore(state) == 1
    assert_is_step(state, 1)
    assert torch.equal(state["h"], torch.ones(8, dtype=torch.bfloat16))  # step 1's tensor, as saved


@pytest.mark.parametrize(
    ("kind", "value"),
    [("float", 10**400), ("float", -(10**400)), ("float", 2**1024 - 1), ("value", None)],
    ids=["float-10**400", "float--10**400", "float-2**1024-1", "value-without-v"],
)
def test_item07_item08b_a_value_that_does_not_decode_falls_back(run: Path, kind: str, value: Any) -> None:
    """A float past the doubles (a raw OverflowError before), a value node without "v" (a raw
    KeyError before: ``None`` here stands for no "v" at all)."""

    def edit(manifest: dict[str, Any]) -> None:
        node(manifest, "step").clear()
        node(manifest, "step").update({"t": kind} | ({} if value is None else {"v": value}))

    rewrite_manifest(run / "step-000002", edit)
    message = f"has a malformed {kind} value"
    assert_falls_back(run, message)
    with Checkpointer(run, read_only=True) as ckpt:
        for read in (ckpt.load, ckpt.verify):
            with pytest.raises(CheckpointError, match=message):
                read(2)


# -- item 8b: what verify calls good, every reader reads the same ----------------------------------


def _resign_raw(step_dir: Path, edit: Callable[[bytes], bytes]) -> None:
    """Edit the manifest's bytes (JSON that ``json.dumps`` never writes) and re-sign them."""
    rewrite_manifest(step_dir)
    data = (step_dir / "manifest.json").read_bytes()
    prefix = len(b'{"checksum":"0123456789abcdef",')
    rest = edit(data[prefix:])
    (step_dir / "manifest.json").write_bytes(b'{"checksum":"' + checksum(b"{" + rest).encode() + b'",' + rest)


@pytest.mark.parametrize(
    "edit",
    [
        # a JSON object naming a member twice: json.loads takes the last, other parsers the first
        lambda rest: rest.replace(b'{"t":"value","v":2}', b'{"t":"value","v":7,"v":2}', 1),
        lambda rest: rest.replace(b'"tree":{', b'"tree":{"t":"list","items":[],', 1),
        lambda rest: rest.replace(b'{"format":', b'{"step":1,"format":', 1),
    ],
    ids=["value", "tree", "step"],
)
def test_item08b_a_json_member_named_twice_is_damage(run: Path, edit: Callable[[bytes], bytes]) -> None:
    _resign_raw(run / "step-000002", lambda rest: edit(b"{" + rest)[1:])
    assert_falls_back(run, "names a JSON member twice")
    with Checkpointer(run, read_only=True) as ckpt:
        for read in (ckpt.load, ckpt.verify):  # before the fix: verify said ok
            with pytest.raises(CheckpointError, match="names a JSON member twice"):
                read(2)


def test_item08b_a_dict_listing_a_key_twice_is_damage(run: Path) -> None:
    twice = ["step", {"t": "value", "v": 2}]  # the same value: check_values finds nothing wrong
    rewrite_manifest(run / "step-000002", lambda m: m["tree"]["items"].append(twice))
    assert_falls_back(run, "lists key 'step' twice")
    refused = pytest.raises(CheckpointError, match="lists key 'step' twice")
    with Checkpointer(run, read_only=True) as ckpt, refused:
        ckpt.verify(2)  # before the fix: ok


def test_item08b_verify_refuses_the_rng_record_restore_refuses(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Checkpointer(run, mode="sync", capture_rng=True) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
    rewrite_manifest(run / "step-000001", lambda m: m["rng"]["0"].update(random=[3, [1, 2], None, 4]))
    with Checkpointer(run, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match="RNG record is malformed"):
            ckpt.restore({"w": torch.zeros(4)}, step=1)
        with pytest.raises(CheckpointError, match="RNG record is malformed"):
            ckpt.verify(1)  # before the fix: ok
