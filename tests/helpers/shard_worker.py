"""One rank of sharded-training scenarios (FSDP2, tensor parallel, HSDP on gloo); prints one JSON
line of what it saw in each.

    python tests/helpers/shard_worker.py SCENARIO[,SCENARIO...] DIR   (RANK, WORLD_SIZE, MASTER_* set)

Started by :func:`helpers.ranks.run_ranks`. Every scenario compares what nbckpt did with what
``torch.distributed.checkpoint`` does on the same state: the reference is the full state
dict (``full_state_dict=True``) the saving run wrote with ``torch.save`` beside its checkpoints.
With ``WORLD_SIZE=1`` no process group is made: the restore is into a plain, unsharded model.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from nbckpt import BestN, Checkpointer, NbckptError
from nbckpt.engine import _store
from nbckpt.engine._faults import armed

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
#: Sizes chosen so that 4 ranks get uneven shards (10 rows over 4 ranks: 3, 3, 3, 1; 6: 2, 2, 2, 0)
#: while tensor parallelism splits evenly (DTensor propagation refuses some uneven TP layouts).
VOCAB, WIDTH, HIDDEN, OUT = 10, 8, 6, 6


def model_of(seed: int, rows: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(rows, WIDTH), nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)
    )


#: HSDP's embedding is large, so that its bytes on disk are the data's, not the framing's.
ROWS = {"hsdp": 16384}


def sharded(kind: str, seed: int, rows: int = VOCAB) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model laid out as ``kind`` says over this world's ranks, with AdamW."""
    model = model_of(seed, rows)
    if WORLD > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if kind == "fsdp":
            mesh = init_device_mesh("cpu", (WORLD,))
            for index in (0, 1, 3):
                fully_shard(model[index], mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif kind == "hsdp":
            fully_shard(
                model, mesh=init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
            )
        elif kind == "tp":
            parallelize_module(
                model, init_device_mesh("cpu", (WORLD,)), {"1": ColwiseParallel(), "3": RowwiseParallel()}
            )
        elif kind == "fsdp+tp":
            mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(100)  # the same batches on every rank: TP needs them, FSDP does not mind
    for _ in range(steps):
        model(torch.randint(0, VOCAB, (4,))).square().mean().backward()
        optim.step()
        optim.zero_grad()


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> Any:
    """The whole state as one process would hold it (what a restore must reproduce)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=WORLD > 1)
    msd, osd = get_state_dict(model, optim, options=options)
    return {"model": msd, "optim": osd}


def same(a: Any, b: Any) -> bool:
    """Bit-exact, all the way down (tensors by their bytes, other values by equality)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def matches(reference: str, model: nn.Module, optim: torch.optim.Optimizer) -> bool:
    now = full_state(model, optim)
    if WORLD > 1 and RANK != 0:  # cpu_offload gives the full state to rank 0 only
        return True
    return same(now, torch.load(reference, weights_only=True))


def outcome(run: Callable[[], Any]) -> str:
    try:
        run()
        return "ok"
    except NbckptError as exc:
        return f"{type(exc).__name__}: {exc}"


def bytes_of(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name.endswith(".distcp"))


# -- scenarios ------------------------------------------------------------------------------------


def save(directory: str) -> dict[str, Any]:
    """Each layout trained, saved by nbckpt (async) and by DCP into ``LAYOUT@WORLD``, its full
    state written beside; then restored at this world size into a model of other values."""
    seen = {}
    for kind in KINDS[WORLD]:
        root, rows = Path(directory) / f"{kind}@{WORLD}", ROWS.get(kind, VOCAB)
        model, optim = sharded(kind, seed=1, rows=rows)
        train(model, optim, 2)
        msd, osd = get_state_dict(model, optim)
        with Checkpointer(root / "nbckpt", mode="async", timeout_s=60) as ckpt:
            ckpt.save({"model": msd, "optim": osd, "step": 2}, step=2).wait()
            written = ckpt.manifest(2)["bytes"]
        dcp.save({"model": msd, "optim": osd, "step": 2}, checkpoint_id=str(root / "dcp" / "step-2"))
        reference = full_state(model, optim)
        if RANK == 0:
            torch.save(reference, root / "full.pt")
        dist.barrier()
        fresh, fresh_optim = sharded(kind, seed=7, rows=rows)
        train(fresh, fresh_optim, 1)
        fmsd, fosd = get_state_dict(fresh, fresh_optim)
        target = {"model": fmsd, "optim": fosd, "step": -1}
        with Checkpointer(root / "nbckpt", mode="async", timeout_s=60) as ckpt:
            restored = ckpt.restore(target)
        set_state_dict(fresh, fresh_optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
        seen[kind] = {
            "tensor_bytes": written,
            "state_bytes": sum(t.nbytes for t in _tensors(reference)) if RANK == 0 else None,
            "nbckpt_disk": bytes_of(root / "nbckpt" / "step-000002"),
            "dcp_disk": bytes_of(root / "dcp" / "step-2"),
            "restored": restored,
            "step": target["step"],
            "exact": matches(str(root / "full.pt"), fresh, fresh_optim),
        }
    return seen


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def restore(directory: str) -> dict[str, Any]:
    """This world size (1: a plain model) restores what :func:`save` wrote at another, three ways:
    nbckpt from its own checkpoint, plain ``dcp.load`` from nbckpt's, nbckpt from DCP's."""
    seen = {}
    for saved in sorted(Path(directory).glob("*@*")):
        kind, world = saved.name.split("@")
        if int(world) == WORLD:
            continue
        here = kind if (WORLD, kind) in LAYOUTS else "fsdp" if WORLD > 1 else "plain"
        found: dict[str, Any] = {}
        for way in ("nbckpt", "dcp.load", "from dcp"):
            model, optim = sharded(here, seed=7, rows=ROWS.get(kind, VOCAB))
            train(model, optim, 1)
            msd, osd = get_state_dict(model, optim)
            target = {"model": msd, "optim": osd, "step": -1}
            if way == "dcp.load":
                dcp.load(target, checkpoint_id=str(saved / "nbckpt" / "step-000002"))
            else:
                where = saved / ("nbckpt" if way == "nbckpt" else "dcp")
                with Checkpointer(
                    where, ranks="all" if WORLD > 1 else "local", read_only=True, timeout_s=60
                ) as ckpt:
                    ckpt.restore(target)
            set_state_dict(model, optim, model_state_dict=target["model"], optim_state_dict=target["optim"])
            found[way] = matches(str(saved / "full.pt"), model, optim) and target["step"] == 2
        seen[f"{saved.name}->{here}@{WORLD}"] = found
    return seen


def modules(directory: str) -> dict[str, Any]:
    """A sharded model and optimizer passed directly, as an unsharded one is: saved at one world
    size (the first run), restored at another (the optimizer before its first step: there is no
    state of its own to shard by, its parameters' placements are used)."""
    root = Path(directory) / "modules"
    first = not root.exists()
    dist.barrier()  # every rank has looked before rank 0 creates it
    model, optim = sharded("fsdp", seed=1)
    if first:
        train(model, optim, 2)
        with Checkpointer(root, mode="sync", timeout_s=60) as ckpt:
            ckpt.save({"model": model, "optim": optim}, step=2)
        reference = full_state(model, optim)
        if RANK == 0:
            torch.save(reference, root / "modules.pt")
        return {"saved": True}
    with Checkpointer(root, read_only=True, timeout_s=60) as ckpt:
        ckpt.restore({"model": model, "optim": optim})
    return {"exact": matches(str(root / "modules.pt"), model, optim)}


BIT_DTYPES = (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.bool, torch.complex128)


def divergent(directory: str) -> dict[str, Any]:
    """A plain tensor under one key holding each rank's own values: refused on every rank."""
    model, optim = sharded("fsdp", seed=1)
    msd, _ = get_state_dict(model, optim)
    with Checkpointer(Path(directory) / "divergent", mode="async", timeout_s=60) as ckpt:
        own = {"model": msd, "batch": torch.full((8,), float(RANK))}
        warmed = outcome(lambda: ckpt.warmup(own))  # before DDP would broadcast: values may differ
        # warmed up, the save stages at once and the ranks agree on the persist thread: the
        # refusal is the save's failure, on every rank (raised by wait)
        result = outcome(lambda: ckpt.save(own, step=1).wait())
        # unsigned and float8 dtypes have no torch.take kernel: their bits are compared (a new
        # structure: every rank waits for the agreement before staging)
        seeds = {str(dtype): torch.arange(8).to(dtype) for dtype in BIT_DTYPES}
        unsigned = outcome(
            lambda: ckpt.save(
                {"model": msd, "seed": torch.full((4,), RANK, dtype=torch.uint32)}, step=1
            ).wait()
        )
        agreed = outcome(
            lambda: ckpt.save({"model": msd, "batch": torch.ones(8), "seeds": seeds}, step=2).wait()
        )
        return {
            "warmed": warmed,
            "outcome": result,
            "unsigned": unsigned,
            "then": agreed,
            "steps": ckpt.steps(),
        }


def replicas(directory: str) -> dict[str, Any]:
    """A Replicate DTensor holding each rank's own values: refused on every rank, nothing
    committed (as a plain tensor is); a restore whose template on rank 1 names a key no step
    holds: every rank is told that rank and that key."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (WORLD,))

    def replicated(value: float) -> Any:
        return DTensor.from_local(torch.full((4, 2), value), mesh, [Replicate()], run_check=False)

    with Checkpointer(Path(directory) / "replicas", mode="async", timeout_s=60) as ckpt:
        differ = outcome(lambda: ckpt.save({"r": replicated(float(RANK)), "w": torch.ones(2)}, step=1))
        refused_steps = ckpt.steps()
        agreed = outcome(lambda: ckpt.save({"r": replicated(5.0), "w": torch.ones(2)}, step=2).wait())
        state: dict[str, Any] = {"r": replicated(0.0), "w": torch.zeros(2)}
        if RANK == 1:
            state["extra"] = torch.zeros(1)
        lacking = outcome(lambda: ckpt.restore(state))
        named = outcome(lambda: ckpt.restore(state, step=2))
        state.pop("extra", None)
        restored = ckpt.restore(state)
        return {
            "differ": differ,
            "refused_steps": refused_steps,
            "agreed": agreed,
            "lacking": lacking,
            "named": named,
            "restored": restored,
            "values": state["r"].to_local().tolist(),
        }


def ranked(directory: str) -> dict[str, Any]:
    """Per-rank plain values (the keys nbckpt's docs ask for, ``loader.rank<N>``) saved by nbckpt:
    what a plain ``dcp.load`` on each rank reads back, and on rank 0 what ``dcp_to_torch_save``
    keeps of every rank's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = Path(directory) / "ranked"
    own = {"pos": 10 + RANK, "tag": f"r{RANK}".encode()}
    with Checkpointer(root, mode="async", timeout_s=60) as ckpt:
        ckpt.save({"w": torch.ones(2), "loader": {f"rank{RANK}": own}, "step": 4}, step=1).wait()
    blank = {"pos": 0, "tag": b""}
    state: dict[str, Any] = {"w": torch.zeros(2), "loader": {f"rank{RANK}": blank}, "step": 0}
    try:
        dcp.load(state, checkpoint_id=str(root / "step-000001"))
        loaded = "ok"
    except Exception as exc:  # DCP's CheckpointException, naming the missing key
        loaded = repr(exc)[:300]
    dist.barrier()
    kept = None
    if RANK == 0:
        dcp_to_torch_save(root / "step-000001", root / "whole.pt")
        whole = torch.load(root / "whole.pt", weights_only=True)
        kept = {key: {k: repr(v) for k, v in value.items()} for key, value in whole["loader"].items()}
    return {
        "loaded": loaded,
        "same": state["loader"] == {f"rank{RANK}": own} and state["step"] == 4,
        "kept": kept,
    }


def killed(directory: str) -> dict[str, Any]:
    """Rank 1 dies once its files of a sharded save are written: nothing commits, rank 0 fails."""
    model, optim = sharded("fsdp", seed=1)
    train(model, optim, 1)
    msd, osd = get_state_dict(model, optim)
    ckpt = Checkpointer(Path(directory) / "killed", mode="async", timeout_s=20)
    ckpt.save({"model": msd, "optim": osd}, step=1).wait()
    if RANK == 1:
        _store.arm_crash("after_data")
    result = outcome(lambda: ckpt.save({"model": msd, "optim": osd}, step=2).wait())
    return {
        "outcome": result,
        "steps": sorted(n for n in os.listdir(Path(directory) / "killed") if n.startswith("step-")),
    }


def retained(directory: str) -> dict[str, Any]:
    """keep=1 over steps 1 to 3: rank 0's retention deletes steps 1 and 2 on its own thread; once
    they are gone, every rank's ``has_step`` and a save of step 2 again (no "replaced" warning)."""
    root = Path(directory) / "retained"
    with Checkpointer(root, mode="sync", keep=1, timeout_s=60) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"w": torch.full((4,), float(step)), "step": step}, step=step)
        while RANK == 0 and ckpt.steps() != [3]:  # rank 0's retention pass, on its own thread
            threading.Event().wait(0.001)
        dist.barrier()
        held = [ckpt.has_step(step) for step in (1, 2, 3)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.save({"w": torch.zeros(4), "step": 2}, step=2)
        said = [str(w.message)[:160] for w in caught if str(w.message).startswith("nbckpt")]
        return {"has_step": held, "warned": said}


#: What each world size saves; (world, layout) pairs a restore at that world can use as they are.
KINDS = {4: ["fsdp", "hsdp", "fsdp+tp"], 2: ["fsdp", "tp"]}
LAYOUTS = {(4, "fsdp"), (2, "fsdp"), (2, "tp"), (4, "hsdp"), (4, "fsdp+tp")}


def frozen_embedding(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2 over this world's ranks (1: a plain model) with its embedding frozen, AdamW on the rest."""
    model = model_of(seed, 64)
    model[0].requires_grad_(False)
    if WORLD > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for index in (0, 1, 3):
            fully_shard(model[index], mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def incremental(directory: str) -> dict[str, Any]:
    """Issue 32: FSDP2 with a frozen embedding, saved incrementally three times; each rank's files
    of the third step that are its first step's (same inode), its bytes written and skipped;
    the steps before deleted, the third restored into a model of other values, bit for bit. Then
    a rewind: step 4, step 3 restored, step 5 saved: step 4 set aside, restored from there; and
    one more with the mirror's set-aside waiting (:func:`rewound_with_a_mirror`)."""
    root = Path(directory) / "incremental"
    model, optim = frozen_embedding(seed=1)
    records = []
    mirror = str(root.with_name("incremental-mirror"))
    with Checkpointer(root, mode="sync", incremental=True, mirror=mirror, timeout_s=60) as ckpt:
        for step in (1, 2, 3):
            train(model, optim, 1)
            record = ckpt.save({"model": model, "optim": optim}, step=step).wait()
            records.append([record.bytes_written, record.bytes_skipped])
        reference = full_state(model, optim)
        first, third = root / "step-000001", root / "step-000003"
        shared = sorted(
            name
            for name in os.listdir(third)
            if name.startswith(f"__{RANK}_")
            and (first / name).exists()
            and (first / name).stat().st_ino == (third / name).stat().st_ino
        )
        embedding = sorted({chunk[0] for chunk in ckpt.manifest(3)["items"]["model.0.weight"]})
        if WORLD > 1:
            dist.barrier()  # every rank has looked at step 1 before rank 0 deletes it
        ckpt.delete(1)
        ckpt.delete(2)
        ckpt.verify(3)
        fresh, fresh_optim = frozen_embedding(seed=2)
        train(fresh, fresh_optim, 1)
        ckpt.restore({"model": fresh, "optim": fresh_optim})
        now = full_state(fresh, fresh_optim)
        # A rewind on every rank: step 4 (sharing files with 3), then back to 3 and a save of 5:
        # rank 0 sets step 4 aside while the others wait, and it restores whole from there. Each
        # state is a model of its own, left alone once compared (a full state dict shares the
        # optimizer's step tensor with it).
        fourth_model, fourth_optim = frozen_embedding(seed=3)
        train(fourth_model, fourth_optim, 1)  # optimizer state to load into
        ckpt.restore({"model": fourth_model, "optim": fourth_optim})
        train(fourth_model, fourth_optim, 1)
        ckpt.save({"model": fourth_model, "optim": fourth_optim}, step=4).wait()
        fourth = full_state(fourth_model, fourth_optim)
        back, back_optim = frozen_embedding(seed=4)
        train(back, back_optim, 1)
        ckpt.restore({"model": back, "optim": back_optim}, step=3)
        ckpt.save({"model": back, "optim": back_optim}, step=5).wait()
        steps, [aside] = ckpt.steps(), ckpt.set_aside_runs()
        mirrored = rewound_with_a_mirror(ckpt, back, back_optim)
    other, other_optim = frozen_embedding(seed=5)
    train(other, other_optim, 1)
    with Checkpointer(
        aside["path"], ranks="all" if WORLD > 1 else "local", read_only=True, timeout_s=60
    ) as old:
        old.restore({"model": other, "optim": other_optim})
    then = full_state(other, other_optim)
    exact = RANK != 0 or same(now, reference) if WORLD > 1 else same(now, reference)
    set_aside = RANK != 0 or same(then, fourth) if WORLD > 1 else same(then, fourth)
    return {
        "records": records,
        "shared": shared,
        "embedding": embedding,
        "exact": exact,
        "after_retention": after_retention(root.with_name("incremental-best"), fresh, fresh_optim),
        "rewound": {"steps": steps, "after": aside["after"], "aside": aside["steps"], "exact": set_aside},
        "mirrored": mirrored,
    }


def rewound_with_a_mirror(
    ckpt: Checkpointer, model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """Steps 8 (uploaded) and 9 (its upload held on rank 0's mirror thread), step 5 restored,
    step 6 saved: 8 and 9 set aside, the mirror's set-aside queued behind 9's upload, and the
    mirror unreachable for rank 0 as it notes there that they go aside (its listing fails), so
    nothing in the mirror hides its step 8 meanwhile. Every rank must still answer alike: what
    ``manifest(8)`` says on each rank (before, rank 1 read the mirror's copy of the step set
    aside: rank 0 alone hid it, in its memory); restore() picks 6, and whether a newer step exists
    is one answer on every rank: step 7 saves on both (rank 1 alone set aside and waited for
    rank 0, which was in its save). What restore() loaded, bit for bit, and the steps."""
    ckpt.wait()
    train(model, optim, 1)
    ckpt.save({"model": model, "optim": optim}, step=8).wait()
    ckpt.wait()  # step 8 is on the mirror
    release = threading.Event()

    def held(location: str, name: str) -> None:
        release.wait(120)

    mirror = os.path.abspath(str(ckpt.config.mirror))

    def unreachable(url: str) -> None:
        if url == mirror and threading.current_thread() is threading.main_thread():
            raise OSError(113, "No route to host", url)

    with armed("mirror.upload", held):
        try:
            train(model, optim, 1)
            ckpt.save({"model": model, "optim": optim}, step=9).wait()  # rank 0's upload waits
            ckpt.restore({"model": model, "optim": optim}, step=5)
            train(model, optim, 1)
            with armed("store.names", unreachable) if RANK == 0 else nullcontext():
                ckpt.save({"model": model, "optim": optim}, step=6).wait()
            set_aside = outcome(lambda: ckpt.manifest(8))
            sixth = full_state(model, optim)
            other, other_optim = frozen_embedding(seed=6)
            train(other, other_optim, 1)
            restored = ckpt.restore({"model": other, "optim": other_optim})
            now = full_state(other, other_optim)  # every rank: it gathers
            exact = RANK != 0 or same(now, sixth)
            train(other, other_optim, 1)
            ckpt.save({"model": other, "optim": other_optim}, step=7).wait()
        finally:
            release.set()
    ckpt.wait()
    aside = [entry["steps"] for entry in ckpt.set_aside_runs()]
    return {
        "restored": restored,
        "exact": exact,
        "steps": ckpt.steps(),
        "aside": aside,
        "set_aside": set_aside,
    }


def after_retention(root: Path, model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Rank 0's retention (BestN, steps saved out of order, then ``retain()``) deletes step 4, the
    step every rank's next save would share its embedding's files with; rank 0 alone is told.
    Step 6 then shares from it on no rank (rank 1 did: the save failed on the files gone), and
    step 7 shares from step 6 again: each rank's bytes skipped, or the error."""
    skipped: list[Any] = []
    with Checkpointer(root, mode="sync", incremental=True, keep=BestN("loss", 1), timeout_s=60) as ckpt:
        for step, loss in ((5, 1.0), (4, 2.0), (6, 0.5), (7, 0.4)):
            if step == 6:
                ckpt.retain()  # a pass as after the newest step, 5: 4 is not among the best
                ckpt.wait()  # rank 0's deletes are done before any rank's next save (it gathers)
            train(model, optim, 1)
            try:
                skipped.append(
                    ckpt.save({"model": model, "optim": optim}, step, metrics={"loss": loss})
                    .wait()
                    .bytes_skipped
                )
            except NbckptError as exc:
                skipped.append(f"{type(exc).__name__}: {exc}")
        ckpt.wait()
        steps = ckpt.steps()
        ckpt.verify(steps[-1])
    return {"skipped": skipped, "steps": steps}


def incremental_reshard(directory: str) -> dict[str, Any]:
    """Issue 32: 2 ranks save the frozen-embedding model incrementally at steps 1 to 3 and delete
    step 1; step 3's files are step 2's (its embedding shards written at step 1), its full state
    beside. Any other world size restores step 3 two ways, nbckpt and plain ``dcp.load``: each
    bit for bit as saved, and the same as the other."""
    root = Path(directory) / "incremental-reshard"
    if WORLD == 2:
        model, optim = frozen_embedding(seed=1)
        with Checkpointer(root, mode="sync", incremental=True, timeout_s=60) as ckpt:
            for step in (1, 2, 3):
                train(model, optim, 1)
                ckpt.save({"model": model, "optim": optim}, step=step).wait()
            second, third = root / "step-000002", root / "step-000003"
            shared = sorted(
                name
                for name in os.listdir(third)
                if name.startswith(f"__{RANK}_")
                and (third / name).stat().st_ino == (second / name).stat().st_ino
            )
            ckpt.delete(1)
        reference = full_state(model, optim)
        if RANK == 0:
            torch.save(reference, root / "full.pt")
        return {"shared": shared}
    loaded = {}
    for way in ("nbckpt", "dcp.load"):
        model, optim = frozen_embedding(seed=2)
        train(model, optim, 1)  # other values, and optimizer state to load into
        if way == "dcp.load":  # what nbckpt saved of a module and an optimizer passed directly
            target = {"model": model.state_dict(), "optim": optim.state_dict()}
            dcp.load(target, checkpoint_id=str(root / "step-000003"))
            model.load_state_dict(target["model"])
            optim.load_state_dict(target["optim"])
        else:
            ranks = "all" if WORLD > 1 else "local"
            with Checkpointer(root, ranks=ranks, read_only=True, timeout_s=60) as ckpt:
                ckpt.restore({"model": model, "optim": optim}, step=3)
        loaded[way] = full_state(model, optim)
    if WORLD > 1 and RANK != 0:  # cpu_offload gives the full state to rank 0 only
        return {"nbckpt": True, "dcp.load": True, "same": True}
    reference = torch.load(root / "full.pt", weights_only=True)
    return {
        "nbckpt": same(loaded["nbckpt"], reference),
        "dcp.load": same(loaded["dcp.load"], reference),
        "same": same(loaded["nbckpt"], loaded["dcp.load"]),
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        *(save, restore, modules, divergent, replicas, ranked),
        *(retained, killed, incremental, incremental_reshard),
    )
}


def main(scenarios: str, directory: str) -> int:
    if WORLD > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    results = {name: SCENARIOS[name](directory) for name in scenarios.split(",")}
    print(json.dumps({"rank": RANK, **results}), flush=True)
    if WORLD > 1:
        dist.destroy_process_group()
    return 0


#: How the rank ends (:func:`_end_before_teardown`): 1 unless :func:`main` returned.
_STATUS = [1]


def _end_before_teardown() -> None:
    """The last exit handler: end the rank before the interpreter's teardown. Torch's gloo groups
    outlive ``destroy_process_group()`` here (10 of their worker threads still run after the 4-rank
    save, 2 after the restore), held by torch's own objects of the meshes and FSDP, so they would
    be torn down inside the teardown, where a worker thread that frees its last collective's
    tensors takes the GIL and is ended by ``pthread_exit``: "terminate called without an active
    exception", SIGABRT (seen once at the exit of the 4-rank restore under the whole suite's load;
    pytorch PR 179291). Every exit handler registered while the rank ran (a Checkpointer left
    open) has run by now, and the rank's JSON line is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_STATUS[0])


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test prints where this rank was
    faulthandler.enable(all_threads=True)  # a fatal signal prints which Python threads still ran
    atexit.register(_end_before_teardown)  # before main: the exit handlers run last first
    _STATUS[0] = main(sys.argv[1], sys.argv[2])
