"""What changed between two checkpoints, tensor by tensor.

    >>> from nbckpt.analysis import diff_states
    >>> diff_states(ckpt.load(100, map_location="cpu"), ckpt.load(200, map_location="cpu")).head()

Either side may be anything a Checkpointer saves (a loaded checkpoint, a live module or
optimizer, a dict of those): it is flattened as the engine flattens it, so the keys are the
ones in the checkpoint's files (``model.fc.weight``, ``optim.state.0.exp_avg``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd
import torch

from ..engine._internal import flatten

__all__ = ["DIFF_COLUMNS", "DIFF_STATUSES", "diff_states"]

#: The statuses, in the order :func:`diff_states` lists them (most changed first).
#: ``reshaped``: the shape or the dtype differs, so the elements do not compare one by one.
DIFF_STATUSES = ("reshaped", "added", "removed", "changed", "unchanged")
#: Columns of the frame :func:`diff_states` returns.
DIFF_COLUMNS = [
    "key",
    "status",
    "dtype",
    "shape",
    "numel",
    "changed_elements",
    "diff_norm",
    "max_abs_diff",
    "rel_change",
    "cosine",
]
_NAN = float("nan")


def diff_states(a: Mapping[str, Any], b: Mapping[str, Any]) -> pd.DataFrame:
    """Compare every tensor of state ``a`` with the tensor of the same key in state ``b``.

    One row per key (:data:`DIFF_COLUMNS`), most changed first: status (:data:`DIFF_STATUSES`),
    dtype and shape (``"float32 -> float16"`` where they differ), how many elements differ and,
    for floating-point tensors, in float64, the norm of ``b - a``, the largest absolute
    difference, ``|b - a| / |a|`` (inf from all zeros) and the cosine (NaN beside all zeros).
    Other tensors compare by equality; NaNs in the same place are equal; non-tensors are skipped.
    """
    left, right = flatten(a).tensors, flatten(b).tensors
    keys = [*left, *(key for key in right if key not in left)]
    rows = [_compare(key, left.get(key), right.get(key)) for key in keys]
    frame = pd.DataFrame(rows, columns=DIFF_COLUMNS)
    frame["_rank"] = frame["status"].map({status: i for i, status in enumerate(DIFF_STATUSES)})
    frame = frame.sort_values(
        ["_rank", "rel_change", "changed_elements", "key"],
        ascending=[True, False, False, True],
        na_position="last",
        kind="stable",
    )
    return frame.drop(columns="_rank").reset_index(drop=True)


def _kind(tensor: torch.Tensor) -> tuple[str, str]:
    return str(tensor.dtype).removeprefix("torch."), str(tuple(tensor.shape))


def _row(key: str, status: str, tensor: torch.Tensor, **numbers: float) -> dict[str, Any]:
    """One row of the frame; the numbers not given are NaN (``DIFF_COLUMNS`` fills them)."""
    dtype, shape = _kind(tensor)
    return {
        "key": key,
        "status": status,
        "dtype": dtype,
        "shape": shape,
        "numel": tensor.numel(),
        "changed_elements": tensor.numel(),
        **numbers,
    }


def _compare(key: str, a: torch.Tensor | None, b: torch.Tensor | None) -> dict[str, Any]:
    if a is None:
        assert b is not None
        return _row(key, "added", b)
    if b is None:
        return _row(key, "removed", a)
    if a.shape != b.shape or a.dtype != b.dtype:
        row = _row(key, "reshaped", b)
        (dtype_a, shape_a), (dtype_b, shape_b) = _kind(a), _kind(b)
        row["dtype"] = dtype_b if dtype_a == dtype_b else f"{dtype_a} -> {dtype_b}"
        row["shape"] = shape_b if shape_a == shape_b else f"{shape_a} -> {shape_b}"
        return row
    if b.device != a.device:
        b = b.to(a.device)
    changed = _changed_elements(a, b)
    status = "changed" if changed else "unchanged"
    if not a.is_floating_point():
        return _row(key, status, b, changed_elements=changed)
    if a.numel() == 0:
        return _row(key, status, b, changed_elements=0, diff_norm=0.0, max_abs_diff=0.0, rel_change=0.0)
    return _row(key, status, b, changed_elements=changed, **_float_numbers(a, b))


def _changed_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    changed = int(torch.count_nonzero(a != b))
    if changed and a.is_floating_point():
        # NaN != NaN: a NaN that stayed where it was is not a change.
        changed -= int(torch.count_nonzero(torch.isnan(a) & torch.isnan(b)))
    return changed


def _float_numbers(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    # One contiguous float64 copy of ``a`` becomes the difference in place (``b`` is promoted
    # element by element, never copied whole), and the cosine comes from squared norms, so no
    # product of the two tensors is ever materialized either.
    diff = torch.empty(a.shape, dtype=torch.float64, device=a.device).copy_(a)
    flat = diff.view(-1)
    square_a = float(torch.dot(flat, flat))
    norm_b = float(torch.linalg.vector_norm(b, dtype=torch.float64))
    diff.sub_(b)
    square_d = float(torch.dot(flat, flat))
    max_d = float(torch.linalg.vector_norm(flat, ord=math.inf))
    del diff, flat
    norm_a, norm_d = math.sqrt(square_a), math.sqrt(square_d)
    if math.isnan(norm_a) or math.isnan(norm_d):
        relative = _NAN  # a NaN somewhere: no number says how much it moved
    elif norm_a > 0:
        relative = norm_d / norm_a
    else:
        relative = 0.0 if norm_d == 0 else math.inf
    cosine = _NAN
    if norm_a > 0 and norm_b > 0:
        # a.b = (|a|^2 + |b|^2 - |a - b|^2) / 2, from the squares as summed (orthogonal is 0.0)
        dot = (square_a + norm_b * norm_b - square_d) / 2
        cosine = max(-1.0, min(1.0, dot / (norm_a * norm_b)))
    return {"diff_norm": norm_d, "max_abs_diff": max_d, "rel_change": relative, "cosine": cosine}
