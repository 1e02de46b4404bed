"""One rank of a multi-rank scenario; prints one JSON line of what it saw.

    python tests/helpers/rank_worker.py SCENARIO DIR      (RANK, WORLD_SIZE, MASTER_* set)

Started by :func:`helpers.ranks.run_ranks` (plain processes, so that one rank dying does not
take the others down with it, as torchrun's agent would).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from contextlib import nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nbckpt import Checkpointer, NbckptError, SaveSchedule
from nbckpt.engine import _ranks, _store
from nbckpt.engine._faults import armed
from nbckpt.engine._open_store import open_store
from nbckpt.engine._shutdown import wait_released
from nbckpt.engine._torch_compat import default_store

RANK = int(os.environ["RANK"])


def state_of(step: int) -> dict[str, Any]:
    torch.manual_seed(step)  # the same on every rank: a replicated model
    model = torch.nn.Linear(16, 8)
    return {"model": model, f"rank{RANK}": torch.full((100,), float(step * 10 + RANK)), "step": step}


def outcome(run: Any) -> str:
    try:
        run()
        return "ok"
    except NbckptError as exc:
        return f"{type(exc).__name__}: {exc}"


def restored_step(ckpt: Checkpointer) -> dict[str, Any]:
    state = {"model": torch.nn.Linear(16, 8), f"rank{RANK}": torch.zeros(100), "step": -1}
    step = ckpt.restore(state)
    expected = state_of(step)
    return {
        "restored": step,
        "exact": state["step"] == step
        and torch.equal(state[f"rank{RANK}"], expected[f"rank{RANK}"])
        and all(
            torch.equal(a, b)
            for a, b in zip(
                state["model"].state_dict().values(), expected["model"].state_dict().values(), strict=True
            )
        ),
    }


def refusal(directory: str) -> dict[str, Any]:
    """Rank 1 holds a value nbckpt refuses at step 2 only (a rank-dependent bug looks the same);
    then, every save staged at once with the agreed layout (no collective on the caller's
    thread), rank 1 saves step 5 where rank 0 saves 4, and at 6 its replicated model differs;
    then the two threads of each rank check in at once (:func:`_crossing`); then it is opened
    again (:func:`_reopened`)."""
    results = {}
    sockets = [_sockets()]
    unshared = _unshared(directory)
    sockets.append(_sockets())
    with Checkpointer(directory, mode="async", timeout_s=60) as ckpt:
        calls: list[str] = []

        def arrive(tag: tuple[Any, ...]) -> None:
            if threading.current_thread() is threading.main_thread():  # the caller's check-ins
                calls.append(tag[0])

        with armed("ranks.arrive", arrive):
            for step in (1, 2, 3, 4, 6, 7):
                state = state_of(step)
                if RANK == 1 and step == 2:
                    state["hook"] = print
                if RANK == 1 and step == 6:
                    with torch.no_grad():
                        state["model"].bias[-1] += 1  # one element of the last sample differs
                saved = 5 if RANK == 1 and step == 4 else step
                results[step] = outcome(lambda s=state, n=saved: ckpt.save(s, step=n, overlap=True).wait())
        results[8], results[9] = _crossing(ckpt)
        results[11], results[12] = _failed_write(ckpt)
        seen = {
            # rank 0 opens a save's location as the ranks agree: a refused save's goes with it
            "temporary": sorted(name for name in os.listdir(directory) if name.startswith(".tmp-")),
            "unshared": unshared,
            "outcomes": results,
            "caller_collectives": calls,
            "steps": ckpt.steps(),
            **restored_step(ckpt),
            "manifest_steps": _tree_steps(ckpt, max(ckpt.steps())),
        }
    reopened = _reopened(directory, sockets)
    dropped = dropped_uploading(f"{directory}-dropped")
    late = _closed_without_the_default_group(f"{directory}-late")
    return {**seen, "reopened": reopened, "dropped": dropped, "late": late}


def _sockets() -> int:
    """This process's TCP sockets, less the store server's (rank 0's: it closes the other ranks'
    connections in its own time). Each one asked for its port (``/proc/net/tcp`` can skip a row
    when another socket opens or closes as it is read)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with suppress(FileNotFoundError):  # the listing's own descriptor, closed by now
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                # a copy of the descriptor: closing it leaves the rank's own open
                with socket.socket(fileno=os.dup(int(fd))) as sock:
                    tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    count += tcp and sock.getsockname()[1] != int(os.environ["MASTER_PORT"])
    return count


def _reopened(directory: str, sockets: list[int]) -> dict[str, Any]:
    """The run opened again and again, as a notebook cell run again does: :data:`CYCLES` times
    two saves in flight (``max_inflight=2``) and a close on both ranks; then one closed on rank 0
    alone, rank 1 closing it only once rank 0's close has returned; then one dropped unclosed.
    The sockets after each close, after ``sockets`` (before any Checkpointer, after the refused
    opens, after the first closed)."""
    store, outcomes = default_store(), []
    sockets.append(_sockets())
    step = 13
    for _ in range(CYCLES):
        again = Checkpointer(directory, mode="async", max_inflight=2, timeout_s=60)
        handles = [again.save(state_of(s), step=s) for s in (step, step + 1)]
        outcomes.append(outcome(again.close))  # waits for both saves, raises a failed one
        outcomes.extend(outcome(handle.wait) for handle in handles)
        sockets.append(_sockets())
        step += 2
    _ranks.CLOSE_TIMEOUT_S = 1.0  # each close of the next ones waits this long for the other rank
    mirrored = _closed_as_rank0_uploads(f"{directory}-mirrored", store)
    alone = Checkpointer(directory, mode="sync", timeout_s=60)
    outcomes.append(outcome(lambda: alone.save(state_of(step), step=step)))
    if RANK == 1:
        store.wait(["reopened/alone"])
    outcomes.append(outcome(alone.close))
    kept = _sockets()  # its groups: neither rank saw the other close
    if RANK == 0:
        store.set("reopened/alone", "")
    last = Checkpointer(directory, mode="sync", timeout_s=60)  # the ranks still in step
    outcomes.append(outcome(lambda c=last, s=step + 1: c.save(state_of(s), step=s)))
    steps = last.steps()
    del last  # dropped unclosed, as a cell run again drops the one it made before
    gc.collect()
    # its threads finish first, then it lets go of its groups
    wait_released(open_store(directory), timeout_s=120)
    return {"outcomes": outcomes, "steps": steps, "sockets": sockets, "kept": kept, "mirrored": mirrored}


def _closed_as_rank0_uploads(directory: str, store: Any) -> dict[str, Any]:
    """A Checkpointer with a mirror closed on both ranks, rank 0's upload at the close lasting
    longer than the close's check-in deadline (held until rank 1's close has returned): what
    each close said, and this rank's sockets after it."""
    with armed("mirror.upload", lambda *_: store.wait(["reopened/mirrored"], timedelta(seconds=60))):
        ckpt = Checkpointer(directory, mirror=f"{directory}-copy", mode="sync", timeout_s=60)
        ckpt.save(state_of(1), step=1)
        closed = outcome(ckpt.close)
    if RANK == 1:
        store.set("reopened/mirrored", "")
    return {"closed": closed, "sockets": _sockets()}


#: How many times :func:`_reopened` opens, saves and closes the run on both ranks.
CYCLES = 6


def _closed_without_the_default_group(directory: str) -> str:
    """A Checkpointer closed after the default group was destroyed (a script's end, then the
    close at exit): what the close said. Last in :func:`refusal`'s launch."""
    ckpt = Checkpointer(directory, mode="sync", timeout_s=60)
    ckpt.save(state_of(1), step=1)
    dist.barrier()  # both saved: neither rank's group is needed any more
    dist.destroy_process_group()
    return outcome(ckpt.close)


def _unshared(directory: str) -> dict[str, Any]:
    """A run directory rank 1 names elsewhere (as each host's own disk would be), then a shared
    one with a mirror rank 1 names elsewhere: what each open said, the caller's check-ins of the
    first (the open's own exchange only), and what each rank's directories hold afterwards."""
    run = f"{directory}-unshared"
    mine = run if RANK == 0 else f"{run}-rank{RANK}"
    calls: list[str] = []
    with armed("ranks.arrive", lambda tag: calls.append(tag[0])):
        opened = outcome(lambda: Checkpointer(mine, mode="sync", timeout_s=60).close())
    # the same run on both ranks: it opens only if rank 0's refused open gave its lock back
    mirror = f"{run}-mirror" if RANK == 0 else f"{run}-mirror-rank{RANK}"
    mirrored = outcome(lambda: Checkpointer(run, mirror=mirror, mode="sync", timeout_s=60).close())
    try:  # rank 0 writes, the others only read it (read_only on those ranks alone)
        Checkpointer(run, read_only=RANK != 0, mode="sync", timeout_s=60).close()
        readers = "ok"
    except Exception as exc:  # before: a TypeError on rank 0, a ValueError on rank 1
        readers = f"{type(exc).__name__}: {exc}"
    return {
        "run": opened,
        "mirror": mirrored,
        "readers": readers,
        "check_ins": calls,
        "left": {path: sorted(os.listdir(path)) for path in (mine, mirror) if os.path.isdir(path)},
    }


def _crossing(ckpt: Checkpointer) -> tuple[str, str]:
    """An async save of step 8 (agreed on the persist thread), then a sync save of step 9 (it
    checks in on the caller's thread), as a final save on SIGTERM follows an async one. Rank 1's
    persist thread checks in for step 8 only once its caller's thread has checked in for step 9;
    rank 0's caller's thread comes to step 9 only once step 8 committed: each rank's two threads
    check in at once, in opposite orders on the two ranks. The outcomes of both saves."""
    checked_in = threading.Event()

    def arrive(tag: tuple[Any, ...]) -> None:
        if tag[:2] == ("save", 9):
            checked_in.set()
        elif tag[:2] == ("save", 8):  # the persist thread's agreement
            checked_in.wait(120)

    with armed("ranks.arrive", arrive) if RANK == 1 else nullcontext():
        handle = ckpt.save(state_of(8), step=8)
        first = outcome(handle.wait) if RANK == 0 else "not waited for"
        final = outcome(lambda: ckpt.save(state_of(9), step=9, mode="sync"))
    return (first if RANK == 0 else outcome(handle.wait)), final


def _failed_write(ckpt: Checkpointer) -> tuple[str, str]:
    """An async save of step 10 whose writes fail on every rank, recorded on rank 0 before its
    next save (11) starts, on rank 1 only once its save of 11 has begun (its persist thread's
    writes are held until then); then a save of 12. The outcomes of 11 and 12."""
    began = threading.Event()

    def write(path: str) -> None:
        if RANK == 1:
            began.wait(120)
        raise OSError(28, "No space left on device", path)

    with armed("file.write", write), armed("save.wait", lambda step: began.set()):
        handle = ckpt.save(state_of(10), step=10)
        if RANK == 0:
            futures.wait([handle.committed], timeout=120)  # recorded here, not raised
        eleventh = outcome(lambda: ckpt.save(state_of(11), step=11))
    return eleventh, outcome(lambda: ckpt.save(state_of(12), step=12).wait())


def _tree_steps(ckpt: Checkpointer, step: int) -> dict[str, Any]:
    manifest = ckpt.manifest(step)
    trees = {"0": manifest["tree"], **manifest.get("rank_trees", {})}
    return {rank: next(n["v"] for k, n in tree["items"] if k == "step") for rank, tree in trees.items()}


def skip(directory: str) -> dict[str, Any]:
    """Rank 1 raises between saves and misses step 2; both ranks go on saving."""
    _ranks.ARRIVAL_TIMEOUT_S = 3.0  # the last save of the rank ahead waits for one that never comes
    results = {}
    with Checkpointer(directory, mode="sync", timeout_s=60) as ckpt:
        for step in (1, 2, 3, 4):
            if RANK == 1 and step == 2:
                results[step] = "skipped"
                continue
            results[step] = outcome(lambda n=step: ckpt.save(state_of(n), step=n))
        committed = ckpt.steps()
        mixed = [s for s in committed if set(_tree_steps(ckpt, s).values()) != {s}]
    return {"outcomes": results, "steps": committed, "mixed": mixed}


def kill(directory: str) -> dict[str, Any]:
    """Rank 1 is killed after writing its files of step 2; rank 0 must fail, not hang."""
    ckpt = Checkpointer(directory, mode="async", timeout_s=60)
    ckpt.save(state_of(1), step=1).wait()
    if RANK == 1:
        _store.arm_crash("after_data")  # this rank dies once its files of the next save are written
    began = time.monotonic()
    result = outcome(lambda: ckpt.save(state_of(2), step=2).wait())
    return {
        "outcome": result,
        "seconds": time.monotonic() - began,
        "steps": [int(n[5:]) for n in sorted(os.listdir(directory)) if n.startswith("step-")],
    }


def stale_listing(directory: str) -> dict[str, Any]:
    """Rank 1's listing misses the newest step (NFS attribute caching): rank 0's choice holds."""
    with Checkpointer(directory, mode="sync", timeout_s=60) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state_of(step), step=step)
        if RANK == 1:
            listing = ckpt.store.committed
            ckpt.store.committed = lambda: {s: p for s, p in listing().items() if s != 3}  # type: ignore[method-assign]
        return restored_step(ckpt)


def rank0_only(directory: str) -> dict[str, Any]:
    """Only rank 0 checkpoints (as Lightning and nanoGPT do), with ranks='local'."""
    result: dict[str, Any] = {}
    if RANK == 0:
        with Checkpointer(directory, ranks="local") as ckpt:
            ckpt.save(state_of(5), step=5).wait()
            result = restored_step(ckpt)
    dist.barrier()
    return result


def rank0_only_auto(directory: str) -> dict[str, Any]:
    """Only rank 0 creates a Checkpointer without saying ranks='local': a clear error, no hang."""
    _ranks.JOIN_TIMEOUT_S = 3.0
    result: dict[str, Any] = {}
    if RANK == 0:
        began = time.monotonic()
        result = {
            "outcome": outcome(lambda: Checkpointer(directory).close()),
            "seconds": time.monotonic() - began,
        }
    dist.barrier()
    return result


def save_on_rank0_only(directory: str) -> dict[str, Any]:
    """nanoGPT's natural adoption: every rank has a Checkpointer, only rank 0 calls ``save``
    (inside ``if master_process:``) while the others go on to the next step's all-reduce. The
    first save (no layout agreed yet) is refused on the caller's thread. In a second run, after
    a save by both ranks: ``delete(1)`` on rank 0 alone is refused before it deletes anything, and
    a save on rank 0 alone (staged at once with the agreed layout, the ranks' agreement on the
    persist thread) fails in its ``wait``; nothing is committed. Then a save by both commits.
    Last, the same with ``max_inflight=2`` (:func:`_numbered_before_refusal`)."""
    _ranks.ARRIVAL_TIMEOUT_S = 3.0
    torch.manual_seed(0)  # the same weights on both ranks, as DDP makes them
    model = torch.nn.Linear(4, 4)
    result: dict[str, Any] = {}
    with Checkpointer(Path(directory, "first"), timeout_s=120) as ckpt:
        if RANK == 0:
            began = time.monotonic()
            result["outcome"] = outcome(lambda: ckpt.save({"model": model}, step=1))
            result["seconds"] = time.monotonic() - began
        dist.all_reduce(torch.ones(1))  # the next step's gradients (rank 1 waits here all along)
        result["steps"] = ckpt.steps()
    agreed = Path(directory, "agreed")
    with Checkpointer(agreed, timeout_s=120) as ckpt:
        ckpt.save({"model": model}, step=1).wait()
        if RANK == 0:
            result["delete"] = outcome(lambda: ckpt.delete(1))
            result["after_delete"] = sorted(p.name for p in agreed.glob("step-*"))
            began = time.monotonic()
            result["agreed_outcome"] = outcome(lambda: ckpt.save({"model": model}, step=2).wait())
            result["agreed_seconds"] = time.monotonic() - began
        dist.all_reduce(torch.ones(1))
        result["agreed_steps"] = ckpt.steps()
        # the Checkpointer outlives what rank 0 was refused: the next save of both ranks commits
        result["together"] = outcome(lambda: ckpt.save({"model": model}, step=3).wait())
        result["together_steps"] = ckpt.steps()
    result.update(_numbered_before_refusal(Path(directory, "inflight"), model))
    return result


def _numbered_before_refusal(directory: Path, model: torch.nn.Module) -> dict[str, Any]:
    """With ``max_inflight=2``, rank 0 saves step 2 alone and at once step 3, numbered before the
    agreement of 2 is refused (no rank came); rank 1 saves 3 only once 2 was refused (else its
    check-in would meet 2's). Rank 0's persist thread waits, checked in for 3, until rank 1 has
    checked in too (the arrival deadline is 3 s). Then both save 4."""
    store = default_store()
    result: dict[str, Any] = {}

    def arrive(tag: tuple[Any, ...]) -> None:
        if tag[:2] == ("save", 3):
            if RANK == 1:
                store.set("test/inflight/3", "")
            else:
                store.wait(["test/inflight/3"], timedelta(seconds=120))

    with Checkpointer(directory, max_inflight=2, timeout_s=120) as ckpt, armed("ranks.arrive", arrive):
        ckpt.save({"model": model}, step=1).wait()
        if RANK == 0:
            alone = ckpt.save({"model": model}, step=2)
            third = ckpt.save({"model": model}, step=3)
            result["alone"] = outcome(alone.wait)  # raised (told) here, not by the next save
        dist.all_reduce(torch.ones(1))
        if RANK == 1:
            third = ckpt.save({"model": model}, step=3)
        result["third"] = outcome(third.wait)
        result["fourth"] = outcome(lambda: ckpt.save({"model": model}, step=4).wait())
        result["inflight_steps"] = ckpt.steps()
    return result


def scheduled(directory: str) -> dict[str, Any]:
    """A loop that saves when ``ckpt.due()`` says so, rank 1's steps four times slower than rank
    0's and nothing else keeping the ranks in step (each rank's own clock would decide otherwise):
    every rank saves at rank 0's steps, together."""
    state = {"w": torch.full((64,), float(RANK))}
    with Checkpointer(directory, mode="sync", schedule=SaveSchedule(0.5), timeout_s=60) as ckpt:
        saved = []
        for step in range(1, 41):
            began = time.monotonic()
            while time.monotonic() - began < 0.005 * (1 + 3 * RANK):
                pass  # the step's work, on the CPU
            if ckpt.due():
                ckpt.save({f"rank{RANK}": state}, step)
                saved.append(step)
        return {"saved": saved, "steps": ckpt.steps()}


def tied(directory: str) -> dict[str, Any]:
    """A model whose head shares the embedding's weight, saved by every rank (replicated)."""

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
        model[1].weight = model[0].weight
        return model

    model = build(0)
    with Checkpointer(directory, mode="sync", timeout_s=60) as ckpt:
        ckpt.save({"model": model}, step=1)
        items = ckpt.manifest(1)["items"]
        fresh = build(1)
        ckpt.restore({"model": fresh})
    return {
        "same_items": items["model.1.weight"] == items["model.0.weight"],
        "tied_after_restore": fresh[1].weight is fresh[0].weight,
        "exact": torch.equal(fresh[0].weight, model[0].weight),
    }


def rng_rank0_only(directory: str) -> dict[str, Any]:
    """Rank 0 saves alone with its RNG streams; rank 1 restores the step read-only. Rank 1 must
    keep its own streams (a warning says so), never take rank 0's."""
    torch.manual_seed(100 + RANK)
    if RANK == 0:
        with Checkpointer(directory, ranks="local", capture_rng=True) as ckpt:
            ckpt.save({"w": torch.ones(3)}, step=1).wait()
    dist.barrier()
    torch.manual_seed(200 + RANK)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Checkpointer(directory, ranks="local", read_only=True) as ckpt:
            ckpt.restore({"w": torch.zeros(3)})
    draws = torch.rand(4)
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, draws)
    return {
        "same_stream": torch.equal(gathered[0], gathered[1]),
        "warned": [str(w.message) for w in caught if "RNG streams" in str(w.message)],
    }


def rng_every_rank(directory: str) -> dict[str, Any]:
    """Every rank saves (ranks='all') with its RNG: after a restore each rank draws exactly what it
    would have drawn had the run gone on, and the ranks' streams stay apart."""
    torch.manual_seed(300 + RANK)
    with Checkpointer(directory, capture_rng=True, mode="sync", timeout_s=60) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1)
        expected = torch.rand(4)
        torch.manual_seed(999)  # the streams move on (or a fresh process starts)
        ckpt.restore({"w": torch.zeros(3)})
        resumed = torch.rand(4)
    gathered = [torch.zeros(4) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, resumed)
    return {"exact": torch.equal(expected, resumed), "apart": not torch.equal(gathered[0], gathered[1])}


def refused_on_one_rank(directory: str) -> dict[str, Any]:
    """Only rank 1's GradScaler refuses the saved state: rank 0 has loaded its scheduler by then,
    and must put it back; neither rank's model may change (issue 34, item 7)."""
    import warnings

    warnings.simplefilter("ignore")  # GradScaler on the CPU

    def schedule(steps: int) -> Any:
        torch.manual_seed(0)
        optim = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optim, 2)
        for _ in range(steps):
            optim.step()
            scheduler.step()
        return scheduler

    saved = {**state_of(1), "schedule": schedule(3), "scaler": torch.amp.GradScaler("cpu", enabled=False)}
    scaler = torch.amp.GradScaler("cpu", enabled=RANK == 1)
    target = {**state_of(2), "schedule": schedule(0), "scaler": scaler}
    with Checkpointer(directory, mode="sync", timeout_s=60) as ckpt:
        ckpt.save(saved, step=1)
        result = outcome(lambda: ckpt.restore(target))
    untouched = all(
        torch.equal(a, b)
        for a, b in zip(
            target["model"].state_dict().values(), state_of(2)["model"].state_dict().values(), strict=True
        )
    )
    return {
        "outcome": result,
        "last_epoch": target["schedule"].last_epoch,
        "step": target["step"],
        "untouched": untouched and torch.equal(target[f"rank{RANK}"], state_of(2)[f"rank{RANK}"]),
    }


def dropped_uploading(directory: str) -> dict[str, Any]:
    """A Checkpointer dropped unclosed while rank 0's mirror upload has seconds left, the run
    opened again at once on every rank (a cell run again): what the open said on each rank. Last
    in :func:`refusal`'s launch: it shortens the check-ins' deadline for good."""
    _ranks.ARRIVAL_TIMEOUT_S = 1.0  # an upload outlasting the check-in's deadline, in a short test
    uploaded = threading.Event()
    with armed("mirror.upload", lambda location, name: uploaded.wait(60)):
        ckpt = Checkpointer(directory, mirror=f"{directory}-mirror", mode="sync", timeout_s=60)
        ckpt.save(state_of(1), step=1)
        dist.barrier()
        del ckpt
        gc.collect()
        # a slow upload (4 s, past the 1 s deadline): a fault's duration, not synchronisation
        threading.Timer(4.0, uploaded.set).start()
        opened = outcome(lambda: Checkpointer(directory, mirror=f"{directory}-mirror", timeout_s=60).close())
    return {"opened": opened}


SCENARIOS = {
    f.__name__: f
    for f in (
        refused_on_one_rank,
        refusal,
        skip,
        kill,
        stale_listing,
        rank0_only,
        rank0_only_auto,
        save_on_rank0_only,
        scheduled,
        tied,
        rng_rank0_only,
        rng_every_rank,
    )
}


def main(scenario: str, directory: str) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = SCENARIOS[scenario](directory)
    print(json.dumps({"rank": RANK, **result}), flush=True)
    if dist.is_initialized():  # a scenario may have destroyed it (a script's end, before a close)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test prints where this rank was
    sys.exit(main(sys.argv[1], sys.argv[2]))
