"""The GPU check: the engine's CUDA paths for correctness, then the engine benchmark on the GPU, as JSON.

    bash scripts/device_check.sh                 # on the device machine (or here, on CPU, to test it)
    .venv/bin/python scripts/device_check.py --json data/results/device-check-cuda.json

On CUDA it exercises what no CPU run can: staging into pinned host images on a side stream
(device-to-host copies that overlap the caller's work, ordered after it by an event), the
``overlap=True`` contract, restore from host buffers onto GPU tensors (host-to-device) in a
fresh process state, ``load(map_location="cuda")``, a failed restore leaving GPU tensors
unchanged, and the CUDA RNG state; FSDP2 on a mesh of one GPU (DTensor shards staged into
pinned memory, restored into a sharded model and into a plain one). Then the benchmark's GPU
sections: the copy floor into pinned memory, the stall against DCP's async save with and
without its pinned stager, persist into /dev/shm and restore from it. Then incremental saves:
an in-place ``.data`` write on the device caught by the on-device fingerprint, and
benchmarks/incremental.py's stall of a frozen GPT's save against its adapters' alone. Then the
bench on many ranks (issue 28, :func:`scale_check`) under torchrun, short (8 MiB a rank, one
repeat) and bounded (``SCALE_TIMEOUT_S``, 240 s a launch): on CUDA the training group is NCCL and
the bench's and nbckpt's coordination gloo, as benchmarks/scale.py runs them. Every part records
its own error instead of stopping the run: one try on the device machine must bring back as much
as it can; a part that could not run on the device is an error, never a silent skip.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nbckpt import Checkpointer, CheckpointError
from nbckpt.bench import Comparison
from nbckpt.bench._internal import ComparisonInterrupted, RankLaunch, run_local_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine as engine_bench
import incremental as incremental_bench


def model_and_optimizer(device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    model.to(device)
    return model, torch.optim.AdamW(model.parameters())


def correctness(device: str, directory: str) -> dict[str, Any]:
    """Saves with overlap on ``device``, restore into fresh objects there, and the failure paths."""
    model, optim = model_and_optimizer(device)
    checks: dict[str, Any] = {}
    with Checkpointer(directory, capture_rng=True, keep=2) as ckpt:
        for step in range(1, 4):
            model(torch.randn(64, 512, device=device)).square().mean().backward()
            handle = ckpt.save({"model": model, "optim": optim, "step": step}, step=step, overlap=True)
            handle.wait_staged()  # the contract: before the optimizer changes the parameters
            optim.step()
            optim.zero_grad()
        ckpt.wait()
        checks["overlap_saves_committed"] = ckpt.latest_step() == 3
        checks["pinned_staging"] = (
            all(image.is_pinned() for slot in ckpt._saver.pool._slots for image in slot.images.values())
            if device == "cuda"
            else None
        )
        expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
        expected_optim = {k: v.clone() for k, v in optim.state_dict()["state"][0].items()}
        record = ckpt.save({"model": model, "optim": optim, "step": 4}, step=4).wait()
        checks["stage_s"], checks["stall_s"], checks["persist_s"] = (
            record.stage_s,
            record.stall_s,
            record.persist_s,
        )
        after_save = torch.rand(3, device=device)  # CUDA (or CPU) RNG right after the save
    fresh_model, fresh_optim = model_and_optimizer(device)
    with torch.no_grad():
        for p in fresh_model.parameters():
            p.zero_()
    with Checkpointer(directory) as ckpt:  # a new Checkpointer: no staging images to reuse
        state = {"model": fresh_model, "optim": fresh_optim, "step": 0}
        checks["restored_step"] = ckpt.restore(state)
        checks["rng_continues"] = torch.equal(torch.rand(3, device=device), after_save)
        checks["bit_exact"] = all(torch.equal(expected[k], v) for k, v in fresh_model.state_dict().items())
        restored_optim = fresh_optim.state_dict()["state"][0]
        checks["optimizer_exact"] = all(
            torch.equal(expected_optim[k], restored_optim[k]) for k in expected_optim
        )
        checks["on_device"] = all(p.device.type == device for p in fresh_model.parameters())
        checks["optimizer_on_device"] = restored_optim["exp_avg"].device.type == device
        loaded = ckpt.load(map_location=device)
        checks["load_map_location"] = loaded["model"]["0.weight"].device.type == device and torch.equal(
            loaded["model"]["0.weight"], expected["0.weight"]
        )
        checks["failed_restore_unchanged"] = failed_restore_leaves_state(ckpt, device)
    checks["ok"] = all(v is not False for v in checks.values())  # None: not checked on this device
    return checks


def failed_restore_leaves_state(ckpt: Checkpointer, device: str) -> bool:
    step_dir = Path(ckpt.store.committed()[4])
    data = sorted(step_dir.glob("*.distcp"))[-1]
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = {"model": model_and_optimizer(device)[0]}
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    try:
        ckpt.restore(target, step=4)
        return False
    except CheckpointError:
        return all(torch.equal(before[k], v) for k, v in target["model"].state_dict().items())


def fsdp_check(device: str, directory: str, repeats: int = 3) -> dict[str, Any]:
    """FSDP2 on a mesh of one (this process, its device): DTensor shards staged into pinned host
    memory, saved asynchronously beside DCP at its best, restored into a fresh sharded model and
    into a plain one on the CPU. Needs a process group: one of its own, on loopback."""
    import socket

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,))

        def sharded(seed: int) -> tuple[Any, torch.optim.Optimizer]:
            model: Any = model_and_optimizer(device)[0]
            torch.manual_seed(seed)
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optim = torch.optim.AdamW(model.parameters())
            model(torch.randn(8, 512, device=device)).square().mean().backward()
            optim.step()
            return model, optim

        model, optim = sharded(0)
        msd: Any
        osd: Any
        msd, osd = get_state_dict(model, optim)
        checks: dict[str, Any] = {"dtensors": type(msd["0.weight"]).__name__ == "DTensor"}
        stalls: list[float] = []
        with Checkpointer(directory, keep=1) as ckpt:
            for step in range(1, repeats + 2):
                began = time.perf_counter()
                handle = ckpt.save({"model": msd, "optim": osd, "step": step}, step=step)
                stalls.append(time.perf_counter() - began)
                handle.wait()
            checks["pinned_staging"] = (
                all(image.is_pinned() for slot in ckpt._saver.pool._slots for image in slot.images.values())
                if device == "cuda"
                else None
            )
        checks["stall_s"] = stalls[1:]  # the first one plans and allocates
        expected: Any = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
        fresh, fresh_optim = sharded(5)
        fmsd, fosd = get_state_dict(fresh, fresh_optim)
        target: dict[str, Any] = {"model": fmsd, "optim": fosd, "step": 0}
        with Checkpointer(directory, read_only=True) as ckpt:
            checks["restored_step"] = ckpt.restore(target)
        set_state_dict(fresh, fresh_optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
        got: Any = get_state_dict(fresh, fresh_optim, options=StateDictOptions(full_state_dict=True))
        checks["bit_exact"] = all(torch.equal(expected[0][k], got[0][k]) for k in expected[0])
        checks["optimizer_exact"] = all(
            torch.equal(v, got[1]["state"][k][n])
            for k, per in expected[1]["state"].items()
            for n, v in per.items()
        )
        checks["on_device"] = all(p.to_local().device.type == device for p in fresh.parameters())
        plain, _ = model_and_optimizer("cpu")
        with Checkpointer(directory, ranks="local", read_only=True) as ckpt:
            ckpt.restore({"model": plain})
        checks["plain_cpu_exact"] = all(
            torch.equal(expected[0][k].cpu(), v) for k, v in plain.state_dict().items()
        )
    finally:
        dist.destroy_process_group()
    checks["ok"] = all(v is not False for v in checks.values())
    return checks


def incremental_check(device: str, directory: str) -> dict[str, Any]:
    """``incremental=True`` on ``device``: the frozen base is written by the first save only, an
    in-place change through ``.data`` (which torch's version counter does not see) is caught by the
    fingerprint, computed where the tensor lives, and every step restores bit for bit."""
    torch.manual_seed(0)

    def fine_tune() -> dict[str, Any]:
        base = torch.nn.Linear(1024, 1024).to(device).requires_grad_(False)
        head = torch.nn.Linear(1024, 16).to(device)
        return {"base": base, "head": head, "optim": torch.optim.AdamW(head.parameters())}

    state = fine_tune()
    base, head, optim = state["base"], state["head"], state["optim"]
    written: dict[int, int] = {}
    expected: dict[int, dict[str, torch.Tensor]] = {}
    with Checkpointer(directory, incremental=True) as ckpt:
        for step in range(1, 4):
            if step == 3:
                base.weight.data[0, 0] += 1.0  # .data: a write the version counter never sees
            head(base(torch.randn(8, 1024, device=device))).square().mean().backward()
            optim.step()
            optim.zero_grad()
            written[step] = ckpt.save(state, step=step).wait().bytes_written
            expected[step] = {k: v.detach().clone() for k, v in base.state_dict().items()}
    weight = base.weight.nbytes
    checks: dict[str, Any] = {
        "written": written,
        "first_writes_base": written[1] >= weight,
        "unchanged_base_not_written": written[2] < weight / 4,
        "data_write_caught": written[3] >= weight,
    }
    with Checkpointer(directory) as ckpt:
        for step in range(1, 4):
            fresh = fine_tune()
            ckpt.restore(fresh, step=step)
            restored = fresh["base"].state_dict()
            checks[f"step{step}_bit_exact"] = all(
                torch.equal(restored[k], v) for k, v in expected[step].items()
            )
    checks["ok"] = all(v is not False for v in checks.values())
    return checks


def incremental_benchmark(device: str, directory: str) -> dict[str, Any]:
    """benchmarks/incremental.py in one process on ``device``: the stall of an incremental save of
    a frozen GPT against saving its adapters alone (on a GPU the fingerprint runs on the device)."""
    preset = "base" if device == "cuda" else "tiny"
    args = incremental_bench.options().parse_args(
        ["--device", device, "--ranks", "1", "--preset", preset, "--repeats", "3", "--dir", directory]
    )
    return incremental_bench.run(args)


#: Each launch of the scale check ends after this many seconds (its ranks with it): an error.
SCALE_TIMEOUT_S = float(os.environ.get("SCALE_TIMEOUT_S", "240"))


def scale_ranks(device: str) -> int:
    """Ranks for the scale check: 2 on the CPU; on CUDA one per GPU, at most 2. NCCL refuses two
    ranks on one device ("Duplicate GPU detected"), and the bench gives each rank a GPU of its own,
    so one GPU runs one rank (its training group still NCCL, the FSDP2 launch's collectives on it)."""
    return 2 if device == "cpu" else min(torch.cuda.device_count(), 2)


def bench_on_ranks(device: str, ranks: int, directory: str, options: list[str]) -> Comparison:
    """``nbckpt bench`` under torchrun on ``ranks`` local ranks of ``device``, ended (every rank
    with it) after :data:`SCALE_TIMEOUT_S` with an error saying so. Warmed up, as benchmarks/scale.py
    runs it: each strategy's first-save costs stay out of its two checkpoints' figures (without it,
    dcp-async-stager's first upload spawned DCP's checkpoint process, about 4.7 s on 2 CPU ranks,
    and its second save waited for it: a median stall of seconds for a save of milliseconds)."""
    expired = threading.Event()
    timers: list[threading.Timer] = []

    def bound(launch: RankLaunch) -> None:
        def end() -> None:
            expired.set()
            launch.terminate()

        timers.append(threading.Timer(SCALE_TIMEOUT_S, end))
        timers[0].start()

    argv = ["--dir", directory, "--device", device, "--repeats", "1", "--quiet", *options]
    try:
        return run_local_ranks(
            ranks,
            argv,
            directory,
            on_event=lambda _event: None,
            on_line=lambda line: print(f"  [{ranks} rank(s)] {line}", file=sys.stderr, flush=True),
            on_start=bound,
            device=device,
        )
    except ComparisonInterrupted as exc:
        if not expired.is_set():
            raise  # Ctrl-C here
        raise RuntimeError(f"the bench on {ranks} {device} rank(s) ran past {SCALE_TIMEOUT_S:.0f} s") from exc
    finally:
        for timer in timers:
            timer.cancel()


def scale_check(device: str, directory: str) -> dict[str, Any]:
    """The bench on many ranks on ``device`` (issue 28), short: a synthetic 8 MiB a rank with
    nbckpt async, its overlap and DCP at its best, as benchmarks/scale.py runs them; then the GPT
    sharded with FSDP2 (its all-gathers and reduce-scatters on the training group: NCCL on CUDA,
    even with one rank). Each rank's checkpoints must be in the job's figures."""
    ranks = scale_ranks(device)
    if ranks < 1:
        raise RuntimeError(f"no GPU for the scale check on {device}")
    schedule = ["--steps", "6", "--every", "3"]
    launches = {
        "synthetic": [
            *("--size-mb", "8", "--compute-ms", "5", *schedule),
            *("--strategies", "nbckpt-async,nbckpt-async-overlap,dcp-async-stager"),
        ],
        "fsdp": ["--preset", "tiny", "--fsdp", *schedule, "--strategies", "nbckpt-async"],
    }
    checks: dict[str, Any] = {"ranks": ranks, "training_group": "nccl" if device == "cuda" else "gloo"}
    for name, options in launches.items():
        begin = time.perf_counter()
        found = bench_on_ranks(device, ranks, os.path.join(directory, name), options)
        writers = [row for row in found.job["strategies"] if row["strategy"] != "none"]
        checks[name] = {
            "seconds": time.perf_counter() - begin,
            "device": found.device,
            "world_size": found.job["world_size"],
            "persist_gbs": {row["strategy"]: row["aggregate_persist_gbs"] for row in writers},
            "stall_s": {row["strategy"]: row["stall_s"]["median"] for row in writers},
            # host compute on the CPU only: the raw write beside training (job.floors.beside_training)
            "floor_beside_gbs": (found.job["floors"].get("beside_training") or {}).get("write_gbs"),
            "every_rank_wrote": bool(writers)
            and all(cp["ranks_writing"] == ranks for row in writers for cp in row["checkpoints"])
            and all(row["checkpoints"] for row in writers),
        }
        checks[f"{name}_ok"] = (
            found.device == device and found.job["world_size"] == ranks and checks[name]["every_rank_wrote"]
        )
    checks["ok"] = checks["synthetic_ok"] and checks["fsdp_ok"]
    return checks


def guarded(name: str, run: Callable[[], Any], errors: dict[str, str]) -> Any:
    try:
        return run()
    except Exception:
        errors[name] = traceback.format_exc(limit=8)
        print(f"{name} failed:\n{errors[name]}", file=sys.stderr, flush=True)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="data/results/device-check.json")
    parser.add_argument("--size-mb", type=float, default=2048, help="state for the benchmark sections")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    errors: dict[str, str] = {}
    result: dict[str, Any] = {
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "unix_time": time.time(),
        "errors": errors,
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result["correctness"] = guarded(
            "correctness", lambda: correctness(device, os.path.join(tmp, "c")), errors
        )
        result["fsdp"] = guarded("fsdp", lambda: fsdp_check(device, os.path.join(tmp, "f")), errors)
        result["incremental"] = guarded(
            "incremental", lambda: incremental_check(device, os.path.join(tmp, "i")), errors
        )
        result["incremental_benchmark"] = guarded(
            "incremental_benchmark", lambda: incremental_benchmark(device, os.path.join(tmp, "ib")), errors
        )
        result["scale"] = guarded("scale", lambda: scale_check(device, os.path.join(tmp, "s")), errors)
        bench = engine_bench.parse(
            [
                "--device",
                device,
                "--size-mb",
                str(args.size_mb),
                "--repeats",
                str(args.repeats),
                "--dir",
                os.path.join(tmp, "bench"),
                "--keep-going",
                "--only",
                "copy_floor,stall,stall_model,persist_shm,restore_shm,persist_disk",
            ]
        )
        result["benchmark"] = guarded("benchmark", lambda: engine_bench.run(bench), errors)
    print(json.dumps(result["correctness"], indent=1))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    ok = (
        all(
            bool(result[part] and result[part]["ok"])
            for part in ("correctness", "fsdp", "incremental", "scale")
        )
        and not errors
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
