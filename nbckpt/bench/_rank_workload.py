"""The user's workload as one rank of a bench on many ranks holds it (:class:`RankWorkload`), and
the digests of what a rank saved (:func:`state_digests`), for a restore to be checked against."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .._errors import ConfigError
from ._strategy import plain_state
from ._workloads import GPTWorkload, Workload

__all__ = ["RankWorkload", "state_digests"]

#: Elements of the all-reduce that stands for a data-parallel job's gradient sync where the
#: bench's state has no gradients of its own (a synthetic state per rank): small, so that it
#: costs the collective's latency, which keeps the ranks in step as the real one does.
SYNC_ELEMENTS = 1024


def _shard(workload: GPTWorkload) -> None:
    """FSDP2 over the ranks: each block, then the whole model (each rank keeps 1/N of every
    parameter); the optimizer made again over the sharded parameters, and one step so that its
    state has its size, as :meth:`GPTWorkload.build` does."""
    model = workload.model
    if model is None:
        raise ConfigError(f"workload {workload.name} is not built yet; call build() first")
    for block in model.blocks.layers:
        fully_shard(block)
    fully_shard(model)
    workload.make_optimizer()
    workload.train_step()
    workload.step = 0


def _average_gradients(workload: RankWorkload) -> None:
    """DDP's gradient all-reduce (one bucket): every rank's gradients, averaged."""
    inner = workload.inner
    assert isinstance(inner, GPTWorkload)
    grads = [p.grad for p in inner.trained() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= workload.world_size
    for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        grad.copy_(part.view_as(grad))


def state_digests(state: Mapping[str, Any]) -> dict[str, str]:
    """SHA-256 of every tensor this rank holds of ``state`` (modules and optimizers as their
    state dicts; a DTensor as its local shard), by its dotted key: what a restore into the same
    ranks must give back bit for bit."""
    digests: dict[str, str] = {}

    def visit(value: Any, key: str) -> None:
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            digests[key] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        elif isinstance(value, Mapping):
            for name, item in value.items():
                visit(item, f"{key}.{name}" if key else str(name))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                visit(item, f"{key}.{index}")

    visit(plain_state(state), "")
    return digests


class RankWorkload(Workload):
    """The user's workload as one rank holds it: a GPT replicated as under DDP (every rank the
    same weights, built from the same seed) or, ``sharded``, under FSDP2 (each rank 1/N of
    them); any other state as this rank's own, under keys of its own (``model/rank<r>/...``:
    replicated keys would be written once and checked to agree)."""

    def __init__(self, inner: Workload, rank: int, world_size: int, *, sharded: bool = False) -> None:
        if sharded and not isinstance(inner, GPTWorkload):
            raise ConfigError(f"--fsdp shards a GPT preset, not {inner.name}; drop --size-mb")
        self.inner = inner
        super().__init__()
        self.name, self.nbytes, self.params = inner.name, inner.nbytes, inner.params
        self.device = inner.device
        self.rank, self.world_size = rank, world_size
        self.sharded = sharded
        self.replicated = isinstance(inner, GPTWorkload) and not sharded

    @property  # type: ignore[override]  # the runner sets the inner workload's step
    def step(self) -> int:
        return self.inner.step

    @step.setter
    def step(self, value: int) -> None:
        self.inner.step = value

    @property
    def share_bytes(self) -> int:
        """What this rank writes of a checkpoint: its own state, or its part of a replicated one
        (nbckpt and DCP spread a replicated state's tensors over the ranks)."""
        spread = self.replicated or self.sharded
        return math.ceil(self.nbytes / self.world_size) if spread else self.nbytes

    def build(self) -> None:
        if self.built:
            return
        self.inner.build()
        if self.sharded and isinstance(self.inner, GPTWorkload):
            _shard(self.inner)
        self.built = True

    def train_step(self, before_update: Any = None) -> None:
        self.inner.train_step(lambda: self._synchronise(before_update))

    def _synchronise(self, before_update: Any) -> None:
        """Data parallelism's gradient sync after backward, as the job has one, then
        ``before_update``: DDP all-reduces (averages) the replicated GPT's gradients; each rank's
        own state stands for a data-parallel job's with an all-reduce of :data:`SYNC_ELEMENTS`.
        On the training's group, for every strategy alike (the ``none`` baseline too); like the
        real one it keeps the ranks in step. FSDP2 reduce-scatters in backward already."""
        if not self.sharded and self.world_size > 1 and dist.is_available() and dist.is_initialized():
            if self.replicated:
                _average_gradients(self)
            else:
                dist.all_reduce(torch.ones(SYNC_ELEMENTS, device=self.device))
        if before_update is not None:
            before_update()

    def state(self) -> dict[str, Any]:
        state = self.inner.state()
        if self.replicated or self.sharded:
            return state
        return {**state, "model": {f"rank{self.rank}": state["model"]}}

    def describe(self) -> str:
        ranks = "1 rank" if self.world_size == 1 else f"{self.world_size} ranks"
        how = (
            "replicated (DDP-like) on"
            if self.replicated
            else "sharded with FSDP2 over"
            if self.sharded
            else "its own state on" + ("" if self.world_size == 1 else " each of")
        )
        return f"{self.inner.describe()}; {how} {ranks}"
