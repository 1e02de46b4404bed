"""Incremental saves (``incremental=True``): a data file of this rank whose tensors all hold the
bytes they held at the previous save is neither staged nor written; the new step gets that step's
file under its own name (:meth:`Store.share`: a hard link, a server-side copy), so every step stays
a whole checkpoint that outlives the deletion of any other.

Whether a tensor changed: torch's version counter only ever says *changed* (an in-place op autograd
saw). It never proves *unchanged*: writes through ``.data`` or NumPy, a tensor replaced by another
at the same address, and torch 2.13's fused AdamW on CPU all leave it as it was. So every tensor of
a file in which it shows no tensor as changed is fingerprinted where it lives (xxh3 of its bytes on
the CPU; on a GPU two position-weighted sums computed on the device, so an unchanged tensor is never
copied to the host), and the file is shared only when each fingerprint equals the one taken when
the earlier step's bytes were staged. The fingerprint reads every byte, inside the save's stall: it
is bound by the memory's read bandwidth (docs/benchmarks.md has the figures).

Which tensors share files: those expected not to change (frozen parameters of modules, and tensors
whose version counter stood still since the last save, but never a module's trained parameters or
an optimizer's state, nor a tensor found changed at two saves running) are laid out in files of
their own (``RankPlan.cold``), so that one changing tensor does not make a frozen base be written.

Which step they are shared from: the last one this rank committed, unless it is gone. Deletes are
told to one rank only (retention runs on rank 0) or to none (another process), so in each save's
exchange every rank says which steps it knows are gone (:meth:`Increments.gone`: told deleted, or
the step it would share from no longer committed), and no rank shares from any of them
(:meth:`Increments.agree`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import xxhash

from ._files import FileResult
from ._format import FileLayout
from ._state import Flattened
from ._torch_compat import version_of
from ._workers import balance

__all__ = ["NOTHING_SHARED", "Increments", "Sharing", "fingerprints"]

#: What a fingerprint is: the function's name, then its values.
Fingerprint = tuple[Any, ...]
#: Runs jobs in parallel, returning their results in order (the stage threads: xxhash releases
#: the GIL, so two threads hash a frozen base in about half the time).
Parallel = Callable[[Sequence[Callable[[], Any]]], list[Any]]
#: Elements of a device tensor summed at a time: bounds the fingerprint's temporary memory (32 MiB).
_CHUNK = 1 << 22
#: Odd 64-bit multipliers (Fibonacci hashing's, as signed int64): every element gets a different
#: odd weight, so a change of any one element always changes the sum.
_WEIGHTS = (0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64))


@dataclass(frozen=True)
class Sharing:
    """One save's decision on one rank: its files taken whole from the committed step at
    ``base`` (each with what writing it had given), and the fingerprints of the state it saw."""

    base: str | None = None
    files: Mapping[str, FileResult] = field(default_factory=dict)
    prints: Mapping[str, Fingerprint] = field(default_factory=dict)
    skip: frozenset[str] = frozenset()
    """Keys whose files are shared: they are not staged."""


NOTHING_SHARED = Sharing()


@dataclass
class _Base:
    """The last committed save: where it is, this rank's files in it, the fingerprints of its bytes."""

    location: str
    step: int
    files: dict[str, tuple[FileLayout, FileResult]]
    prints: Mapping[str, Fingerprint]


class Increments:
    """What one rank remembers between saves to decide what the next one need not write."""

    def __init__(self, parallel: Parallel, threads: int) -> None:
        self._parallel, self._threads = parallel, threads
        self._base: _Base | None = None
        self._versions: dict[str, tuple[Any, int | None]] = {}
        self._changed_last: set[str] = set()  # found changed at the previous save
        self._changing: set[str] = set()  # found changed at two saves running: never cold again
        self._cold: frozenset[str] = frozenset()  # what the last plan laid out apart
        # What :meth:`cold` saw of the state being saved, for :meth:`decide`: the flattened state
        # and each tensor's identity and version.
        self._taken: tuple[Flattened | None, dict[str, Any]] = (None, {})
        self._told = threading.Lock()  # ``_gone``: added to by retention's thread
        self._gone: set[int] = set()  # told deleted here, not yet told to the other ranks
        self._refused: frozenset[int] = frozenset()  # a rank said gone: the next save shares none

    def cold(self, flat: Flattened) -> frozenset[str]:
        """The keys to lay out apart from the rest (``RankPlan.cold``)."""
        now = {key: _seen(tensor) for key, tensor in flat.tensors.items()}
        self._taken = (flat, now)
        steady = {key for key, seen in now.items() if self._steady(key, seen)}
        self._cold = frozenset((flat.frozen | (steady - flat.trained)) - self._changing)
        return self._cold

    def decide(self, flat: Flattened, files: tuple[FileLayout, ...], step: int, *, resave: bool) -> Sharing:
        """Fingerprint what may not have changed and pick the files of ``files`` (this rank's)
        whose every tensor is as in the last committed save; runs where the state is read, after
        :meth:`cold` saw the same ``flat``. ``resave``: whether a save of the step the last one
        committed keeps its files until the new one is in place (an object store deletes them
        first: nothing is shared then)."""
        if self._taken[0] is not flat:  # planned elsewhere (not in a save): see it now
            self.cold(flat)
        now = self._taken[1]
        keys = [item.key for layout in files for item in layout.items]
        cold = self._cold
        # Only files whose every tensor may be unchanged are read: one tensor known to have
        # changed (its version counter moved) makes its file be written, whatever the others hold.
        maybe = [[item.key for item in layout.items] for layout in files]
        prints = fingerprints(
            {
                k: flat.tensors[k]
                for items in maybe
                if all(k in cold or self._steady(k, now[k]) for k in items)
                for k in items
            },
            self._parallel,
            self._threads,
        )
        self._versions = {key: now[key] for key in keys}
        self._taken = (None, {})  # holds no tensor of the caller's past the save
        base, refused, self._refused = self._base, self._refused, frozenset()
        if base is not None and base.step in refused:  # gone, for some rank: it writes every file
            base = self._base = None
        if base is None or (base.step == step and not resave):
            return Sharing(prints=prints)
        changed = {key for key, value in prints.items() if base.prints.get(key, value) != value}
        self._changing |= changed & self._changed_last
        self._changed_last = changed
        shared: dict[str, FileResult] = {}
        skip: set[str] = set()
        for layout in files:
            known = base.files.get(layout.name)
            items = [item.key for item in layout.items]
            if (
                known is not None
                and known[0] == layout
                and all(key in prints and base.prints.get(key) == prints[key] for key in items)
            ):
                shared[layout.name] = known[1]
                skip.update(items)
        return Sharing(base.location if shared else None, shared, prints, frozenset(skip))

    def committed(
        self,
        location: str,
        step: int,
        files: tuple[FileLayout, ...],
        results: Mapping[str, FileResult],
        sharing: Sharing,
    ) -> None:
        """The save ``sharing`` was decided for committed ``step`` at ``location``: the next one
        compares with it. ``results``: what this rank's files are (written or shared)."""
        layouts = {layout.name: (layout, results[layout.name]) for layout in files}
        self._base = _Base(location, step, layouts, sharing.prints)

    def forget(self) -> None:
        """The next save shares nothing (a save failed, steps were set aside): it writes every file."""
        self._base = None

    def deleted(self, step: int) -> None:
        """Committed ``step`` was deleted: if the next save would share its files, it writes every
        file instead (they are gone); the other ranks are told at that save (:meth:`gone`)."""
        with self._told:
            self._gone.add(step)
        if self._base is not None and self._base.step == step:
            self._base = None

    def gone(self, committed_at: Callable[[int], str | None]) -> frozenset[int]:
        """What this rank says in a save's exchange (``Saver._plan``): the steps it was told were
        deleted since it last said, and the one it would share from if no longer committed
        (``committed_at``: the store's look-up; deleted by another process, or on one rank)."""
        with self._told:
            gone = set(self._gone)
        base = self._base
        if base is not None and committed_at(base.step) is None:
            gone.add(base.step)
        return frozenset(gone)

    def agree(self, said: Iterable[frozenset[int]]) -> None:
        """Every rank's :meth:`gone` at this save: the next decision shares from none of those
        steps, on every rank alike; what this rank said is told."""
        gone = frozenset[int]().union(*said)
        with self._told:
            self._gone -= gone
        self._refused |= gone

    def _steady(self, key: str, now: tuple[Any, int | None]) -> bool:
        """Whether the version counter says nothing against ``key``'s tensor (``now``: what
        :func:`_seen` says of it) being as at the last save."""
        seen = self._versions.get(key)
        return seen is not None and seen[1] is not None and seen == now


def _seen(tensor: torch.Tensor) -> tuple[Any, int | None]:
    """What identifies a tensor's bytes and how often they were written in place."""
    where = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
    return where, version_of(tensor)


def fingerprints(
    tensors: Mapping[str, torch.Tensor], parallel: Parallel | None = None, threads: int = 1
) -> dict[str, Fingerprint]:
    """A fingerprint of each tensor's bytes, computed where it lives (CPU tensors in ``threads``
    shards of about equal bytes, run by ``parallel``)."""
    prints: dict[str, Fingerprint] = {}
    on_cpu = [key for key, tensor in tensors.items() if tensor.device.type == "cpu"]
    on_device = {key: tensor for key, tensor in tensors.items() if tensor.device.type != "cpu"}
    shards = balance(on_cpu, threads, lambda key: tensors[key].nbytes)
    jobs = [partial(_hash_all, {key: tensors[key] for key in shard}) for shard in shards]
    for part in parallel(jobs) if parallel is not None else [job() for job in jobs]:
        prints.update(part)
    if on_device:
        sums = torch.stack([device_print(tensor) for tensor in on_device.values()]).tolist()
        prints.update({key: ("sum2", *pair) for key, pair in zip(on_device, sums, strict=True)})
    return prints


def _hash_all(tensors: Mapping[str, torch.Tensor]) -> dict[str, Fingerprint]:
    return {key: ("xxh3", xxhash.xxh3_64_intdigest(_raw(t).numpy().data)) for key, t in tensors.items()}


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (a copy only where it is not contiguous)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def device_print(tensor: torch.Tensor) -> torch.Tensor:
    """Two sums of the tensor's 32-bit words (bytes, where its size is not a multiple of 4), each
    word times a different odd weight, modulo 2**64: a (2,) int64 tensor on the tensor's device,
    computed there in chunks (no host copy, bounded memory; integer sums are exact in any order)."""
    raw = _raw(tensor)
    if raw.storage_offset() % 4:  # a view 2 bytes into its storage: copied to be read as words
        raw = raw.clone()
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    total = torch.zeros(2, dtype=torch.int64, device=raw.device)
    weights = torch.tensor(_WEIGHTS, dtype=torch.int64, device=raw.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start : start + _CHUNK].to(torch.int64)
        index = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=raw.device)
        total += ((index[:, None] * weights) | 1).mul_(part[:, None]).sum(0)
    return total
