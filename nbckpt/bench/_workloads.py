"""Training workloads to checkpoint: a GPT-style decoder with AdamW, and a synthetic state of N bytes.

Every workload states its size before it allocates anything::

    >>> w = gpt("small")
    >>> print(w.describe())      # parameters and checkpoint size, nothing allocated yet
    >>> w.build()                # ConfigError if it will not fit in free memory
    >>> w.train_step(); state = w.state()   # {"model": ..., "optim": ..., "step": ...}

Batches are random tokens from a seeded generator: step ``i`` of a workload with seed ``s``
always sees the same batch, so every strategy of a comparison does the same work.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.nn.functional as F
from torch import nn

from .._errors import ConfigError
from .._util import MIB, check_count, format_bytes

__all__ = [
    "DEFAULT_ADAPTER_RANK",
    "PRESETS",
    "Adapted",
    "GPTConfig",
    "GPTWorkload",
    "SyntheticWorkload",
    "Workload",
    "gpt",
    "make_workload",
    "synthetic",
]

# AdamW keeps two fp32 moments per parameter next to the fp32 weights.
_CHECKPOINT_BYTES_PER_PARAM = 3 * 4
# Training also holds fp32 gradients; checkpoint staging needs one more copy of the checkpoint.
_TRAIN_BYTES_PER_PARAM = 4 * 4
# What the process itself needs besides the state (interpreter, torch, allocator slack).
HEADROOM_BYTES = 512 * MIB


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-style decoder and of its training batches."""

    n_layer: int
    d_model: int
    n_head: int
    vocab: int
    seq_len: int
    batch_size: int
    lr: float = 1e-3
    weight_decay: float = 0.1

    def params(self) -> int:
        """Parameter count (the LM head shares the token embedding)."""
        d = self.d_model
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return self.vocab * d + self.seq_len * d + self.n_layer * block + 2 * d

    def param_tensors(self) -> int:
        return 2 + self.n_layer * 12 + 2

    def checkpoint_bytes(self) -> int:
        """Model + AdamW state (two moments and a step counter per tensor), as saved."""
        return self.params() * _CHECKPOINT_BYTES_PER_PARAM + 4 * self.param_tensors()

    def adapter_params(self, rank: int) -> int:
        """Parameters of rank-``rank`` adapters on every block's two feed-forward layers
        (``d -> 4d`` and ``4d -> d``: ``rank * 5d`` each)."""
        return self.n_layer * 2 * rank * 5 * self.d_model

    def activation_bytes(self, element_size: int = 4) -> int:
        """A generous estimate of activations kept for backward, plus logits and their gradient."""
        tokens = self.batch_size * self.seq_len
        per_layer = tokens * self.d_model * 34 + 5 * self.n_head * self.seq_len * tokens
        return self.n_layer * per_layer * element_size + 3 * tokens * self.vocab * 4


#: Size presets, named by their approximate parameter count.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_layer=4, d_model=128, n_head=4, vocab=2048, seq_len=64, batch_size=8),
    "small": GPTConfig(n_layer=6, d_model=512, n_head=8, vocab=12288, seq_len=64, batch_size=4),
    "base": GPTConfig(n_layer=12, d_model=768, n_head=12, vocab=50304, seq_len=128, batch_size=4),
    "350m": GPTConfig(n_layer=24, d_model=1024, n_head=16, vocab=50304, seq_len=128, batch_size=4),
    "1b": GPTConfig(n_layer=18, d_model=2048, n_head=16, vocab=50304, seq_len=128, batch_size=4),
    "3b": GPTConfig(n_layer=36, d_model=2560, n_head=20, vocab=50304, seq_len=128, batch_size=2),
}


class GPT(nn.Module):
    """A pre-LayerNorm decoder-only transformer (torch's own layers, causally masked) with tied
    input and output embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        layer = nn.TransformerEncoderLayer(
            cfg.d_model,
            cfg.n_head,
            4 * cfg.d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, cfg.n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # GPT-2's initial scale keeps the tied logits (and the first loss) sensible.
        for embedding in (self.tok, self.pos):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(length, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=idx.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        logits: torch.Tensor = self.ln_f(x) @ self.tok.weight.T
        return logits


#: The adapters' rank of a fine-tuning workload unless told otherwise (a common LoRA rank).
DEFAULT_ADAPTER_RANK = 8


class Adapted(nn.Module):
    """A frozen linear layer plus a trained low-rank update (LoRA: ``x @ A.T @ B.T``, ``B`` zero
    at first so the model starts as the frozen one)."""

    def __init__(self, frozen: nn.Linear, rank: int) -> None:
        super().__init__()
        self.frozen = frozen.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, frozen.in_features, device=frozen.weight.device) * 0.01)
        self.b = nn.Parameter(torch.zeros(frozen.out_features, rank, device=frozen.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.frozen(x)
        return out + x @ self.a.T @ self.b.T


def add_adapters(model: GPT, rank: int) -> None:
    """Freeze ``model`` and give each block's two feed-forward layers rank-``rank`` adapters."""
    model.requires_grad_(False)
    for layer in model.blocks.layers:
        layer.linear1 = Adapted(layer.linear1, rank)
        layer.linear2 = Adapted(layer.linear2, rank)


def _check_device(device: str) -> str:
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda', not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for but torch sees no CUDA device")
    return device


def _require_memory(name: str, host_bytes: int, device_bytes: int, *, device: str) -> None:
    """Raise ConfigError when the workload will not fit in the memory free right now."""
    available = psutil.virtual_memory().available
    if host_bytes + HEADROOM_BYTES > available:
        raise ConfigError(
            f"workload {name} needs about {format_bytes(host_bytes + HEADROOM_BYTES)} of host "
            f"memory but only {format_bytes(available)} is free; pick a smaller preset or size"
        )
    if device == "cuda" and device_bytes:
        free, _total = torch.cuda.mem_get_info()
        if device_bytes > free:
            raise ConfigError(
                f"workload {name} needs about {format_bytes(device_bytes)} of CUDA memory "
                f"but only {format_bytes(free)} is free; pick a smaller preset or size"
            )


class Workload(ABC):
    """Something that trains step by step and has a state worth checkpointing."""

    name: str
    nbytes: int
    """Checkpoint size in bytes (model + optimizer state)."""
    params: int
    device: str

    def __init__(self) -> None:
        self.step = 0
        self.built = False

    @property
    def share_bytes(self) -> int:
        """What this process writes of a checkpoint: all of it (on many ranks, its part)."""
        return self.nbytes

    @abstractmethod
    def build(self) -> None:
        """Allocate everything; ConfigError when it will not fit in free host or device memory."""

    @abstractmethod
    def train_step(self, before_update: Callable[[], None] | None = None) -> None:
        """One training step. ``before_update`` runs after backward, right before the state
        is mutated (where an overlapped checkpoint must have finished copying)."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """What a checkpoint holds: ``{"model", "optim", "step"}``."""

    @abstractmethod
    def describe(self) -> str:
        """One line: name, parameters, checkpoint size, device."""

    def _require_built(self) -> None:
        if not self.built:
            raise ConfigError(f"workload {self.name} is not built yet; call build() first")


class GPTWorkload(Workload):
    """A GPT decoder trained with AdamW on deterministic synthetic tokens; with ``adapter_rank``
    a fine-tune: the GPT frozen and only low-rank adapters (:class:`Adapted`) trained."""

    def __init__(
        self,
        name: str,
        config: GPTConfig,
        device: str = "cpu",
        *,
        seed: int = 0,
        adapter_rank: int | None = None,
    ) -> None:
        super().__init__()
        if adapter_rank is not None:
            check_count(adapter_rank, "adapter_rank")
        self.name = name if adapter_rank is None else f"{name}-finetune"
        self.config = config
        self.device = _check_device(device)
        self.seed = seed
        self.adapter_rank = adapter_rank
        self.trained_params = config.params() if adapter_rank is None else config.adapter_params(adapter_rank)
        self.params = config.params() + (0 if adapter_rank is None else self.trained_params)
        # Weights of every parameter; AdamW's two moments and step counter of the trained ones.
        trained_tensors = config.param_tensors() if adapter_rank is None else 4 * config.n_layer
        self.nbytes = 4 * self.params + 8 * self.trained_params + 4 * trained_tensors
        self.model: GPT | None = None
        self.optim: torch.optim.AdamW | None = None

    def describe(self) -> str:
        trained = (
            ""
            if self.adapter_rank is None
            else f", frozen with rank-{self.adapter_rank} adapters trained "
            f"({self.trained_params / 1e6:.2f}M parameters)"
        )
        return (
            f"gpt-{self.name}: {self.params / 1e6:.1f}M parameters{trained}, checkpoint "
            f"{format_bytes(self.nbytes)} (model + AdamW), {self.config.n_layer} layers x "
            f"{self.config.d_model}, batch {self.config.batch_size}x{self.config.seq_len} on "
            f"{self.device}"
        )

    def trained(self) -> list[nn.Parameter]:
        """The parameters training updates (the adapters alone in a fine-tune)."""
        self._require_built()
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def make_optimizer(self) -> None:
        """AdamW over the trained parameters (again after they are replaced, as FSDP2 does)."""
        self.optim = torch.optim.AdamW(
            self.trained(), lr=self.config.lr, weight_decay=self.config.weight_decay
        )

    def build(self) -> None:
        """Allocate model and AdamW state; one step runs so checkpoints have their full size."""
        if self.built:
            return
        cuda = self.device == "cuda"
        # Training plus one staged checkpoint copy on the host.
        training = self.params * _TRAIN_BYTES_PER_PARAM + self.config.activation_bytes(2 if cuda else 4)
        host, device = (self.nbytes, training) if cuda else (training + self.nbytes, 0)
        _require_memory(f"gpt-{self.name}", host, device, device=self.device)
        torch.manual_seed(self.seed)
        self.model = GPT(self.config).to(self.device)
        if self.adapter_rank is not None:
            add_adapters(self.model, self.adapter_rank)
        self.built = True
        self.make_optimizer()
        self.train_step()
        self.step = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of ``step``: a function of the seed and the step only."""
        cfg = self.config
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.randint(cfg.vocab, (cfg.batch_size, cfg.seq_len + 1), generator=gen)
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def train_step(self, before_update: Callable[[], None] | None = None) -> None:
        self._require_built()
        assert self.model is not None and self.optim is not None
        inputs, targets = self.batch(self.step)
        cuda = self.device == "cuda"
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext():
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        if before_update is not None:
            before_update()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.step += 1

    def state(self) -> dict[str, Any]:
        self._require_built()
        return {"model": self.model, "optim": self.optim, "step": self.step}


class SyntheticWorkload(Workload):
    """Exactly ``nbytes`` of float32 tensors and a compute step of about ``compute_ms``.

    The compute step is a loop of matrix multiplies (real torch work that releases and
    takes the GIL like a training step does), calibrated once in :meth:`build`; each step
    then bumps one element per tensor so that consecutive checkpoints differ.

    ``idle_compute``: a stand-in for compute on an accelerator. The step's thread sleeps
    ``compute_ms`` instead of multiplying matrices, so the host's cores are free through the
    step's compute, as a GPU node's CPU is while its kernels run, and the checkpoint's
    background copy and writes may use them. Without it the compute takes the host's cores, as
    training on CPU does.
    """

    _CHUNK = 64 * MIB
    _MATMUL = 256

    def __init__(
        self, nbytes: int, compute_ms: float = 5.0, device: str = "cpu", *, idle_compute: bool = False
    ) -> None:
        super().__init__()
        check_count(nbytes, "synthetic state size in bytes")
        if not math.isfinite(compute_ms) or compute_ms < 0:
            raise ConfigError(f"compute_ms must be a non-negative number, not {compute_ms!r}")
        if idle_compute and compute_ms == 0:
            raise ConfigError(
                "idle_compute leaves the host idle for compute_ms per step; give compute_ms > 0"
            )
        self.device = _check_device(device)
        self.nbytes = nbytes
        self.params = nbytes // 4
        self.compute_ms = compute_ms
        self.idle_compute = idle_compute
        self.name = f"synthetic-{nbytes / MIB:g}MiB"
        self.tensors: dict[str, torch.Tensor] = {}
        self._matmuls = 0
        self._lhs: torch.Tensor | None = None
        self._rhs: torch.Tensor | None = None

    def describe(self) -> str:
        compute = (
            f"{self.compute_ms:g} ms per step of device compute, the host idle through it"
            if self.idle_compute
            else f"about {self.compute_ms:g} ms of compute per step on {self.device}"
        )
        return f"{self.name}: {format_bytes(self.nbytes)} of tensors, {compute}"

    def build(self) -> None:
        if self.built:
            return
        on_host = self.nbytes if self.device == "cuda" else 2 * self.nbytes
        _require_memory(self.name, on_host, self.nbytes, device=self.device)
        floats, tail = divmod(self.nbytes, 4)
        chunk = self._CHUNK // 4
        for i, start in enumerate(range(0, floats, chunk)):
            self.tensors[f"t{i:04d}"] = torch.rand(min(chunk, floats - start), device=self.device)
        if tail:
            self.tensors["tail"] = torch.zeros(tail, dtype=torch.uint8, device=self.device)
        self._lhs = torch.rand(self._MATMUL, self._MATMUL, device=self.device)
        self._rhs = torch.rand(self._MATMUL, self._MATMUL, device=self.device)
        self._matmuls = self._calibrate()
        self.built = True

    def _calibrate(self) -> int:
        """How many matmuls take about ``compute_ms`` here (fixed from then on)."""
        if self.compute_ms == 0 or self.idle_compute:
            return 0
        trial = 20
        self._matmul_loop(trial)  # warm-up
        begin = time.perf_counter()
        self._matmul_loop(trial)
        per_matmul_ms = (time.perf_counter() - begin) * 1e3 / trial
        return max(1, round(self.compute_ms / max(per_matmul_ms, 1e-6)))

    def _matmul_loop(self, count: int) -> None:
        assert self._lhs is not None and self._rhs is not None
        x = self._lhs
        for _ in range(count):
            x = torch.tanh(x @ self._rhs)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def train_step(self, before_update: Callable[[], None] | None = None) -> None:
        self._require_built()
        if self.idle_compute:
            time.sleep(self.compute_ms / 1e3)  # the device's kernels: nothing runs on the host
        else:
            self._matmul_loop(self._matmuls)
        if before_update is not None:
            before_update()
        self.step += 1
        for tensor in self.tensors.values():
            tensor[0] += 1

    def state(self) -> dict[str, Any]:
        self._require_built()
        return {"model": dict(self.tensors), "optim": {}, "step": self.step}


def gpt(
    preset: str | GPTConfig = "tiny",
    device: str = "cpu",
    seed: int = 0,
    *,
    finetune: bool = False,
    adapter_rank: int = DEFAULT_ADAPTER_RANK,
) -> GPTWorkload:
    """A GPT workload from a preset name (see :data:`PRESETS`) or a :class:`GPTConfig`;
    ``finetune``: its base frozen, rank-``adapter_rank`` adapters trained."""
    rank = adapter_rank if finetune else None
    if isinstance(preset, GPTConfig):
        return GPTWorkload("custom", preset, device, seed=seed, adapter_rank=rank)
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    return GPTWorkload(preset, PRESETS[preset], device, seed=seed, adapter_rank=rank)


def synthetic(
    size_mb: float, compute_ms: float = 5.0, device: str = "cpu", *, idle_compute: bool = False
) -> SyntheticWorkload:
    """A state of exactly ``size_mb`` MiB (rounded down to whole bytes) of tensors;
    ``idle_compute``: the host idle through each step's compute (:class:`SyntheticWorkload`)."""
    if not isinstance(size_mb, (int, float)) or not math.isfinite(size_mb) or size_mb <= 0:
        raise ConfigError(f"size_mb must be a positive number, not {size_mb!r}")
    return SyntheticWorkload(int(size_mb * MIB), compute_ms, device, idle_compute=idle_compute)


def make_workload(
    preset: str | None = None,
    size_mb: float | None = None,
    device: str = "cpu",
    *,
    compute_ms: float = 5.0,
    finetune: bool = False,
    idle_compute: bool = False,
) -> Workload:
    """A GPT preset or a synthetic state (give one of the two; neither means ``tiny``);
    ``finetune``: the GPT's base frozen and low-rank adapters trained (:func:`gpt`);
    ``idle_compute``: the synthetic state's compute stands for device compute, the host idle
    through it (:class:`SyntheticWorkload`)."""
    if preset is not None and size_mb is not None:
        raise ConfigError("give a preset or a size in MiB, not both")
    if size_mb is not None:
        if finetune:
            raise ConfigError("finetune adapts a GPT preset, not a synthetic state; drop size_mb")
        return synthetic(size_mb, compute_ms, device, idle_compute=idle_compute)
    if idle_compute:
        raise ConfigError(
            "idle_compute stands in for the synthetic state's compute; give size_mb, not a preset"
        )
    return gpt(preset or "tiny", device=device, finetune=finetune)
