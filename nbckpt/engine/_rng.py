"""The random number generators a resumed run needs, as JSON kept in the manifest.

Stored beside the user's state rather than inside it, so no key a user picks can collide
with them, and per rank, since every rank draws its own numbers.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from .._errors import CheckpointError

__all__ = ["capture", "restore"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def capture() -> dict[str, Any]:
    """The torch (CPU and every CUDA device), numpy and ``random`` states of this process."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
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


def restore(state: Any) -> None:
    """Set every generator :func:`capture` recorded; CheckpointError if the record is malformed."""
    try:
        torch_state = _bytes_tensor(state["torch"])
        version, internal, gauss = state["random"]
        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy_state = (
            kind,
            np.frombuffer(base64.b64decode(keys, validate=True), dtype=np.uint32),
            int(pos),
            int(has_gauss),
            float(cached),
        )
        random_state = (int(version), tuple(int(x) for x in internal), gauss)
        cuda = [_bytes_tensor(s) for s in state.get("cuda", [])]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the manifest's RNG record is malformed ({exc})") from None
    torch.set_rng_state(torch_state)
    random.setstate(random_state)
    np.random.set_state(numpy_state)
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
