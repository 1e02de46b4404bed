"""A user's state (modules, optimizers, stateful objects, tensors, plain values) as tensors plus a
JSON tree that references them by key, and back.

Tensors are written as DCP items under dotted keys (DCP's own naming, so a plain
``dcp.load`` finds them); everything else lives in the manifest as JSON, so restoring
never unpickles anything.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._errors import CheckpointError, ConfigError

__all__ = [
    "MAX_DEPTH",
    "Flattened",
    "TensorSpec",
    "align",
    "apply",
    "check_template",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "node_tensors",
    "tree_specs",
]

Node = dict[str, Any]
#: Deepest nesting of a state: far beyond any real one, far below Python's recursion limit.
MAX_DEPTH = 64
_STATEFUL = ("module", "optimizer", "stateful")
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class TensorSpec(NamedTuple):
    """What a staging slot and a file layout need to know of one tensor (a tuple: cheap to make,
    hash and compare, which plan caching does for every tensor of every save)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Flattened:
    """A state split into its tensors (by dotted key) and a JSON tree that references them."""

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    """Each tensor's path of keys in the state (DCP's planner data: how to nest it again)."""
    specs: list[TensorSpec] = field(default_factory=list)
    """Each tensor's key, dtype and shape, in the state's order: what a file layout depends on."""
    nbytes: int = 0


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"manifest names an unknown dtype {name!r}")
    return dtype


def flatten(state: Mapping[str, Any]) -> Flattened:
    """Split ``state`` into tensors and a tree; ConfigError names any value it cannot hold."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict, not {type(state).__name__}")
    out = Flattened(tree={})
    out.tree = _Encoder(out).encode(state, ())
    return out


class _Encoder:
    def __init__(self, out: Flattened) -> None:
        self.out = out
        self.active: set[int] = set()  # containers on the current path: a cycle is refused

    def encode(self, value: Any, path: tuple[str | int, ...]) -> Node:
        where = ".".join(map(str, path)) or "state"
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"{where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path, "tensor")
        if _is_ndarray(value):
            return self.tensor(torch.from_numpy(value), path, "ndarray")
        if value is None or isinstance(value, (bool, int, str)):
            return {"t": "value", "v": value}
        if isinstance(value, float):
            return {"t": "float", "v": value if math.isfinite(value) else repr(value)}
        if isinstance(value, pathlib.PurePath):
            return {"t": "path", "v": str(value)}
        if isinstance(value, torch.dtype):
            return {"t": "dtype", "v": dtype_name(value)}
        if isinstance(value, torch.device):
            return {"t": "device", "v": str(value)}
        if id(value) in self.active:
            raise ConfigError(f"{where} contains itself")
        self.active.add(id(value))
        try:
            return self.container(value, path, where)
        finally:
            self.active.discard(id(value))

    def container(self, value: Any, path: tuple[str | int, ...], where: str) -> Node:
        if isinstance(value, torch.nn.Module):
            return {"t": "module", "state": self.encode(value.state_dict(), path)}
        if isinstance(value, torch.optim.Optimizer):
            return {"t": "optimizer", "state": self.encode(value.state_dict(), path)}
        if isinstance(value, Mapping):
            return {"t": "dict", "items": self.items(value.items(), path, where)}
        if isinstance(value, argparse.Namespace):
            return {"t": "namespace", "items": self.items(vars(value).items(), path, where)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {
                "t": kind,
                "items": [self.encode(item, (*path, i)) for i, item in enumerate(value)],
            }
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            # LR schedulers, samplers, StatefulDataLoader: the torch.distributed.checkpoint
            # Stateful protocol, restored in place like a module.
            state = value.state_dict()
            return {"t": "stateful", "class": type(value).__name__, "state": self.encode(state, path)}
        raise ConfigError(
            f"{where} holds a {type(value).__name__}, which nbckpt cannot checkpoint; it takes "
            "tensors, numpy arrays, modules, optimizers, objects with state_dict()/"
            "load_state_dict(), dicts, lists, tuples, argparse.Namespace, str, int, float, "
            "bool, None, pathlib paths, torch dtypes and devices"
        )

    def items(self, pairs: Any, path: tuple[str | int, ...], where: str) -> list[list[Any]]:
        items = []
        for key, item in pairs:
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ConfigError(f"{where} has a key of type {type(key).__name__}; use str or int")
            # DCP's own paths: mapping keys as str, list positions as int.
            items.append([key, self.encode(item, (*path, str(key)))])
        return items

    def tensor(self, tensor: torch.Tensor, path: tuple[str | int, ...], kind: str) -> Node:
        key = ".".join(map(str, path))
        # the common case (a plain tensor or parameter) skips the name check
        if type(tensor) not in _PLAIN_TENSORS and type(tensor).__name__ in ("DTensor", "ShardedTensor"):
            raise ConfigError(
                f"{key} is a {type(tensor).__name__}; nbckpt saves each rank's local tensors "
                "(use tensor.to_local(), or torch.distributed.checkpoint for resharding)"
            )
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
            raise ConfigError(f"{key} is not a dense tensor with data; nbckpt saves dense tensors only")
        if key in self.out.tensors:
            raise ConfigError(f"two tensors flatten to the same key {key!r}; rename one")
        spec = TensorSpec(key, tensor.dtype, tuple(tensor.shape))
        self.out.tensors[key] = tensor.detach()
        self.out.paths[key] = path
        self.out.specs.append(spec)
        self.out.nbytes += spec.nbytes
        return {
            "t": kind,
            "key": key,
            "dtype": dtype_name(tensor.dtype),
            "shape": list(spec.shape),
            "device": tensor.device.type,
        }


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _children(node: Node) -> Iterator[Node]:
    kind = node.get("t")
    if kind in _STATEFUL:
        yield node["state"]
    elif kind in ("dict", "namespace"):
        for _, child in node["items"]:
            yield child
    elif kind in ("list", "tuple"):
        yield from node["items"]


def node_tensors(node: Node) -> Iterator[Node]:
    """Every tensor node under ``node`` (iterative: a hostile tree cannot exhaust the stack)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.get("t") in ("tensor", "ndarray"):
            yield current
        else:
            stack.extend(_children(current))


def tree_specs(node: Node) -> dict[str, TensorSpec]:
    """Every tensor the tree references: key to spec."""
    specs = {}
    for leaf in node_tensors(node):
        shape = tuple(int(n) for n in leaf["shape"])
        specs[leaf["key"]] = TensorSpec(leaf["key"], dtype_from_name(leaf["dtype"]), shape)
    return specs


def decode(node: Node, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The Python value a node stands for (modules, optimizers, stateful objects as state dicts)."""
    kind = node.get("t")
    if kind == "tensor":
        return tensors[node["key"]]
    if kind == "ndarray":
        array = tensors[node["key"]]
        return array if array.is_meta else array.numpy()  # a peek on meta has no data to give
    if kind in _STATEFUL:
        return decode(node["state"], tensors)
    if kind == "dict":
        return {key: decode(child, tensors) for key, child in node["items"]}
    if kind == "namespace":
        return argparse.Namespace(**{key: decode(child, tensors) for key, child in node["items"]})
    if kind == "list":
        return [decode(child, tensors) for child in node["items"]]
    if kind == "tuple":
        return tuple(decode(child, tensors) for child in node["items"])
    if kind == "value":
        return node["v"]
    if kind == "float":
        return float(node["v"])
    if kind == "path":
        return pathlib.Path(node["v"])
    if kind == "dtype":
        return dtype_from_name(node["v"])
    if kind == "device":
        return torch.device(node["v"])
    raise CheckpointError(f"manifest tree has an unknown node type {kind!r}")


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def check_template(template: Mapping[Any, Any], saved: Node, where: str) -> list[str]:
    """What the caller's ``template`` asks that the saved tree cannot give: one line each.

    Called before a byte is read, so a wrong key, shape or dtype is the caller's mistake
    (a ConfigError) and never mistaken for a damaged checkpoint.
    """
    problems: list[str] = []
    saved_items = {key: child for key, child in saved.get("items", [])}
    for key, current in template.items():
        name = f"{where}{key}"
        node = saved_items.get(key)
        if node is None:
            have = ", ".join(repr(k) for k in saved_items) or "nothing"
            problems.append(f"the checkpoint has no entry {name!r} (it has {have})")
            continue
        problems.extend(_check_one(current, node, name))
    return problems


def _check_one(current: Any, node: Node, name: str) -> list[str]:
    kind = node.get("t")
    if isinstance(current, torch.nn.Module):
        if kind not in ("module", "dict"):  # a saved state dict loads into a module too
            return [f"{name} is a module, the checkpoint holds a {kind}"]
        return _check_module(current, node["state"] if kind == "module" else node, name)
    if isinstance(current, torch.Tensor):
        if kind != "tensor":
            return [f"{name} is a tensor, the checkpoint holds a {kind}"]
        saved_shape, saved_dtype = tuple(node["shape"]), dtype_from_name(node["dtype"])
        if tuple(current.shape) != saved_shape or current.dtype != saved_dtype:
            return [
                f"{name}: the checkpoint has {dtype_name(saved_dtype)} {_shape(saved_shape)}, "
                f"the target is {dtype_name(current.dtype)} {_shape(current.shape)}"
            ]
        return []
    if isinstance(current, torch.optim.Optimizer) and kind != "optimizer":
        return [f"{name} is an optimizer, the checkpoint holds a {kind}"]
    if isinstance(current, dict) and kind == "dict":
        return check_template(current, node, f"{name}.")
    return []


def _check_module(module: torch.nn.Module, saved: Node, name: str) -> list[str]:
    wanted = {key: (t.dtype, tuple(t.shape)) for key, t in module.state_dict().items()}
    if saved.get("t") != "dict":
        return [f"{name}: the checkpoint's module state is not a dict"]
    have = {key: child for key, child in saved["items"]}
    problems = []
    missing = [key for key in wanted if key not in have]
    unexpected = [key for key in have if key not in wanted]
    if missing:
        problems.append(
            f"{name}: the checkpoint lacks {', '.join(missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    if unexpected:
        problems.append(
            f"{name}: the checkpoint has keys the module lacks: "
            f"{', '.join(map(str, unexpected[:5]))}"
            + (f" and {len(unexpected) - 5} more" if len(unexpected) > 5 else "")
        )
    for key, (_, shape) in wanted.items():
        child = have.get(key)
        if child is not None and child.get("t") == "tensor" and tuple(child["shape"]) != shape:
            problems.append(
                f"{name}.{key}: the checkpoint has shape {_shape(child['shape'])}, "
                f"the module has {_shape(shape)}"
            )
    return problems


_COMPILED = "_orig_mod."  # torch.compile's prefix on the keys of a compiled module


def align(template: Mapping[Any, Any], saved: Node, key_map: Callable[[str], str | None] | None) -> Node:
    """The saved tree with each module's keys as the template's module names them.

    With ``key_map``, every key of a saved module's state dict is mapped through it (None
    drops the key); without, torch.compile's ``_orig_mod.`` prefix is added or removed where
    that, and only that, makes the keys match (a compiled model's checkpoint loads into a
    plain one and back).
    """
    items = []
    for key, node in saved["items"]:
        current = template.get(key)
        if (
            isinstance(current, torch.nn.Module)
            and node.get("t") == "module"
            and node["state"].get("t") == "dict"
        ):
            node = {
                **node,
                "state": {**node["state"], "items": _renamed(current, node["state"]["items"], key_map)},
            }
        elif isinstance(current, torch.nn.Module) and node.get("t") == "dict":
            node = {**node, "items": _renamed(current, node["items"], key_map)}
        items.append([key, node])
    return {**saved, "items": items}


def _renamed(
    module: torch.nn.Module, pairs: list[list[Any]], key_map: Callable[[str], str | None] | None
) -> list[list[Any]]:
    if key_map is not None:
        return [[new, child] for key, child in pairs if (new := key_map(str(key))) is not None]
    wanted = set(module.state_dict())
    have = [str(key) for key, _ in pairs]
    if set(have) == wanted:
        return pairs
    renames: list[Callable[[str], str]] = [_uncompiled, _compiled]
    for rename in renames:
        if {rename(k) for k in have} == wanted:
            return [[rename(str(key)), child] for key, child in pairs]
    return pairs


def _uncompiled(key: str) -> str:
    return key.removeprefix(_COMPILED)


def _compiled(key: str) -> str:
    return _COMPILED + key


def apply(target: dict[Any, Any], saved: Node, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load the saved tree into ``target`` in place (checked by :func:`check_template` first).

    Modules, optimizers and stateful objects load their state in place; tensors are copied
    into; a dict is filled in place with every saved entry; anything else is replaced.
    """
    items = {key: child for key, child in saved["items"]}
    for key in list(target):
        target[key] = _apply_one(target[key], items[key], tensors)


def _apply_one(current: Any, node: Node, tensors: Mapping[str, torch.Tensor]) -> Any:
    kind = node.get("t")
    stateful = callable(getattr(current, "load_state_dict", None))
    if stateful and (kind in _STATEFUL or (kind == "dict" and isinstance(current, torch.nn.Module))):
        current.load_state_dict(decode(node, tensors))
        return current
    if isinstance(current, torch.Tensor) and kind == "tensor":
        with torch.no_grad():
            current.copy_(tensors[node["key"]])
        return current
    if isinstance(current, dict) and kind == "dict":
        for key, child in node["items"]:
            current[key] = (
                _apply_one(current[key], child, tensors) if key in current else decode(child, tensors)
            )
        return current
    return decode(node, tensors)
