"""The bench on many ranks: ``nbckpt bench`` under ``torchrun`` (one node or many).

Every rank runs the same comparison (:func:`~._compare.compare`) on its own workload, and the
strategies take their turns in lockstep: a barrier on a gloo group of the bench's own at the end
of every strategy's turn (outside the lane's clock; the next turn starts from it, a run's first
after a barrier of its own), and at the start of every repeat, so all ranks hit the storage
together as a real job does. Each rank saves as its users would on many ranks: nbckpt's and
DCP's strategies with the group (one checkpoint folder, each rank writing its part);
``torch-save`` of a replicated (DDP-like) state on rank 0 alone, of a state per rank into a file
per rank. Before every repeat all ranks write their share of a checkpoint at once, raw (the
concurrent write floor), then measure their copy floors, every rank at once. At the end each
rank's record (its per-strategy figures, the wall-clock span of each checkpoint it wrote, its
floors and its host's load) is gathered to rank 0, outside every timed region, and
:func:`~._job.job_summary` makes the job's figures of them; rank 0 alone prints and writes
results.

Launch (``srun torchrun ...`` on SLURM, one agent per node)::

    torchrun --nproc-per-node 4 -m nbckpt bench --size-mb 256 --dir /mnt/shared/bench --json out.json
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from .._errors import ConfigError
from .._util import GB, is_url
from ..engine import CheckpointConfig, Event, Timeline
from ..engine._internal import fsspec_options, open_fsspec, step_name
from ._comparison import Comparison
from ._dcp import DcpAsync, DcpSync
from ._job import RankRecord, job_summary
from ._measure import RawWriteBeside, concurrent_write
from ._rank_timeline import gather_rank_timeline
from ._rank_workload import RankWorkload, state_digests
from ._runner import EventCallback, Lane, RunProgress
from ._strategies import TorchSave
from ._strategy import Strategy, join
from ._workloads import Workload

__all__ = [
    "HOST_VARIABLE",
    "RankJob",
    "RankLane",
    "RankStrategy",
    "arm_slow",
    "in_torchrun",
    "on_ranks",
]

#: How long a rank waits at the bench's barriers for the others (a rank that died: torchrun's
#: agent ends the others first, as a rule).
BARRIER_TIMEOUT_S = 600.0
# Events that mark a checkpoint's span on a rank: from its save's start to its last durable write.
_SPAN_START = frozenset({"stall", "stage", "persist", "fsync", "commit"})
_SPAN_END = frozenset({"persist", "fsync", "commit"})

#: The environment variable that names this rank's host in the results (default: the host name).
HOST_VARIABLE = "NBCKPT_BENCH_HOST"

_slow: tuple[int, float] | None = None


def arm_slow(rank: int | None, seconds: float = 0.0) -> None:
    """Make every checkpoint save of rank ``rank`` return ``seconds`` late (None: no rank), for
    the straggler's tests (nothing is read from the environment): that rank's stall, and only
    its, grows by ``seconds`` per checkpoint, as on a rank whose copy is slow."""
    global _slow
    _slow = None if rank is None else (rank, seconds)


def in_torchrun() -> bool:
    """True in one of several ranks: torch.distributed initialized with more than one, or
    torchrun's ``WORLD_SIZE`` above 1 (the group is then started by :meth:`RankJob.start`); and
    in any rank torchrun started, one alone too (``TORCHELASTIC_RUN_ID``: the 1 of ``--ranks
    1,2,4`` is a job of one rank, its figures measured as the others')."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


class RankStrategy(Strategy):
    """A strategy in its many-rank form; the runner and the comparison read the flags of the
    strategy it wraps. ``torch-save`` saves on rank 0 alone when the state is replicated, else
    each rank into a folder of its own; every other strategy saves on every rank, with the group."""

    def __init__(self, inner: Strategy, job: RankJob) -> None:
        super().__init__(inner.storage_options)
        self.inner, self.job = inner, job
        # Class-level flags of the inner strategy, as instance attributes (read the same way).
        vars(self).update(
            {
                flag: getattr(inner, flag)
                for flag in (
                    "name",
                    "description",
                    "writes_checkpoints",
                    "blocks_before_step",
                    "local_only",
                    "stall_covers_copy",
                    "whole_saves",
                )
            }
        )
        self.torch_save = isinstance(inner, TorchSave)
        if isinstance(inner, (DcpSync, DcpAsync)):
            inner.process_group = job.dcp_group
        self.saves = not (self.torch_save and job.replicated and job.rank != 0)
        self._counted: set[tuple[int, int, int]] = set()  # files counted already, by inode

    def open(self, directory: str, timeline: Timeline) -> None:
        self._timeline = timeline
        self._counted = set()  # a fresh folder: nothing in it was counted
        self.inner.open(directory, timeline)
        self.path = self.inner.path  # what the comparison removes: every rank's files
        if self.torch_save and not self.job.replicated:
            self.inner.path = join(self.path, f"rank-{self.job.rank}")
            os.makedirs(self.inner.path, exist_ok=True)

    def save(self, state: Mapping[str, Any], step: int) -> None:
        if self.saves:
            self.inner.save(state, step)
        if _slow is not None and _slow[0] == self.job.rank:
            time.sleep(_slow[1])  # the test-only fault: this rank's save returns late

    def written(self, step: int) -> int | None:
        """Bytes this rank wrote of checkpoint ``step``: its files of that step on disk (DCP's
        and nbckpt's ``__<rank>_<n>.distcp``, torch.save's file) that no earlier checkpoint of
        this strategy had, or its objects in an object store; None where that cannot be told (a
        checkpoint already removed by retention). An incremental save's file shared by hard link
        with an earlier step is that step's inode: counted there, once, not again here."""
        if not self.writes_checkpoints:
            return None
        if is_url(self.path):
            return self._written_objects(step)
        if self.torch_save:
            if not self.saves:
                return 0
            files = [os.path.join(self.inner.path, step_name(step) + TorchSave.suffix)]
        else:
            pattern = os.path.join(glob.escape(self.path), step_name(step), f"__{self.job.rank}_*.distcp")
            files = glob.glob(pattern)
        found = [os.stat(name) for name in files if os.path.isfile(name)]
        if not found:
            return None
        # The modification time too: an inode number freed by a deleted step may come back.
        keys = [(info.st_dev, info.st_ino, info.st_mtime_ns) for info in found]
        new = sum(info.st_size for info, key in zip(found, keys, strict=True) if key not in self._counted)
        self._counted.update(keys)
        return new

    def _written_objects(self, step: int) -> int | None:
        """Bytes of this rank's ``__<rank>_<n>.distcp`` objects of checkpoint ``step`` (only
        nbckpt's strategies write to an object store; one listing per checkpoint, after its turn)."""
        protocol = self.path.partition("://")[0]
        fs, root = open_fsspec(self.path, fsspec_options(protocol, self.storage_options))
        fs.invalidate_cache()  # the listing must see what the turn just wrote
        found = fs.glob(f"{root}/{step_name(step)}/__{self.job.rank}_*.distcp", detail=True)
        sizes = [int(info["size"]) for info in found.values()]
        return sum(sizes) if sizes else None

    def before_step(self) -> None:
        self.inner.before_step()

    def finish(self) -> None:
        self.inner.finish()

    def close(self) -> None:
        self.inner.close()

    def save_cpu_s(self) -> float | None:
        return self.inner.save_cpu_s()


class RankLane(Lane):
    """A lane that starts and ends each turn together with the other ranks (the barriers run
    outside its clock) and keeps its events on the wall clock, for the job's spans."""

    def __init__(
        self,
        job: RankJob,
        name: str,
        strategy: Strategy,
        workload: Workload,
        *,
        steps: int,
        every: int,
        on_event: EventCallback | None,
        progress: RunProgress | None,
        repeat: int,
        floor: bool = False,
    ) -> None:
        super().__init__(
            name,
            strategy,
            workload,
            steps=steps,
            every=every,
            on_event=on_event,
            progress=progress,
            repeat=repeat,
        )
        self.job = job
        self.floor = floor  # a floor's lane (RankJob.beside), no strategy's
        self.raw: list[Event] = []
        self.written: dict[int, int | None] = {}  # bytes on disk of each checkpoint, by step
        self.timeline.add_listener(self._keep)

    def _keep(self, event: Event) -> None:
        if self.active:
            self.raw.append(event)

    def open(self, directory: str, warmup: bool) -> None:
        self.job.turn_ended = False  # opening (a warm-up save) takes each rank its own time
        super().open(directory, warmup)

    def resume(self) -> None:
        if not self.active and not self.job.turn_ended:
            self.job.barrier()
        self.job.turn_ended = False
        super().resume()

    def pause(self) -> None:
        turned = self.active
        super().pause()
        if turned:
            self._measure_written()
            self._digest_kept()
            self.job.barrier()
            # Every rank left that barrier together: a turn that starts next starts together
            # without one of its own (the runner does nothing between one turn and the next).
            self.job.turn_ended = True

    def _digest_kept(self) -> None:
        """With ``--keep``, the digests of the state the last repeat's last checkpoint saved:
        taken outside the clock, at the turn's end, when no step has trained since that save."""
        last = self.last_saved
        if (
            not self.job.keep
            or self.floor
            or self.repeat != self.job.repeats - 1
            or last is None
            or self.workload.step != last
            or not self.strategy.writes_checkpoints
            or any(kept["strategy"] == self.name for kept in self.job.kept)
        ):
            return
        self.job.kept.append(
            {
                "strategy": self.name,
                "repeat": self.repeat,
                "step": last,
                "digests": state_digests(self.workload.state()),
            }
        )

    def _measure_written(self) -> None:
        """What this rank wrote of each checkpoint of the turn, from its files: the engines'
        events give the bytes of the state, and a replicated state is written once over all."""
        if not isinstance(self.strategy, RankStrategy):
            return
        for event in self.raw:
            if event.kind in _SPAN_END and event.step is not None and event.step not in self.written:
                self.written[event.step] = self.strategy.written(event.step)

    def spans(self) -> list[dict[str, Any]]:
        """Each checkpoint this rank wrote in the lane: from its save's start to its last
        durable write (wall-clock ns), and the bytes it wrote."""
        by_step: dict[int, list[Event]] = {}
        for event in self.raw:
            saving = event.kind in _SPAN_START and event.detail.get("part") in (None, "save")
            if event.step is not None and saving:
                by_step.setdefault(event.step, []).append(event)
        spans = []
        for step, events in sorted(by_step.items()):
            ends = [event.end_ns for event in events if event.kind in _SPAN_END]
            if not ends:
                continue  # nothing written here (torch-save of a replicated state off rank 0)
            on_disk = self.written.get(step)
            persists = [event for event in events if event.kind == "persist"]
            # the write's start, after the copy (None: a strategy that records no persist)
            write_ns = min(event.start_ns for event in persists) if persists else None
            offset = self.job.wall_offset_ns
            spans.append(
                {
                    "strategy": self.name,
                    "repeat": self.repeat,
                    "step": step,
                    "start_ns": min(event.start_ns for event in events) + offset,
                    "persist_start_ns": None if write_ns is None else write_ns + offset,
                    "end_ns": max(ends) + offset,
                    "bytes": sum(event.bytes for event in persists) if on_disk is None else on_disk,
                    "persist_s": sum(event.duration_s for event in persists),
                    # this rank's training steps that ran while it wrote (or saved, with no write)
                    "steps_beside": self._steps_beside(
                        min(event.start_ns for event in events) if write_ns is None else write_ns, max(ends)
                    ),
                }
            )
        return spans

    def _steps_beside(self, begin_ns: int, end_ns: int) -> int:
        """How many of this lane's training steps overlapped ``begin_ns..end_ns`` (event clock)."""
        return sum(
            1
            for event in self.raw
            if event.kind == "step" and event.start_ns < end_ns and event.end_ns > begin_ns
        )


class RankJob:
    """This rank's part in a bench on many ranks (the :class:`~._compare.Coordination` that
    :func:`~._compare.compare` takes as ``ranks``)."""

    def __init__(self, group: Any, dcp_group: Any, *, own_default: bool, sharded: bool = False) -> None:
        self.group = group
        self.dcp_group = dcp_group
        self.own_default = own_default
        self.sharded = sharded
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # The host the record names: NBCKPT_BENCH_HOST where the host name does not tell the
        # agents apart (two torchrun agents on one machine imitating two hosts, containers).
        self.host = os.environ.get(HOST_VARIABLE) or socket.gethostname()
        self.workload: RankWorkload | None = None
        self.lanes: list[RankLane] = []
        self.floor_writes: list[dict[str, Any]] = []
        # The raw write beside training (beside()): measured where the host's cores train (set
        # by run_bench_on_ranks: on CPU without --idle-compute), its lanes apart from the strategies'.
        self.write_beside = False
        self.beside_lanes: list[RankLane] = []
        self.beside_config = CheckpointConfig()  # nbckpt's writers as the bench's strategies open them
        self.keep, self.repeats = False, 1  # --keep: the kept checkpoints' digests are recorded
        self.kept: list[dict[str, Any]] = []
        # How long this rank spent in each of the bench's own collectives (its barriers and the
        # events' gather, outside every lane's clock), in order: every rank passes the same ones,
        # so rank 0 can tell a collective's own cost from the wait for the slowest rank (._job).
        self.collectives_ns: list[int] = []
        # From a turn's closing barrier until anything but the next turn runs (RankLane).
        self.turn_ended = False
        # The event clock (perf_counter) on the wall clock, which the ranks (and hosts) share.
        self.wall_offset_ns = time.time_ns() - time.perf_counter_ns()

    @classmethod
    def start(cls, device: str, *, sharded: bool = False) -> RankJob:
        """Join torchrun's ranks (starting the default group if the caller has not: gloo, and
        NCCL for CUDA tensors) and open the bench's own gloo group; ``sharded``: the GPT is
        sharded with FSDP2 over the default group."""
        own = not dist.is_initialized()
        if own:
            if device == "cuda":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            try:
                dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
            except (ValueError, RuntimeError) as exc:
                raise ConfigError(f"cannot join the other ranks (run under torchrun): {exc}") from exc
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
        dcp_group = dist.new_group(backend="gloo")  # DCP's strategies' own (see their process_group)
        return cls(group, dcp_group, own_default=own, sharded=sharded)

    @property
    def replicated(self) -> bool:
        return self.workload is not None and self.workload.replicated

    def adopt(self, workload: Workload) -> RankWorkload:
        self.workload = RankWorkload(workload, self.rank, self.world_size, sharded=self.sharded)
        return self.workload

    def barrier(self) -> None:
        self.turn_ended = False
        begin = time.perf_counter_ns()
        dist.barrier(group=self.group)
        self.collectives_ns.append(time.perf_counter_ns() - begin)

    def gather_timeline(self, timeline: pd.DataFrame) -> list[dict[str, Any]]:
        """Every rank's events on the wall clock, on rank 0 (``[]`` elsewhere), after the comparison;
        each persist carries the bytes this rank wrote, as its record's spans count them (not the
        state's, which the engines' events give: a replicated state is written once over all)."""
        written = {
            (lane.name, lane.repeat, step): nbytes
            for lane in self.lanes
            for step, nbytes in lane.written.items()
            if nbytes is not None
        }
        begin = time.perf_counter_ns()
        rows = gather_rank_timeline(self.group, timeline, written)
        self.collectives_ns.append(time.perf_counter_ns() - begin)
        return rows

    # -- the Coordination compare() takes --------------------------------------------------

    def strategy(self, strategy: Strategy) -> Strategy:
        return RankStrategy(strategy, self)

    def lane(
        self,
        name: str,
        strategy: Strategy,
        workload: Workload,
        *,
        steps: int,
        every: int,
        on_event: EventCallback | None,
        progress: RunProgress | None,
        repeat: int,
    ) -> Lane:
        lane = RankLane(
            self,
            name,
            strategy,
            workload,
            steps=steps,
            every=every,
            on_event=on_event,
            progress=progress,
            repeat=repeat,
        )
        self.lanes.append(lane)
        return lane

    def before_repeat(self, repeat: int, directory: str, storage_options: dict[str, Any] | None) -> None:
        """Start the repeat together, every rank first writing its share of a checkpoint at
        once, raw and durably: the write floor of the storage as this job sees it. Each rank
        prepares its write, then the barrier releases every rank's at once; its span is its
        write's first byte to its fsync's end, as a save's is its write's start to its commit."""
        share = self.workload.share_bytes if self.workload is not None else 1
        begin, end = concurrent_write(directory, share, start=self.barrier, storage_options=storage_options)
        self.floor_writes.append({"repeat": repeat, "start_ns": begin, "end_ns": end, "bytes": share})
        self.barrier()

    def beside(self, repeat: int, directory: str, *, steps: int, every: int) -> list[Lane]:
        """The raw write of this rank's share beside training (:class:`~._measure.RawWriteBeside`),
        a lane taking its turns with the strategies', where ``write_beside`` and the directory
        is local; none elsewhere."""
        if not self.write_beside or self.workload is None or is_url(directory):
            return []
        floor = RawWriteBeside(self.workload.share_bytes, config=self.beside_config, rank=self.rank)
        lane = RankLane(
            self,
            floor.name,
            floor,
            self.workload,
            steps=steps,
            every=every,
            on_event=None,
            progress=None,
            repeat=repeat,
            floor=True,
        )
        self.beside_lanes.append(lane)
        return [lane]

    def remove(self, path: str) -> None:
        """Rank 0 removes the shared folder (every rank is done with it: the turns ended together);
        the next repeat starts with a barrier, after it."""
        self.turn_ended = False
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    # -- after the comparison ------------------------------------------------------------------

    def record(self, comparison: Comparison) -> dict[str, Any]:
        """This rank's record (:data:`~._job.RankRecord`)."""
        spans = [span for lane in self.lanes for span in lane.spans()]
        written: dict[str, list[float]] = {}
        for span in spans:
            totals = written.setdefault(span["strategy"], [0, 0.0])
            totals[0] += span["bytes"]
            totals[1] += span["persist_s"]
        rows = comparison.results.to_dict(orient="records") if len(comparison.results) else []
        return {
            "rank": self.rank,
            "host": self.host,
            "strategies": [
                {
                    "strategy": row["strategy"],
                    "stall_s": _float(row["stall_mean_s"]),
                    "persist_s": _float(row["persist_s"]),
                    "bytes": int(written.get(row["strategy"], [0, 0.0])[0]),
                    "write_gbs": _rate(*written.get(row["strategy"], [0, 0.0])),
                    "mean_step_s": _float(row["mean_step_s"]),
                    "overhead_pct": _float(row["overhead_pct"]),
                    "checkpoints": int(row["checkpoints"]),
                }
                for row in rows
            ],
            "copy_floor": _copy_floor(comparison),
            "load": {key: value for key, value in comparison.load.items() if key != "floors"},
            "checkpoints": spans,
            "floor_writes": list(self.floor_writes),
            "floor_beside_writes": [span for lane in self.beside_lanes for span in lane.spans()],
            "floor_beside": {
                "writer_threads": self.beside_config.writer_threads,
                "writer_nice": self.beside_config.writer_nice,
            },
            "kept": list(self.kept),
            "collectives_s": [spent / 1e9 for spent in self.collectives_ns],
            "steps_trained": sum(lane.steps for lane in [*self.lanes, *self.beside_lanes]),
        }

    def gather(self, record: RankRecord) -> list[RankRecord] | None:
        """Every rank's record on rank 0 (in rank order), None elsewhere."""
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        begin = time.perf_counter_ns()
        dist.gather_object(record, gathered, dst=0, group=self.group)
        # The gather's own time is known only after it: rank 0 adds its own to the job's figures.
        if gathered is not None:
            gathered[0] = {**gathered[0], "gather_s": (time.perf_counter_ns() - begin) / 1e9}
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group(self.group)
            dist.destroy_process_group(self.dcp_group)
            if self.own_default:
                dist.destroy_process_group()


def _copy_floor(comparison: Comparison) -> dict[str, Any]:
    """The copy floor this rank measured beside each repeat, as one process measures it
    (:func:`~._measure.measure_floors`): every rank at once, right after the repeat's concurrent
    raw write, so that the ranks of a host share its memory bandwidth as their saves do."""
    floors = comparison.floors
    return {
        "bytes": floors.bytes,
        "copy_s": floors.copy_s,
        "copy_gbs": floors.copy_gbs,
        "copy_gbs_by_repeat": list(floors.copy_gbs_by_repeat),
    }


def _float(value: Any) -> float:
    return math.nan if value is None or pd.isna(value) else float(value)


def _rate(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else math.nan


def on_ranks(
    device: str,
    run: Callable[[RankJob], Comparison],
    *,
    sharded: bool = False,
    keep: bool = False,
    repeats: int = 1,
    write_beside: bool = False,
) -> Comparison:
    """``run(job)`` as this rank's part of a bench on many ranks (the comparison, run with
    ``ranks=job``), then every rank's record gathered to rank 0: there the comparison carries the
    job's figures (``ranks``, ``job``), elsewhere this rank's own alone."""
    job = RankJob.start(device, sharded=sharded)
    job.keep, job.repeats, job.write_beside = keep, repeats, write_beside
    try:
        comparison = run(job)
        records = job.gather(job.record(comparison))
        if records is not None:
            comparison.ranks, comparison.job = job_summary(records)
        return comparison
    finally:
        job.close()
