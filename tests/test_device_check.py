"""The prepared GPU check (scripts/device_check.py) runs its correctness parts on CPU here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "device_check.py"  # tests/ is one level down


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_correctness_on_cpu(tmp_path: Path) -> None:
    checks = _script().correctness("cpu", str(tmp_path / "ckpt"))
    assert checks["ok"] and checks["bit_exact"] and checks["restored_step"] == 4
    assert checks["overlap_saves_committed"] and checks["optimizer_exact"] and checks["rng_continues"]
    assert checks["failed_restore_unchanged"] and checks["load_map_location"]


def test_device_check_fsdp_on_cpu(tmp_path: Path) -> None:
    checks = _script().fsdp_check("cpu", str(tmp_path / "fsdp"), repeats=1)
    assert checks["ok"] and checks["dtensors"] and checks["restored_step"] == 2
    assert checks["bit_exact"] and checks["optimizer_exact"] and checks["plain_cpu_exact"]


def test_device_check_incremental_on_cpu(tmp_path: Path) -> None:
    checks = _script().incremental_check("cpu", str(tmp_path / "incremental"))
    assert checks["ok"] and checks["data_write_caught"] and checks["unchanged_base_not_written"]
    assert all(checks[f"step{step}_bit_exact"] for step in (1, 2, 3))


def test_the_scale_check_warms_each_strategy_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its launches are measured past each strategy's first save: unwarmed, dcp-async-stager's
    second save waited for the first's upload spawning DCP's checkpoint process, and the check
    reported a median stall of 3-5.8 s on 2 ranks for saves of milliseconds."""
    script, launched = _script(), []

    def launch(ranks: int, argv: list[str], *args: Any, **kwargs: Any) -> Any:
        launched.append(argv)
        raise RuntimeError("launched")

    monkeypatch.setattr(script, "run_local_ranks", launch)
    with pytest.raises(RuntimeError, match="launched"):
        script.scale_check("cpu", str(tmp_path))
    # its argv, not the bench's parser: that is the bench layer's private module (test_layout)
    assert launched and not [arg for arg in launched[0] if arg.startswith("--no-w")]
