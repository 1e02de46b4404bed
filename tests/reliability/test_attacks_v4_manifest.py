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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from nbckpt import Checkpointer

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


def _empty_state() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32: "experimental"
        tensors = {
            f"{str(dtype).removeprefix('torch.')}_{'x'.join(map(str, shape))}": torch.empty(shape, dtype=dtype)
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
