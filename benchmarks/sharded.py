"""Sharded benchmark: nbckpt against DCP at its best on FSDP2 state (model + AdamW), on 2 and 4
CPU ranks, saving and restoring at the same world size and resharded (2 -> 4, 4 -> 2).

    .venv/bin/python benchmarks/sharded.py --json data/results/sharded-cpu.json
    .venv/bin/python benchmarks/sharded.py --quick          # a small model: checks the script
    .venv/bin/python benchmarks/sharded.py --reprint data/results/sharded-cpu.json

Three torchrun launches share one directory: 2 ranks save; 4 ranks save, restore their own and
what 2 wrote; 2 ranks restore their own and what 4 wrote. In each, nbckpt (async, one save in flight) and
``dcp.async_save`` at its best (a reused ``DefaultStager``, cached save plans, the process
executor, as torchtitan's ``async_with_pinned_mem``) take turns within every repeat, in
alternating order. *Stall* is how long training waits: until ``save`` returns for nbckpt,
until the staging future is done for DCP (the optimizer must not change the parameters
before). *Durable* is until the step has committed. Times are the slowest rank's (training
waits for every rank at its next collective); CPU seconds are all ranks' and their
children's (DCP's writer process) over save-to-durable, per GB of state; peak memory is each
rank's resident size above its baseline during the save, DCP's writer process counted apart
(its shared staging buffers are in both). Each row: the median and a 95 % t-interval of the
mean over repeats; each check: the ratio per repeat, median and the interval of its geometric
mean, against the issue's target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import cpu_seconds, interval, machine, ratio_interval, write_json  # the same statistics

GB = 1e9
METHODS = ("nbckpt", "dcp-best")


# -- one rank ---------------------------------------------------------------------------------------


def model_of(model_mb: float, seed: int) -> torch.nn.Sequential:
    """Blocks of Linear(d, 4d), Linear(4d, d) and an embedding of odd rows (uneven shards)."""
    width = 1024 if model_mb >= 50 else 256
    block_mb = 8 * width * width * 4 / 1e6
    blocks = max(1, round((model_mb * 0.85) / block_mb))
    rows = int(model_mb * 0.15 * 1e6 / 4 / width) | 1
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = [torch.nn.Embedding(rows, width)]
    layers += [
        torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
        )
        for _ in range(blocks)
    ]
    return torch.nn.Sequential(*layers)


def sharded(model_mb: float, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = model_of(model_mb, seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 7, (2, 4))).square().mean().backward()  # AdamW's state exists from here on
    optim.step()
    optim.zero_grad()
    return model, optim


class PeakMemory:
    """Resident memory above ``base`` (this rank's, its children's) while the block runs: this
    rank, and its children (DCP's writer process)."""

    def __init__(self, base: tuple[int, int]) -> None:
        self.process = psutil.Process()
        self.base = base
        self.own = self.children = 0

    def _sample(self) -> tuple[int, int]:
        children = 0
        for child in self.process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                children += child.memory_info().rss
        return self.process.memory_info().rss, children

    def __enter__(self) -> PeakMemory:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            own, children = self._sample()
            self.own = max(self.own, own - self.base[0])
            self.children = max(self.children, children - self.base[1])

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def state_of(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd, "step": 1}


def local_bytes(state: Any) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return int(state.to_local().nbytes)
    if isinstance(state, torch.Tensor):
        return int(state.nbytes)
    if isinstance(state, dict):
        return sum(local_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_bytes(v) for v in state)
    return 0


class Savers:
    """The two methods, open for the whole launch (as a training job keeps them)."""

    def __init__(self, root: Path, world: int) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        from nbckpt import Checkpointer

        self.root, self.world = root, world
        self.ckpt = Checkpointer(root / f"nbckpt@{world}", mode="async", keep=1, timeout_s=300)
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )
        self.planner = DefaultSavePlanner(enable_plan_caching=True)

    def save(self, method: str, state: dict[str, Any], step: int) -> dict[str, float]:
        """One save, timed: stall (until training may go on) and durable (until committed)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict_saver import (
            AsyncCheckpointerType,
            AsyncSaveResponse,
            async_save,
        )

        dist.barrier()
        cpu, began = cpu_seconds(), time.perf_counter()
        # Above the resident size just before: a first save shows the memory a method takes
        # (staging buffers, a writer process), later saves what each save adds on top of it.
        with PeakMemory(PeakMemory((0, 0))._sample()) as peak:
            if method == "nbckpt":
                handle = self.ckpt.save(state, step=step)
                stalled = time.perf_counter()
                handle.wait()
            else:
                response = async_save(
                    state,
                    checkpoint_id=str(self.root / f"dcp@{self.world}" / f"step-{step}"),
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                    async_stager=self.stager,
                    planner=self.planner,
                )
                assert isinstance(response, AsyncSaveResponse)  # an async stager gives both futures
                response.staging_completion.result()
                stalled = time.perf_counter()
                response.upload_completion.result()
        durable = time.perf_counter()
        return {
            "stall_s": stalled - began,
            "durable_s": durable - began,
            "cpu_s": cpu_seconds() - cpu,
            "peak_mb": peak.own / 1e6,
            "writer_peak_mb": peak.children / 1e6,
        }

    def close(self) -> None:
        self.ckpt.close()
        self.stager.close()


def restore(method: str, directory: Path, model_mb: float) -> dict[str, float]:
    """A fresh sharded model restores the newest step of ``directory``'s method, timed."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from nbckpt import Checkpointer

    model, optim = sharded(model_mb, seed=9)
    template = state_of(model, optim)
    # Opened before the clock starts, as a restarted run opens it once for its restore and saves.
    ckpt = Checkpointer(directory, read_only=True, timeout_s=300) if method == "nbckpt" else None
    dist.barrier()
    cpu, began = cpu_seconds(), time.perf_counter()
    if ckpt is not None:
        ckpt.restore(template)
    else:
        newest = max(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        dcp_load(template, checkpoint_id=str(newest))
    set_state_dict(model, optim, model_state_dict=template["model"], optim_state_dict=template["optim"])
    measured = {"wall_s": time.perf_counter() - began, "cpu_s": cpu_seconds() - cpu}
    if ckpt is not None:
        ckpt.close()
    return measured


def disk_bytes(directory: Path) -> int:
    steps = sorted(directory.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return sum(p.stat().st_size for p in steps[-1].iterdir() if p.name.endswith(".distcp"))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    result: dict[str, Any] = {"rank": rank, "world": world}
    if "save" in args.roles:
        model, optim = sharded(args.model_mb, seed=1)
        state = state_of(model, optim)
        result["local_bytes"] = local_bytes(state)
        savers = Savers(root, world)
        for method in METHODS:  # first saves plan, allocate and (DCP) start the writer process
            result[f"{method}_first"] = savers.save(method, state, step=0)
        saves: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for repeat in range(args.repeats):
            order = METHODS if repeat % 2 == 0 else METHODS[::-1]
            for method in order:
                saves[method].append(savers.save(method, state, step=repeat + 1))
        savers.close()
        result["saves"] = saves
        del model, optim, state
    for role, source in (("restore", world), ("reshard", args.reshard_from)):
        if role not in args.roles:
            continue
        restores: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
        for repeat in range(args.repeats):
            order = METHODS if repeat % 2 == 0 else METHODS[::-1]
            for method in order:
                name = "nbckpt" if method == "nbckpt" else "dcp"
                restores[method].append(restore(method, root / f"{name}@{source}", args.model_mb))
        result[role] = {"from": source, **restores}
    if rank == 0 and "save" in args.roles:
        result["disk"] = {
            m: disk_bytes(root / f"{'nbckpt' if m == 'nbckpt' else 'dcp'}@{world}") for m in METHODS
        }
    Path(args.out, f"world{world}-{args.roles}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the launcher -----------------------------------------------------------------------------------

LAUNCHES = [(2, "save", 0), (4, "save,restore,reshard", 2), (2, "restore,reshard", 4)]


def launch(world: int, roles: str, reshard_from: int, args: argparse.Namespace, out: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
        __file__, "--worker", "--roles", roles, "--reshard-from", str(reshard_from), "--dir", args.dir,
        "--out", str(out), "--model-mb", str(args.model_mb), "--repeats", str(args.repeats),
    ]  # fmt: skip
    print(f"launching {world} ranks: {roles} ...", file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{world} ranks ({roles}) failed:\n{done.stderr[-4000:]}")


def summarise(ranks: dict[int, list[dict[str, Any]]], meta: dict[str, Any]) -> dict[str, Any]:
    """Per world size: each metric per repeat (slowest rank for times, all ranks for CPU and bytes)."""
    rows: dict[str, dict[str, list[float]]] = {}
    checks: dict[str, Any] = {}
    memory: dict[str, dict[str, float]] = {}
    for world, results in sorted(ranks.items()):
        saving = [r for r in results if "saves" in r]
        if saving:
            state_gb = sum(r["local_bytes"] for r in saving) / GB
            for method in METHODS:
                per = [[r["saves"][method][i] for r in saving] for i in range(meta["repeats"])]
                rows[f"save {world} ranks: {method}"] = {
                    "stall_s": [max(s["stall_s"] for s in p) for p in per],
                    "durable_s": [max(s["durable_s"] for s in p) for p in per],
                    "cpu_s_per_gb": [sum(s["cpu_s"] for s in p) / state_gb for p in per],
                    "peak_mb_per_rank": [max(s["peak_mb"] for s in p) for p in per],
                    "writer_peak_mb": [max(s["writer_peak_mb"] for s in p) for p in per],
                }
                first = [r[f"{method}_first"] for r in saving]
                memory[f"{world} ranks {method}"] = {
                    "taken_mb_per_rank": max(f["peak_mb"] for f in first),
                    "writer_process_mb": max(f["writer_peak_mb"] for f in first),
                    "first_stall_s": max(f["stall_s"] for f in first),
                }
            for metric, target in (("stall_s", 0.7), ("durable_s", 1.0)):
                checks[f"{world} ranks {metric} nbckpt / dcp-best"] = _check(
                    rows[f"save {world} ranks: nbckpt"][metric],
                    rows[f"save {world} ranks: dcp-best"][metric],
                    target,
                )
            disk = next(r["disk"] for r in saving if "disk" in r)
            checks[f"{world} ranks bytes on disk nbckpt / dcp"] = {
                **ratio_interval([disk["nbckpt"] / disk["dcp-best"]]),
                "target": "0.99..1.01",
                "met": abs(disk["nbckpt"] / disk["dcp-best"] - 1) <= 0.01,
                "bytes": disk,
            }
        for role in ("restore", "reshard"):
            found = [r[role] for r in results if role in r]
            if not found:
                continue
            label = f"{role} {found[0]['from']} -> {world} ranks"
            for method in METHODS:
                per = [[f[method][i] for f in found] for i in range(meta["repeats"])]
                rows[f"{label}: {'nbckpt' if method == 'nbckpt' else 'dcp.load'}"] = {
                    "wall_s": [max(s["wall_s"] for s in p) for p in per],
                    "cpu_s": [sum(s["cpu_s"] for s in p) for p in per],
                }
            checks[f"{label} time nbckpt / dcp.load"] = _check(
                rows[f"{label}: nbckpt"]["wall_s"], rows[f"{label}: dcp.load"]["wall_s"], 1.0
            )
    return {
        **meta,
        "rows": rows,
        "checks": checks,
        "memory": memory,
        "ranks": {str(w): r for w, r in ranks.items()},
    }


def _check(ours: list[float], theirs: list[float], target: float) -> dict[str, Any]:
    ratio = ratio_interval([a / b for a, b in zip(ours, theirs, strict=True) if b > 0])
    return {**ratio, "target": f"<= {target}", "met": ratio["median"] <= target}


def show(result: dict[str, Any]) -> None:
    print(
        f"\nFSDP2 model of {result['model_mb']:g} MB + AdamW, {result['repeats']} repeats "
        f"(median [95 % interval]); load average at the start {result['load_average'][0]:.1f}"
    )
    metrics = list(dict.fromkeys(m for row in result["rows"].values() for m in row))
    print(f"{'':44}" + "".join(f"{m:>24}" for m in metrics))
    for name, row in result["rows"].items():
        cells = []
        for metric in metrics:
            s = interval(row.get(metric, []))
            cells.append(f"{s['median']:8.3f} [{s['lo']:6.3f},{s['hi']:6.3f}]" if s["n"] else "")
        print(f"{name:44}" + "".join(f"{c:>24}" for c in cells))
    print("\nhost memory each method takes (its first save, above the resident size before it)")
    for name, m in result["memory"].items():
        print(
            f"  {name:24} {m['taken_mb_per_rank']:8.1f} MB per rank, writer process "
            f"{m['writer_process_mb']:8.1f} MB, first stall {m['first_stall_s']:.3f} s"
        )
    print("\nchecks (paired ratio per repeat: median [95 % interval of the geometric mean], target)")
    for name, c in result["checks"].items():
        print(
            f"  {name:44} {c['median']:7.3f} [{c['lo']:7.3f},{c['hi']:7.3f}]  {c['target']:>10}  "
            f"{'met' if c['met'] else 'NOT MET'}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mb", type=float, default=200, help="parameters of the model (MB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="", help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="a 16 MB model, 2 repeats")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reprint", metavar="JSON", help="measure nothing: print a saved result again")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--roles", default="", help=argparse.SUPPRESS)
    parser.add_argument("--reshard-from", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.reprint:
        show(json.loads(Path(args.reprint).read_text()))
        return 0
    if args.quick:
        args.model_mb, args.repeats = 16, 2
    with tempfile.TemporaryDirectory(prefix="nbckpt-sharded-") as scratch:
        args.dir = args.dir or str(Path(scratch) / "ckpt")
        out = Path(scratch) / "out"
        out.mkdir()
        meta = {"benchmark": "sharded/1", "model_mb": args.model_mb, "repeats": args.repeats, **machine()}
        for world, roles, reshard_from in LAUNCHES:
            launch(world, roles, reshard_from, args, out)
        ranks: dict[int, list[dict[str, Any]]] = {}
        for path in sorted(out.glob("world*.json")):
            data = json.loads(path.read_text())
            ranks.setdefault(data["world"], []).append(data)
        result = summarise(ranks, meta)
    show(result)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
