"""nbckpt.analysis (the published figures): the published figures and their sources."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nbckpt import ConfigError
from nbckpt.analysis._reference import SOURCE_PATH, cite, load_published, published_table


def published_value(anchor: str, name: str) -> Any:
    return load_published()["anchors"][anchor]["values"][name]["value"]


def test_the_one_copy_ships_with_the_package() -> None:
    assert SOURCE_PATH.is_file() and SOURCE_PATH.parent.parent.name == "analysis"
    assert load_published() == json.loads(SOURCE_PATH.read_text())


def test_every_value_has_units_and_every_anchor_a_source() -> None:
    anchors = load_published()["anchors"]
    assert len(anchors) >= 9
    for name, entry in anchors.items():
        assert entry["what"], name
        assert entry["source"]["title"], name
        assert entry["source"].get("url") or entry["source"].get("venue"), name
        for quantity, item in entry["values"].items():
            assert isinstance(item["value"], int | float | list), (name, quantity)
            assert item["units"], (name, quantity)


@pytest.mark.parametrize(
    ("anchor", "name", "value"),
    [
        ("pure_storage_flashblade", "overhead_reduction", 90),
        ("pytorch_ibm_7b", "sync_downtime", 148.8),
        ("pytorch_ibm_7b", "async_downtime", 6.3),
        ("pytorch_ibm_7b", "reduction_factor", 23.6),
        ("pytorch_ibm_7b", "blocking_7b_to_13b", [6, 14]),
        ("pytorch_6x_cached_plans", "blocking", 0.78),
        ("pytorch_6x_cached_plans", "background_before", 436),
        ("pytorch_6x_cached_plans", "background_after", 67),
        ("torchtitan_zero_overhead", "blocking", 0.02),
        ("checkfreq", "overhead", 3.5),
        ("orbax_async", "blocking_reduction_340b", 97),
        ("bytecheckpoint", "reduction_factor", 54.2),
        ("mlperf_storage_checkpoint_sizes", "405B", 5290),
        ("h100_host_transfer", "device_to_host", 52.8),
        ("llama3_interruptions", "unexpected_interruptions", 419),
        ("llama3_interruptions", "days", 54),
        ("llama3_interruptions", "gpus", 16384),
    ],
)
def test_published_values(anchor: str, name: str, value: object) -> None:
    assert published_value(anchor, name) == value


def test_ratio_is_consistent_with_its_times() -> None:
    # 148.8 s / 6.3 s = 23.62
    sync, after = (published_value("pytorch_ibm_7b", name) for name in ("sync_downtime", "async_downtime"))
    assert sync / after == pytest.approx(published_value("pytorch_ibm_7b", "reduction_factor"), abs=0.05)


def test_cite_and_table() -> None:
    assert "pytorch.org/blog/reducing-checkpointing-times" in cite("pytorch_ibm_7b")
    table = published_table()
    assert {"anchor", "quantity", "value", "units", "source"} <= set(table.columns)
    assert len(table) == sum(len(entry["values"]) for entry in load_published()["anchors"].values())


def test_loaded_copy_can_be_edited_without_affecting_the_next_load() -> None:
    published = load_published()
    published["anchors"].clear()
    assert load_published()["anchors"]


def test_bad_names_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="known"):
        cite("nope")
