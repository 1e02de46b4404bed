"""GPU (or CPU) correctness checks of the engine plus a short two-size benchmark, as JSON.

    .venv/bin/python scripts/device_check.py --json data/results/device-check.json

On CUDA this exercises pinned staging buffers, the side copy stream and its event, overlap
mode and restore onto GPU tensors; on a machine without CUDA the same checks run on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

import torch

from nbckpt import Checkpointer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import engine as engine_bench


def correctness(device: str, directory: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    model.to(device)
    optim = torch.optim.AdamW(model.parameters())
    checks: dict[str, Any] = {}
    with Checkpointer(directory, capture_rng=True, keep=2) as ckpt:
        for step in range(1, 4):
            model(torch.randn(64, 512, device=device)).square().mean().backward()
            handle = ckpt.save({"model": model, "optim": optim, "step": step}, step=step, overlap=True)
            handle.wait_staged()  # the contract: before the optimizer mutates parameters
            optim.step()
            optim.zero_grad()
        ckpt.wait()
        saved_step = ckpt.latest_step()
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        record = ckpt.save({"model": model, "optim": optim, "step": 4}, step=4).wait()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        state = {"model": model, "optim": optim, "step": 0}
        restored = ckpt.restore(state)
        checks["restored_step"] = restored
        checks["bit_exact"] = all(torch.equal(expected[k], v) for k, v in model.state_dict().items())
        checks["on_device"] = all(p.device.type == torch.device(device).type for p in model.parameters())
        checks["overlap_saves_committed"] = saved_step == 3
        checks["stage_s"] = record.stage_s
        checks["stall_s"] = record.stall_s
    checks["ok"] = bool(checks["bit_exact"] and checks["on_device"] and restored == 4)
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="data/results/device-check.json")
    parser.add_argument("--sizes-mb", default="256,2048")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "unix_time": time.time(),
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result["correctness"] = correctness(device, os.path.join(tmp, "correctness"))
        result["benchmarks"] = [
            engine_bench.run(float(size), os.path.join(tmp, f"bench{size}"), repeats=2, device=device)
            for size in args.sizes_mb.split(",")
        ]
    for bench in result["benchmarks"]:
        engine_bench.print_table(bench)
    print(json.dumps(result["correctness"], indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as stream:
        json.dump(result, stream, indent=1)
    return 0 if result["correctness"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
