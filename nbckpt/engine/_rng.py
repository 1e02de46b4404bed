"""The random number generators a resumed run needs, as JSON kept in the manifest.

Stored beside the user's state rather than inside it, so no key a user picks can collide
with them, and per rank, since every rank draws its own numbers. Each record names the
process that drew them (its rank and world size), so that a rank never takes another rank's
streams: with one rank saving for all (``ranks="local"``), the others keep their own.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError

__all__ = ["capture", "owner", "parse", "process"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def process() -> tuple[int, int]:
    """This process's rank and world size in the default process group ((0, 1) without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def owner(record: Any, rank: int) -> tuple[int, int]:
    """The (rank, world size) of the process whose streams ``record`` holds (records of older
    nbckpt say nothing: they were stored under their own rank)."""
    saved = record.get("process") if isinstance(record, dict) else None
    if isinstance(saved, list) and len(saved) == 2 and all(isinstance(n, int) for n in saved):
        return saved[0], saved[1]
    return rank, -1


def capture() -> dict[str, Any]:
    """The torch (CPU and every CUDA device), numpy and ``random`` states of this process."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "process": list(process()),
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
        "random": [version, list(internal), gauss],
        "numpy": [
            kind,
            _b64(np.asarray(keys, dtype=np.uint32).tobytes()),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def parse(state: Any) -> Callable[[], None]:
    """What sets every generator :func:`capture` recorded, checked first: CheckpointError if the
    record is malformed (nothing is set then)."""
    try:
        torch_state = _bytes_tensor(state["torch"])
        version, internal, gauss = state["random"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy_state = (
            str(kind),
            np.frombuffer(base64.b64decode(keys, validate=True), dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
        random_state = (
            int(version),
            tuple(int(x) for x in internal),
            None if gauss is None else float(gauss),
        )
        cuda = [_bytes_tensor(s) for s in state.get("cuda", [])]
        # Every generator takes its state on a copy first: a malformed one fails here, not halfway.
        torch.Generator().set_state(torch_state)
        random.Random().setstate(random_state)
        np.random.RandomState().set_state(numpy_state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        raise CheckpointError(f"the manifest's RNG record is malformed ({exc})") from None

    def restore() -> None:
        torch.set_rng_state(torch_state)
        random.setstate(random_state)
        np.random.set_state(numpy_state)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])

    return restore
