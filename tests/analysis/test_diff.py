"""diff_states: per-tensor differences with known answers, and the order a reader wants."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import pytest
import torch

from nbckpt.analysis._diff import DIFF_COLUMNS, DIFF_STATUSES, diff_states


def by_key(frame: pd.DataFrame) -> dict[str, dict[str, Any]]:
    return {row["key"]: row for row in frame.to_dict(orient="records")}


def test_a_known_perturbation_gives_known_numbers() -> None:
    a = {"w": torch.tensor([3.0, 4.0]), "nested": {"v": torch.tensor([1.0, 0.0], dtype=torch.float16)}}
    b = {"w": torch.tensor([3.0, 5.0]), "nested": {"v": torch.tensor([0.0, 1.0], dtype=torch.float16)}}
    frame = diff_states(a, b)
    assert list(frame.columns) == DIFF_COLUMNS
    rows = by_key(frame)
    w = rows["w"]
    assert (w["status"], w["dtype"], w["shape"], w["numel"], w["changed_elements"]) == (
        "changed",
        "float32",
        "(2,)",
        2,
        1,
    )
    assert w["diff_norm"] == pytest.approx(1.0) and w["max_abs_diff"] == pytest.approx(1.0)
    assert w["rel_change"] == pytest.approx(1.0 / 5.0)
    # a.b / (|a| |b|) = 29 / (5 * sqrt(34))
    assert w["cosine"] == pytest.approx(29 / (5 * math.sqrt(34)), rel=1e-12)
    v = rows["nested.v"]  # nested dicts flatten to the engine's dotted keys
    assert v["cosine"] == 0.0  # orthogonal
    assert v["diff_norm"] == pytest.approx(math.sqrt(2)) and v["rel_change"] == pytest.approx(math.sqrt(2))
    assert v["dtype"] == "float16"


def test_float64_arithmetic_sees_changes_below_float32_resolution() -> None:
    base = torch.full((1000,), 1e8, dtype=torch.float64)
    bumped = base.clone()
    bumped[7] += 1.0  # 1e8 + 1 is exact in float64
    row = by_key(diff_states({"x": base}, {"x": bumped}))["x"]
    assert row["status"] == "changed" and row["changed_elements"] == 1
    assert row["diff_norm"] == 1.0 and row["max_abs_diff"] == 1.0
    assert row["rel_change"] == pytest.approx(1.0 / (1e8 * math.sqrt(1000)), rel=1e-9)


def test_identical_states_are_unchanged_and_nothing_is_modified() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    state = {"model": model.state_dict(), "x": torch.tensor([float("nan"), 1.0], dtype=torch.float64)}
    before = {k: t.clone() for k, t in model.state_dict().items()}
    frame = diff_states(state, {"model": model, "x": state["x"].clone()})  # a live module flattens too
    assert set(frame["status"]) == {"unchanged"}
    assert sorted(frame["key"]) == ["model.bias", "model.weight", "x"]  # NaN in place is no change
    rows = by_key(frame)
    assert rows["model.weight"]["diff_norm"] == 0.0 and rows["model.weight"]["rel_change"] == 0.0
    assert rows["model.weight"]["cosine"] == pytest.approx(1.0, abs=1e-15)
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())


def test_integer_and_bool_tensors_compare_by_equality() -> None:
    a = {"ids": torch.tensor([1, 2, 3]), "mask": torch.tensor([True, False]), "n": torch.tensor(5)}
    b = {"ids": torch.tensor([1, 2, 4]), "mask": torch.tensor([True, False]), "n": torch.tensor(5)}
    rows = by_key(diff_states(a, b))
    assert rows["ids"]["status"] == "changed" and rows["ids"]["changed_elements"] == 1
    assert rows["ids"]["dtype"] == "int64"
    assert math.isnan(rows["ids"]["diff_norm"]) and math.isnan(rows["ids"]["cosine"])
    assert rows["mask"]["status"] == rows["n"]["status"] == "unchanged"


def test_added_removed_reshaped_and_the_order_most_changed_first() -> None:
    a = {
        "same": torch.ones(4),
        "small": torch.tensor([10.0, 10.0]),
        "big": torch.tensor([1.0, 1.0]),
        "gone": torch.zeros(3),
        "grows": torch.zeros(2, 2),
        "cast": torch.zeros(2),
        "from_zero": torch.zeros(2),
        "steps": torch.tensor([1, 2]),
    }
    b = {
        "same": torch.ones(4),
        "small": torch.tensor([10.0, 11.0]),
        "big": torch.tensor([1.0, 3.0]),
        "new": torch.ones(5),
        "grows": torch.zeros(2, 3),
        "cast": torch.zeros(2, dtype=torch.float64),
        "from_zero": torch.tensor([0.0, 2.0]),
        "steps": torch.tensor([1, 3]),
        "plain": 7,  # values beside the tensors are not compared
    }
    frame = diff_states(a, b)
    assert list(frame["key"]) == [
        "grows",
        "cast",
        "new",
        "gone",
        "from_zero",
        "big",
        "small",
        "steps",
        "same",
    ]
    assert list(dict.fromkeys(frame["status"])) == list(DIFF_STATUSES)
    rows = by_key(frame)
    assert rows["grows"]["shape"] == "(2, 2) -> (2, 3)" and rows["grows"]["dtype"] == "float32"
    assert rows["cast"]["dtype"] == "float32 -> float64" and rows["cast"]["shape"] == "(2,)"
    assert rows["new"]["numel"] == 5 and rows["gone"]["numel"] == 3
    assert rows["from_zero"]["rel_change"] == math.inf and math.isnan(rows["from_zero"]["cosine"])
    assert rows["big"]["rel_change"] == pytest.approx(2 / math.sqrt(2))
    assert rows["small"]["rel_change"] == pytest.approx(1 / math.sqrt(200))


def test_an_optimizer_step_changes_weights_and_adam_moments() -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 2)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    before = {
        "model": {k: t.clone() for k, t in model.state_dict().items()},
        "optim": {
            "state": {i: {k: t.clone() for k, t in s.items()} for i, s in optim.state_dict()["state"].items()}
        },
    }
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    frame = diff_states(before, {"model": model, "optim": optim})
    rows = by_key(frame)
    assert {"model.weight", "model.bias", "optim.state.0.exp_avg", "optim.state.1.exp_avg_sq"} <= set(rows)
    weight = rows["model.weight"]
    assert weight["status"] == "changed"
    moved = model.weight.detach().double() - before["model"]["weight"].double()
    assert weight["diff_norm"] == pytest.approx(float(moved.norm()), rel=1e-12)
    assert weight["max_abs_diff"] == pytest.approx(float(moved.abs().max()), rel=1e-12)
    assert 0.01 < weight["max_abs_diff"] < 0.2  # Adam moves a weight by about lr (0.1) a step
    assert rows["optim.state.0.step"]["status"] == "changed"
