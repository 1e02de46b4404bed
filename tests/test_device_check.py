"""The prepared GPU check (scripts/device_check.py) runs its correctness part on CPU here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "device_check.py"  # tests/ is one level down


def test_device_check_correctness_on_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checks = module.correctness("cpu", str(tmp_path / "ckpt"))
    assert checks["ok"] and checks["bit_exact"] and checks["restored_step"] == 4
    assert checks["overlap_saves_committed"] and checks["optimizer_exact"] and checks["rng_continues"]
    assert checks["failed_restore_unchanged"] and checks["load_map_location"]


def test_device_check_fsdp_on_cpu(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checks = module.fsdp_check("cpu", str(tmp_path / "fsdp"), repeats=1)
    assert checks["ok"] and checks["dtensors"] and checks["restored_step"] == 2
    assert checks["bit_exact"] and checks["optimizer_exact"] and checks["plain_cpu_exact"]
