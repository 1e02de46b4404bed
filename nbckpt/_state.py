"""Turn a user's state (modules, optimizers, tensors, plain values) into tensors plus a JSON tree.

Tensors go to DCP; everything else lives in the manifest as JSON, so restoring
never unpickles anything.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._errors import CheckpointError, ConfigError

RNG_KEY = "_rng"
Node = dict[str, Any]


@dataclass
class Flattened:
    """A state split into its tensors (by dotted key) and a JSON tree that references them."""

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"manifest names an unknown dtype {name!r}")
    return dtype


def flatten(state: Mapping[str, Any], *, capture_rng: bool = False) -> Flattened:
    """Split ``state`` into tensors and a tree; raises ConfigError naming any unsupported value."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict, not {type(state).__name__}")
    out = Flattened(tree={})
    root = dict(state)
    if capture_rng:
        if RNG_KEY in root:
            raise ConfigError(f"state key {RNG_KEY!r} is reserved for RNG capture")
        root[RNG_KEY] = rng_state()
    out.tree = _encode(root, (), out)
    return out


def _encode(value: Any, path: tuple[str, ...], out: Flattened) -> Node:
    where = ".".join(path) or "state"
    if isinstance(value, torch.nn.Module):
        return {"t": "module", "state": _encode(value.state_dict(), path, out)}
    if isinstance(value, torch.optim.Optimizer):
        return {"t": "optimizer", "state": _encode(value.state_dict(), path, out)}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, path, out, "tensor")
    if _is_ndarray(value):
        return _encode_tensor(torch.from_numpy(value), path, out, "ndarray")
    if isinstance(value, Mapping):
        items = []
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConfigError(f"{where} has a key of type {type(key).__name__}; use str or int")
            items.append([key, _encode(item, (*path, str(key)), out)])
        return {"t": "dict", "items": items}
    if isinstance(value, (list, tuple)):
        kind = "list" if isinstance(value, list) else "tuple"
        return {
            "t": kind,
            "items": [_encode(item, (*path, str(i)), out) for i, item in enumerate(value)],
        }
    if value is None or isinstance(value, (bool, int, str)):
        return {"t": "value", "v": value}
    if isinstance(value, float):
        return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
    raise ConfigError(
        f"{where} holds a {type(value).__name__}, which nbckpt cannot checkpoint "
        "(use tensors, modules, optimizers, dicts, lists and plain values)"
    )


def _encode_tensor(tensor: torch.Tensor, path: tuple[str, ...], out: Flattened, kind: str) -> Node:
    key = ".".join(path)
    if tensor.layout != torch.strided:
        raise ConfigError(f"{key} is a {tensor.layout} tensor; only dense tensors are supported")
    if key in out.tensors:
        raise ConfigError(f"two tensors flatten to the same key {key!r}; rename one")
    out.tensors[key] = tensor.detach()
    return {
        "t": kind,
        "key": key,
        "dtype": _dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "device": tensor.device.type,
    }


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def tensor_specs(tree: Node) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every tensor the tree references: key to (dtype, shape)."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def walk(node: Node) -> None:
        kind = node.get("t")
        if kind in ("tensor", "ndarray"):
            specs[node["key"]] = (_dtype(node["dtype"]), tuple(int(n) for n in node["shape"]))
        elif kind in ("module", "optimizer"):
            walk(node["state"])
        elif kind == "dict":
            for _, child in node["items"]:
                walk(child)
        elif kind in ("list", "tuple"):
            for child in node["items"]:
                walk(child)

    walk(tree)
    return specs


def decode(node: Node, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the Python value a tree node stands for (modules and optimizers as state dicts)."""
    kind = node.get("t")
    if kind == "tensor":
        return tensors[node["key"]]
    if kind == "ndarray":
        return tensors[node["key"]].numpy()
    if kind in ("module", "optimizer"):
        return decode(node["state"], tensors)
    if kind == "dict":
        return {key: decode(child, tensors) for key, child in node["items"]}
    if kind == "list":
        return [decode(child, tensors) for child in node["items"]]
    if kind == "tuple":
        return tuple(decode(child, tensors) for child in node["items"])
    if kind == "value":
        return node["v"]
    if kind == "float":
        return float(node["v"])
    raise CheckpointError(f"manifest tree has an unknown node type {kind!r}")


def apply(target: dict[str, Any], tree: Node, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load the saved tree into ``target`` in place (modules, optimizers, tensors, plain values)."""
    if tree.get("t") != "dict":
        raise CheckpointError("manifest tree does not start with a dict")
    saved = {key: child for key, child in tree["items"]}
    for key in list(target):
        if key not in saved:
            raise CheckpointError(f"the checkpoint has no entry {key!r}")
        target[key] = _apply_one(target[key], saved[key], tensors, str(key))


def _apply_one(current: Any, node: Node, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(current, torch.nn.Module):
        current.load_state_dict(decode(node, tensors))
        return current
    if isinstance(current, torch.optim.Optimizer):
        current.load_state_dict(decode(node, tensors))
        return current
    if isinstance(current, torch.Tensor) and node.get("t") == "tensor":
        value = tensors[node["key"]]
        if value.shape != current.shape:
            raise CheckpointError(
                f"{where}: saved shape {tuple(value.shape)} != current {tuple(current.shape)}"
            )
        if value.data_ptr() != current.data_ptr():
            with torch.no_grad():
                current.copy_(value)
        return current
    if isinstance(current, dict) and node.get("t") == "dict":
        saved = {key: child for key, child in node["items"]}
        for key in list(current):
            if key not in saved:
                raise CheckpointError(f"the checkpoint has no entry {where}.{key}")
            current[key] = _apply_one(current[key], saved[key], tensors, f"{where}.{key}")
        return current
    return decode(node, tensors)


def rng_state() -> dict[str, Any]:
    """The RNG states a restored run needs to continue bit-identically."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with the project
        return state
    state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
