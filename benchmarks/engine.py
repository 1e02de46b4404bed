"""Engine benchmark: nbckpt against its floors and its peers at their best, per GB, in one run.

    .venv/bin/python benchmarks/engine.py --json data/results/engine-cpu.json
    .venv/bin/python benchmarks/engine.py --quick        # small sizes: checks the script (~1 min)
    .venv/bin/python benchmarks/engine.py --reprint data/results/engine-cpu.json   # tables again

Method. Every comparison runs its methods one after another within each repeat, so that drift
on a shared machine hits all of them alike, and repeats that --repeats times. Each row gives
the median and a 95 % interval (t-interval of the mean); each check is a ratio computed per
repeat (paired): its median, and the interval of its geometric mean (a t-interval of the log).
CPU seconds are user+system time of this process and its children over the operation
(background threads and DCP's writer process included), per GB of state. Floors are measured on
the same bytes and the same directory: a raw write of the state's memory (2 files by 2 threads,
large writes, fsync), the least pipeline with nbckpt's guarantees (copy into a reused buffer,
xxh3, the same raw write), and a raw read of the checkpoint's files into fresh memory. Local-disk
reads are made cold (the files' pages are dropped with posix_fadvise first); /dev/shm
stands in for storage faster than one writer.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch
import xxhash
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from nbckpt import Checkpointer, Timeline
from nbckpt._util import GB, MIB
from nbckpt.bench import make_workload
from nbckpt.bench._internal import get_strategy, plain_state, t_interval, tensor_bytes
from nbckpt.engine._internal import fsync_dir, write_all

# -- measuring ---------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """User+system CPU of this process, its finished children and its live ones (DCP's writer)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            live += times.user + times.system
        except psutil.Error:
            pass
    return own.ru_utime + own.ru_stime + done.ru_utime + done.ru_stime + live


@dataclass
class Sample:
    wall_s: float
    cpu_s: float


@contextmanager
def measured(out: list[Sample]) -> Iterator[None]:
    gc.collect()
    cpu, wall = cpu_seconds(), time.perf_counter()
    yield
    out.append(Sample(time.perf_counter() - wall, cpu_seconds() - cpu))


def interval(values: list[float]) -> dict[str, float]:
    """Median, mean and the 95 % t-interval of the mean."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return {"median": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    mean, lo, hi = t_interval(values)
    return {"median": statistics.median(values), "mean": mean, "lo": lo, "hi": hi, "n": len(values)}


def ratio_interval(ratios: list[float]) -> dict[str, float]:
    """Median of per-repeat ratios and the 95 % interval of their geometric mean.

    A ratio's spread is multiplicative: the t-interval of its logarithm, mapped back, never
    goes below zero the way an interval of the raw ratios does when one repeat is an outlier.
    """
    ratios = [r for r in ratios if math.isfinite(r) and r > 0]
    if not ratios:
        return {"median": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
    mean, lo, hi = (math.exp(v) if math.isfinite(v) else v for v in t_interval([math.log(r) for r in ratios]))
    return {"median": statistics.median(ratios), "geomean": mean, "lo": lo, "hi": hi, "n": len(ratios)}


@dataclass
class Table:
    """Rows of one comparison: name -> metric -> per-repeat values."""

    title: str
    nbytes: int
    rows: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, name: str, sample: Sample, **extra: float) -> None:
        row = self.rows.setdefault(name, {})
        gb = self.nbytes / GB
        for metric, value in {
            "wall_s": sample.wall_s,
            "cpu_s_per_gb": sample.cpu_s / gb,
            "gb_per_s": gb / sample.wall_s if sample.wall_s > 0 else math.nan,
            **extra,
        }.items():
            row.setdefault(metric, []).append(value)

    def ratio(self, name: str, other: str, metric: str, other_metric: str = "") -> dict[str, float]:
        """``name``'s ``metric`` over ``other``'s (``other_metric``, default the same), repeat by repeat."""
        pairs = zip(self.rows[name][metric], self.rows[other][other_metric or metric], strict=True)
        return ratio_interval([a / b for a, b in pairs if b])

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "bytes": self.nbytes,
            "rows": {
                name: {metric: {"values": values, **interval(values)} for metric, values in row.items()}
                for name, row in self.rows.items()
            },
        }

    def print(self) -> None:
        print(f"\n{self.title} ({self.nbytes / GB:.3f} GB; median [95 % interval])")
        metrics = list(dict.fromkeys(m for row in self.rows.values() for m in row))
        print(f"{'':34}" + "".join(f"{m:>26}" for m in metrics))
        for name, row in self.rows.items():
            cells = []
            for metric in metrics:
                s = interval(row.get(metric, []))
                cells.append(f"{s['median']:9.3f} [{s['lo']:6.3f},{s['hi']:6.3f}]" if s["n"] else "")
            print(f"{name:34}" + "".join(f"{c:>26}" for c in cells))


# -- states and floors ---------------------------------------------------------------------------


def make_state(nbytes: int, tensors: int, *, shapes: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """``tensors`` float32 tensors adding up to about ``nbytes`` (``shapes`` distinct lengths)."""
    per = max(nbytes // 4 // tensors, 1)
    generator = torch.Generator().manual_seed(0)
    state = {}
    for i in range(tensors):
        numel = per + (i % shapes if shapes else 0)
        state[f"layers.{i}.weight"] = torch.randn(numel, generator=generator).to(device)
    return state


def synchronize() -> None:
    """Wait for the GPU's queued copies (a no-op without CUDA), so a time covers the whole copy."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def byte_views(state: dict[str, torch.Tensor]) -> list[memoryview]:
    return [t.reshape(-1).view(torch.uint8).numpy().data.cast("B") for t in state.values()]


def halves(views: list[memoryview]) -> list[list[memoryview]]:
    """The views split into two groups of about equal bytes (one per writer thread)."""
    groups: list[list[memoryview]] = [[], []]
    sizes = [0, 0]
    for view in sorted(views, key=len, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(view)
        sizes[i] += len(view)
    return groups


def parallel(jobs: Sequence[Callable[[], object]]) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def copy_in_halves(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor], pin: bool) -> None:
    """Copy every tensor into its preallocated twin, half the keys on each of two threads."""

    def copy(keys: list[str]) -> None:
        for key in keys:
            target[key].copy_(source[key], non_blocking=pin)

    keys = list(source)
    parallel([partial(copy, keys[i::2]) for i in range(2)])
    synchronize()


def write_files(directory: Path, groups: list[list[memoryview]], *, hash_pieces: bool = False) -> None:
    """Each group to its own file in its own thread: large writes, fsync, then the file is gone."""

    def write(index: int, views: list[memoryview]) -> None:
        path = directory / f".floor-{index}.bin"
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            hasher = xxhash.xxh3_64()
            for view in views:
                for at in range(0, len(view), MIB):
                    piece = view[at : at + MIB]
                    if hash_pieces:
                        hasher.update(piece)
                    write_all(fd, piece)
            os.fsync(fd)
        finally:
            os.close(fd)

    parallel([partial(write, i, g) for i, g in enumerate(groups)])
    for index in range(len(groups)):
        (directory / f".floor-{index}.bin").unlink()


def drop_cache(paths: list[Path]) -> None:
    """Evict the files' clean pages (no root needed): the next read comes from the device."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_files(paths: list[Path]) -> None:
    """The raw read floor: each file into fresh memory in its own thread, large reads."""

    def read(path: Path) -> None:
        buffer = torch.empty(path.stat().st_size, dtype=torch.uint8).numpy().data.cast("B")
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while offset < len(buffer):
                offset += os.preadv(fd, [buffer[offset : offset + 8 * MIB]], offset)
        finally:
            os.close(fd)

    parallel([partial(read, p) for p in paths])


def verified_read(paths: list[Path], buffer: torch.Tensor, template: dict[str, torch.Tensor]) -> None:
    """The verified-read floor: each file into its part of one reused buffer, in its own thread,
    xxh3 of every byte on the way, then every tensor's bytes copied into ``template``'s.

    The least a verified restore must do: read, check, and give the caller its tensors. As a
    floor it copies each tensor's worth of bytes from the buffer in order, ignoring the framing
    between them: where exactly they come from costs nothing more."""
    sizes = [p.stat().st_size for p in paths]
    starts = [sum(sizes[:i]) for i in range(len(paths))]
    whole = buffer.numpy().data.cast("B")

    def read(path: Path, start: int, size: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(0, size, MIB):
                piece = whole[start + offset : start + min(size, offset + MIB)]
                os.preadv(fd, [piece], offset)
                xxhash.xxh3_64(piece)
        finally:
            os.close(fd)

    parallel([partial(read, p, start, size) for p, start, size in zip(paths, starts, sizes, strict=True)])
    at = 0
    for tensor in template.values():
        flat = tensor.view(-1).view(torch.uint8)
        flat.copy_(buffer[at : at + tensor.nbytes])
        at += tensor.nbytes


def load_into(template: dict[str, torch.Tensor], path: Path) -> None:
    """torch.load of ``path``, then every tensor copied into ``template``'s (a model's, already there)."""
    loaded = torch.load(path, weights_only=True)
    for key, tensor in template.items():
        tensor.copy_(loaded[key])


def torch_save_fsync(state: Any, path: Path) -> None:
    with open(path, "wb") as stream:
        torch.save(state, stream)
        stream.flush()
        os.fsync(stream.fileno())
    fsync_dir(str(path.parent))


@contextmanager
def crc32(enabled: bool) -> Iterator[None]:
    """torch.save with or without its zip CRC32 (off: torch.save at its best; torch.load never checks it)."""
    from torch.utils.serialization import config

    before = config.save.compute_crc32
    config.save.compute_crc32 = enabled
    try:
        yield
    finally:
        config.save.compute_crc32 = before


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- the comparisons -----------------------------------------------------------------------------


def bench_persist(directory: Path, state: dict[str, torch.Tensor], repeats: int) -> Table:
    """Persist bandwidth and CPU per GB: nbckpt async against the raw write and the least pipeline."""
    table = Table(f"persist into {directory}", tensor_bytes(state))
    host = {k: v.cpu() for k, v in state.items()}  # the raw write floor writes host memory
    groups = halves(byte_views(host))  # split once: the timed write is the write alone
    pin = torch.cuda.is_available()
    staging = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}
    staging_views = halves(byte_views(staging))
    run = directory / "nbckpt"
    clean(run)
    with Checkpointer(run, keep=1) as ckpt:
        ckpt.save(state, step=0).wait()  # allocates the staging images once, as training would
        for step in range(1, repeats + 1):
            sample: list[Sample] = []
            with measured(sample):
                write_files(directory, groups)
            table.add("raw write (2 streams)", sample[-1])
            with measured(sample):
                copy_in_halves(staging, state, pin)
                write_files(directory, staging_views, hash_pieces=True)
            table.add("least pipeline (copy+xxh3+write)", sample[-1])
            with measured(sample):
                record = ckpt.save(state, step=step).wait()
                ckpt.wait()
            table.add(
                "nbckpt async (save to commit)",
                sample[-1],
                persist_gb_per_s=table.nbytes / GB / record.persist_s,
                stall_s=record.stall_s,
            )
    clean(run)
    return table


def bench_restore(directory: Path, state: dict[str, torch.Tensor], repeats: int, *, cold: bool) -> Table:
    """Restore with verification against dcp.load, torch.load and the raw read of the same files."""
    table = Table(f"restore from {directory} ({'cold' if cold else 'page cache'})", tensor_bytes(state))
    run, dcp_dir, torch_file = directory / "nbckpt", directory / "dcp", directory / "state.pt"
    for path in (run, dcp_dir):
        clean(path)
    with Checkpointer(run) as ckpt:
        step_dir = Path(ckpt.save(state, step=1).wait().path)
    dcp_save(state, checkpoint_id=dcp_dir, no_dist=True)
    torch_save_fsync(state, torch_file)
    files = sorted(step_dir.glob("*.distcp"))
    template = {k: torch.zeros_like(v) for k, v in state.items()}  # a model's tensors, already there

    def maybe_drop(paths: list[Path]) -> None:
        if cold:
            drop_cache(paths)

    buffer = torch.empty(sum(p.stat().st_size for p in files), dtype=torch.uint8)
    buffer.fill_(0)  # reused: its pages are in memory before the first repeat
    for _ in range(repeats):
        sample: list[Sample] = []
        maybe_drop(files)
        with measured(sample):
            read_files(files)
        table.add("raw read (files into new memory)", sample[-1])
        maybe_drop(files)
        with measured(sample):
            verified_read(files, buffer, template)
        table.add("verified-read floor (reused buffer, xxh3, copy in)", sample[-1])
        maybe_drop([*step_dir.iterdir()])
        # opened as a restarted run opens it; timed from restore()
        with Checkpointer(run) as ckpt, measured(sample):
            ckpt.restore(template)
            synchronize()
        table.add("nbckpt restore (verified)", sample[-1])
        maybe_drop([*dcp_dir.iterdir()])
        with measured(sample):
            dcp_load(template, checkpoint_id=dcp_dir, no_dist=True)
            synchronize()
        table.add("dcp.load", sample[-1])
        maybe_drop([torch_file])
        with measured(sample):
            load_into(template, torch_file)
            synchronize()
        table.add("torch.load + copy in", sample[-1])
    assert all(torch.equal(template[k], v) for k, v in state.items())
    for path in (run, dcp_dir, torch_file):
        clean(path) if path.is_dir() else path.unlink()
    return table


def bench_sync_save(directory: Path, state: dict[str, torch.Tensor], repeats: int, title: str) -> Table:
    """A synchronous save (commit before return) against torch.save + fsync of file and directory."""
    table = Table(title, tensor_bytes(state))
    run = directory / "nbckpt"
    clean(run)
    with Checkpointer(run, mode="sync", keep=1) as ckpt:
        sample: list[Sample] = []
        with measured(sample):
            ckpt.save(state, step=0)
        table.add("nbckpt first save (plans, allocates)", sample[-1])
        for step in range(1, repeats + 1):
            for crc in (True, False):
                with crc32(crc), measured(sample):
                    torch_save_fsync(state, directory / "state.pt")
                table.add(f"torch.save + fsync{'' if crc else ' (no CRC32)'}", sample[-1])
            with measured(sample):
                ckpt.save(state, step=step)
            table.add("nbckpt sync save", sample[-1])
    (directory / "state.pt").unlink()
    clean(run)
    return table


def bench_many_restore(directory: Path, state: dict[str, torch.Tensor], repeats: int) -> Table:
    table = Table(f"restore of {len(state)} tensors", tensor_bytes(state))
    run, torch_file = directory / "nbckpt", directory / "state.pt"
    clean(run)
    with Checkpointer(run) as ckpt:
        ckpt.save(state, step=1).wait()
    torch_save_fsync(state, torch_file)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    for _ in range(repeats):
        sample: list[Sample] = []
        with measured(sample):
            load_into(template, torch_file)
        table.add("torch.load + copy in", sample[-1])
        with Checkpointer(run) as ckpt, measured(sample):
            ckpt.restore(template)
        table.add("nbckpt restore (verified)", sample[-1])
    torch_file.unlink()
    clean(run)
    return table


def model_state(preset: str, device: str) -> dict[str, Any]:
    """A GPT workload's real state (model and AdamW moments, hundreds of tensors), trained 2 steps."""
    workload = make_workload(preset, None, device)
    workload.build()
    for _ in range(2):
        workload.train_step(lambda: None)
    return dict(workload.state())


def bench_stall(directory: Path, state: dict[str, Any], repeats: int, title: str = "") -> Table:
    """How long the training loop is blocked per checkpoint: until the state may change again."""
    table = Table(title or f"stall into {directory}", tensor_bytes(plain_state(state)))
    names = ["dcp-async", "dcp-async-stager", "nbckpt-async"]
    strategies = {}
    for name in names:
        strategy = get_strategy(name)
        strategy.open(str(directory), Timeline())
        strategy.save(state, 0)  # warm-up: buffers, caches, the writer process
        strategy.finish()
        strategies[name] = strategy
    try:
        for step in range(1, repeats + 1):
            for name, strategy in strategies.items():
                sample: list[Sample] = []
                with measured(sample):
                    strategy.save(state, step)
                    strategy.before_step()  # waits for the copy where the strategy must
                    synchronize()
                stall = sample[-1]
                strategy.finish()
                table.add(name, stall)
    finally:
        for strategy in strategies.values():
            strategy.close()
            clean(Path(strategy.path))
    return table


# -- a writer process, measured against threads ---------------------------------------------------


def _process_writer(connection: Any, images: list[torch.Tensor], directory: str) -> None:
    from nbckpt.engine._files import LocalSink, write_image

    while connection.recv():
        for index, image in enumerate(images):
            path = os.path.join(directory, f".proc-{index}.bin")
            write_image(LocalSink(path), image.numpy().data.cast("B"), fsync=True)
            os.unlink(path)
        connection.send(True)


class _WriterProcess:
    """A spawned child that writes ``images`` (in shared memory) into ``directory`` each time
    :meth:`write` asks, as a writer process would; a context manager that ends the child."""

    def __init__(self, images: list[torch.Tensor], directory: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self._here, there = context.Pipe()
        self._child = context.Process(
            target=_process_writer, args=(there, images, str(directory)), daemon=True
        )

    def __enter__(self) -> _WriterProcess:
        self._child.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._here.send(False)
        self._child.join(30)

    def write(self) -> None:
        self._here.send(True)
        self._here.recv()


def _write_threads(images: list[torch.Tensor], directory: Path, nice: int = 0) -> None:
    """``images`` written by one new thread each (at ``nice``, when given), as the saver writes."""
    from nbckpt.engine._files import LocalSink, write_image
    from nbckpt.engine._workers import lower_priority

    def one(index: int) -> None:
        if nice:
            lower_priority(nice)  # this job's own new thread
        path = directory / f".thread-{index}.bin"
        write_image(LocalSink(str(path)), images[index].numpy().data.cast("B"), fsync=True)
        path.unlink()

    parallel([partial(one, i) for i in range(len(images))])


def _train_during(write: Callable[[], None]) -> tuple[Sample, float]:
    """Train on this (the main) thread while ``write`` runs in the background, as in a run: the
    sample of the whole, and the training steps per second done meanwhile."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    done = threading.Event()

    def write_then_stop() -> None:
        write()
        done.set()

    writer = threading.Thread(target=write_then_stop)
    sample: list[Sample] = []
    steps = 0
    with measured(sample):
        writer.start()
        while not done.is_set():
            a.mul_(0.5).add_(b @ b)  # a small torch step (GIL released inside), then Python
            sum(range(2000))
            steps += 1
        writer.join()
    return sample[-1], steps / sample[-1].wall_s


def bench_writer_process(directory: Path, nbytes: int, repeats: int) -> Table:
    """The same images written by 2 threads here or by a writer process (shared memory), while the
    main thread trains: the training work done during the write counts as much as the write."""
    from nbckpt import CheckpointConfig

    table = Table(f"threads or a process writing into {directory}", nbytes)
    images = [torch.randint(0, 255, (nbytes // 2,), dtype=torch.uint8).share_memory_() for _ in range(2)]

    def alone() -> None:  # the baseline: training for as long as a threaded write took
        threading.Event().wait(statistics.median(table.rows["2 writer threads"]["wall_s"]))

    nice = CheckpointConfig().writer_nice
    with _WriterProcess(images, directory) as process:
        writers: dict[str, Callable[[], None]] = {
            "2 writer threads": partial(_write_threads, images, directory),
            f"2 writer threads at nice {nice}": partial(_write_threads, images, directory, nice),
            "writer process": process.write,
        }
        for write in writers.values():
            _train_during(write)  # warm-up: the child has imported torch, pages are touched
        for _ in range(repeats):
            for name, write in writers.items():
                sample, rate = _train_during(write)
                table.add(name, sample, train_steps_per_s=rate)
            sample, rate = _train_during(alone)
            table.add("training alone (same time)", sample, train_steps_per_s=rate)
    return table


# -- putting it together --------------------------------------------------------------------------


def checks(tables: dict[str, Table]) -> dict[str, dict[str, Any]]:
    """The issue's targets, each a paired ratio with its interval and whether its median meets it."""
    out: dict[str, dict[str, Any]] = {}

    def check(
        name: str, table: str, a: str, b: str, metric: str, op: str, target: float, other_metric: str = ""
    ) -> None:
        if table not in tables:
            return
        r = tables[table].ratio(a, b, metric, other_metric)
        met = r["median"] <= target if op == "<=" else r["median"] >= target
        out[name] = {**r, "target": f"{op} {target}", "met": bool(met)}

    for where in ("shm", "disk"):
        check(
            f"persist ({where}) GB/s / raw 2-stream write",
            f"persist_{where}",
            "nbckpt async (save to commit)",
            "raw write (2 streams)",
            "persist_gb_per_s",
            ">=",
            0.8,
            other_metric="gb_per_s",
        )
    for where in ("disk", "shm"):
        check(
            f"CPU s/GB ({where}) / least pipeline",
            f"persist_{where}",
            "nbckpt async (save to commit)",
            "least pipeline (copy+xxh3+write)",
            "cpu_s_per_gb",
            "<=",
            1.3,
        )
    for where in ("disk", "shm"):
        check(
            f"restore ({where}) time / dcp.load",
            f"restore_{where}",
            "nbckpt restore (verified)",
            "dcp.load",
            "wall_s",
            "<=",
            1.1,
        )
        check(
            f"restore ({where}) time / verified-read floor",
            f"restore_{where}",
            "nbckpt restore (verified)",
            "verified-read floor (reused buffer, xxh3, copy in)",
            "wall_s",
            "<=",
            1.2,
        )
        check(
            f"restore ({where}) GB/s / raw read",
            f"restore_{where}",
            "nbckpt restore (verified)",
            "raw read (files into new memory)",
            "gb_per_s",
            ">=",
            0.7,
        )
    check(
        "12 MB sync save / torch.save + fsync",
        "small",
        "nbckpt sync save",
        "torch.save + fsync",
        "wall_s",
        "<=",
        1.0,
    )
    check(
        "12 MB sync save / torch.save + fsync (no CRC32)",
        "small",
        "nbckpt sync save",
        "torch.save + fsync (no CRC32)",
        "wall_s",
        "<=",
        1.0,
    )
    check(
        "10k tensors persist / torch.save + fsync",
        "many",
        "nbckpt sync save",
        "torch.save + fsync",
        "wall_s",
        "<=",
        1.2,
    )
    check(
        "10k tensors persist / torch.save + fsync (no CRC32)",
        "many",
        "nbckpt sync save",
        "torch.save + fsync (no CRC32)",
        "wall_s",
        "<=",
        1.2,
    )
    check(
        "10k tensors restore / torch.load",
        "many_restore",
        "nbckpt restore (verified)",
        "torch.load + copy in",
        "wall_s",
        "<=",
        1.2,
    )
    check("stall / dcp-async-stager stall", "stall", "nbckpt-async", "dcp-async-stager", "wall_s", "<=", 0.7)
    check(
        "stall (GPT state) / dcp-async-stager stall",
        "stall_model",
        "nbckpt-async",
        "dcp-async-stager",
        "wall_s",
        "<=",
        0.7,
    )
    if "copy_floor" in tables and "stall" in tables:  # rows of two tables: ratio of the medians
        stall = statistics.median(tables["stall"].rows["nbckpt-async"]["wall_s"])
        floor = statistics.median(tables["copy_floor"].rows["copy into reused host memory"]["wall_s"])
        out["stall / copy floor (medians)"] = {
            "median": stall / floor,
            "lo": math.nan,
            "hi": math.nan,
            "target": "<= 1.3",
            "met": stall / floor <= 1.3,
        }
    check("stall / dcp-async stall", "stall", "nbckpt-async", "dcp-async", "wall_s", "<=", 0.7)
    return out


def bench_copy_floor(state: dict[str, torch.Tensor], repeats: int) -> Table:
    """The least a stall can be: the state copied into preallocated (pinned on CUDA) host memory."""
    table = Table("copy floor", tensor_bytes(state))
    pin = torch.cuda.is_available()
    target = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in state.items()}
    for _ in range(repeats + 1):
        sample: list[Sample] = []
        with measured(sample):
            copy_in_halves(target, state, pin)
        table.add("copy into reused host memory", sample[-1])
    return table


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = int(args.size_mb * MIB)
    disk = Path(args.dir).resolve()
    shm = Path(args.shm) / f"nbckpt-bench-{os.getpid()}"
    for path in (disk, shm):
        path.mkdir(parents=True, exist_ok=True)
    state = make_state(size, 16, device=args.device)
    small = make_state(12 * 10**6, 200)
    many = make_state(int(args.many_mb * MIB), args.many_tensors, shapes=100)
    tables: dict[str, Table] = {}
    steps: list[tuple[str, Callable[[], Table]]] = [
        ("copy_floor", lambda: bench_copy_floor(state, args.repeats)),
        ("persist_shm", lambda: bench_persist(shm, state, args.repeats)),
        ("persist_disk", lambda: bench_persist(disk, state, args.repeats)),
        ("restore_shm", lambda: bench_restore(shm, state, args.repeats, cold=False)),
        ("restore_disk", lambda: bench_restore(disk, state, args.repeats, cold=True)),
        (
            "small",
            lambda: bench_sync_save(disk, small, args.repeats * 4, "sync save of 12 MB in 200 tensors"),
        ),
        (
            "many",
            lambda: bench_sync_save(
                disk, many, args.repeats, f"sync save of {args.many_mb:g} MiB in {args.many_tensors} tensors"
            ),
        ),
        ("many_restore", lambda: bench_many_restore(disk, many, args.repeats)),
        ("stall", lambda: bench_stall(disk, state, args.repeats)),
        (
            "stall_model",
            lambda: bench_stall(
                disk,
                model_state(args.model, args.device),
                args.repeats * 2,
                f"stall of a GPT-{args.model} state (model + AdamW)",
            ),
        ),
        ("writer_process", lambda: bench_writer_process(disk, size, args.repeats)),
    ]
    errors: dict[str, str] = {}
    try:
        for key, step in steps:
            if args.only and key not in args.only.split(","):
                continue
            print(f"measuring {key} ...", file=sys.stderr, flush=True)
            try:
                tables[key] = step()
            except Exception as exc:  # one failing section must not lose the others' numbers
                if not args.keep_going:
                    raise
                errors[key] = f"{type(exc).__name__}: {exc}"
                print(f"{key} failed: {errors[key]}", file=sys.stderr, flush=True)
                continue
            tables[key].print()
    finally:
        clean(shm)
    meta = {
        "benchmark": "engine/2",
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "errors": errors,
        "repeats": args.repeats,
        "size_bytes": size,
        **machine(),
    }
    return summarise(meta, tables)


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran (the load average says how busy the machine was)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "unix_time": time.time(),
    }


def summarise(meta: dict[str, Any], tables: dict[str, Table]) -> dict[str, Any]:
    """The result to write: ``meta``, every table and the checks, which are printed."""
    result = {
        **meta,
        "tables": {key: table.to_dict() for key, table in tables.items()},
        "checks": checks(tables),
    }
    print("\nchecks (paired ratio per repeat: median [95 % interval of the geometric mean], target)")
    for name, c in result["checks"].items():
        print(
            f"  {name:52} {c['median']:7.3f} [{c['lo']:7.3f},{c['hi']:7.3f}]  {c['target']:>7}  "
            f"{'met' if c['met'] else 'NOT MET'}"
        )
    return result


def reprint(path: str) -> dict[str, Any]:
    """Print a saved result's tables and checks again, the checks recomputed from its values."""
    saved = json.loads(Path(path).read_text())
    tables = {}
    for key, data in saved.pop("tables").items():
        table = Table(data["title"], data["bytes"])
        table.rows = {name: {m: s["values"] for m, s in row.items()} for name, row in data["rows"].items()}
        table.print()
        tables[key] = table
    saved.pop("checks", None)
    return summarise(saved, tables)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="state for persist, restore, stall (MiB)")
    parser.add_argument("--many-mb", type=float, default=256, help="the many-tensor state (MiB)")
    parser.add_argument("--many-tensors", type=int, default=10_000)
    parser.add_argument(
        "--model", default="small", help="GPT preset whose state the stall_model section saves"
    )
    parser.add_argument("--dir", default="data/checkpoints/bench-engine", help="local-disk directory")
    parser.add_argument("--shm", default="/dev/shm", help="RAM-backed directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="comma-separated sections (default: all)")
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    parser.add_argument("--keep-going", action="store_true", help="record a failing section and go on")
    parser.add_argument("--quick", action="store_true", help="small sizes and 2 repeats (checks the script)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reprint", metavar="JSON", help="measure nothing: print a saved result again")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_mb, args.many_mb, args.many_tensors, args.repeats, args.model = 64, 16, 1000, 2, "tiny"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = reprint(args.reprint) if args.reprint else run(args)
    write_json(args.json, result)
    return 0


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """``result`` to ``path`` (nothing when no path was asked for)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
