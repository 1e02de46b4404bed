"""A user's state (modules, optimizers, stateful objects, tensors, plain values) as tensors plus a
JSON tree that references them by key, and back; and the RNG streams a resumed run needs.

Tensors are written as DCP items under dotted keys (DCP's own naming, so a plain
``dcp.load`` finds them); everything else lives in the manifest as JSON, so restoring
never unpickles anything. A DTensor is its local shard, recorded as a chunk of the whole
tensor; two keys naming one tensor (tied weights) are one tensor with two names.
"""

from __future__ import annotations

import argparse
import base64
import functools
import math
import pathlib
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from .._errors import CheckpointError, ConfigError
from ._shards import Region, is_dtensor, is_replicated, local_part

__all__ = [
    "MAX_BYTES_VALUE",
    "MAX_DEPTH",
    "Flattened",
    "TensorSpec",
    "decode",
    "dtype_from_name",
    "dtype_name",
    "flatten",
    "node_tensors",
    "numpy_has",
    "rng_capture",
    "rng_owner",
    "rng_parse",
    "rng_process",
    "tree_specs",
]

Node = dict[str, Any]
#: Deepest nesting of a state: far beyond any real one, far below Python's recursion limit.
MAX_DEPTH = 64
STATEFUL = ("module", "optimizer", "stateful")
#: The largest ``bytes`` value a state may hold (torchtitan's pickled data loader state is a few
#: KB): it lives in the manifest as base64 and as a DCP byte item, both of which stay small.
MAX_BYTES_VALUE = 8 << 20
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: Dtypes whose storage is not ``itemsize`` bytes an element (``torch.empty(n, dtype=quint4x2)``
#: holds n/2 bytes): no buffer sized by ``nbytes`` may ever be made for one read from a file.
_UNSTORABLE = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


class TensorSpec(NamedTuple):
    """What a staging slot and a file layout need to know of the bytes of one tensor a rank holds
    (a tuple: cheap to make, hash and compare, which plan caching does for every save)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The bytes this rank holds: the whole tensor, or a DTensor's local chunk."""
    offsets: tuple[int, ...] | None = None
    """Where that chunk starts in the whole tensor; None for a plain tensor (all of it)."""
    size: tuple[int, ...] | None = None
    """The whole tensor's shape; None for a plain tensor (``shape``)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def sharded(self) -> bool:
        return self.offsets is not None

    @property
    def chunk(self) -> Region:
        """The part of the whole tensor these bytes are."""
        return Region(self.offsets if self.offsets is not None else (0,) * len(self.shape), self.shape)

    @property
    def whole(self) -> tuple[int, ...]:
        return self.size if self.size is not None else self.shape


@dataclass
class Flattened:
    """A state split into its tensors (by dotted key) and a JSON tree that references them."""

    tree: Node
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each key's tensor as this rank holds it (a DTensor's local shard)."""
    paths: dict[str, tuple[str | int, ...]] = field(default_factory=dict)
    """Each tensor's path of keys in the state (DCP's planner data: how to nest it again)."""
    specs: list[TensorSpec] = field(default_factory=list)
    """Each tensor's key, dtype and chunk, in the state's order: what a file layout depends on."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Keys whose tensor is one an earlier key names (tied weights): key -> that earlier key."""
    replicas: set[str] = field(default_factory=set)
    """DTensors with a Replicate placement: other ranks hold the same chunk, which must agree."""
    frozen: set[str] = field(default_factory=set)
    """Keys of modules' parameters that do not require grad (asked for with ``frozen=True``)."""
    trained: set[str] = field(default_factory=set)
    """Keys of modules' parameters that require grad, and of optimizers' tensors (``frozen=True``)."""
    nbytes: int = 0


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"manifest names an unknown dtype {name!r}")
    if dtype in _UNSTORABLE:
        raise CheckpointError(f"manifest names dtype {name!r}, which nbckpt never writes")
    return dtype


@functools.cache
def numpy_has(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` becomes a numpy array (bfloat16, float8, complex32: not)."""
    try:
        torch.empty(0, dtype=dtype).numpy()
    except (TypeError, RuntimeError):
        return False
    return True


def flatten(state: Mapping[str, Any], *, frozen: bool = False) -> Flattened:
    """Split ``state`` into tensors and a tree; ConfigError names any value it cannot hold. With
    ``frozen``, also note which modules' parameters do not require grad."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict, not {type(state).__name__}")
    out = Flattened(tree={})
    out.tree = _Encoder(out, frozen).encode(state, ())
    return out


class _Encoder:
    def __init__(self, out: Flattened, frozen: bool = False) -> None:
        self.out, self.frozen = out, frozen
        self.active: set[int] = set()  # containers on the current path: a cycle is refused
        self.seen: dict[tuple[Any, ...], str] = {}  # each tensor's identity: the first key naming it

    def encode(self, value: Any, path: tuple[str | int, ...]) -> Node:
        where = ".".join(map(str, path)) or "state"
        if len(path) > MAX_DEPTH:
            raise ConfigError(f"{where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, torch.Tensor):
            return self.tensor(value, path, "tensor")
        if _is_ndarray(value):
            return self.tensor(_from_numpy(value, where), path, "ndarray")
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
        if isinstance(value, (bytes, bytearray)):
            return _bytes_node(value, where)
        if id(value) in self.active:
            raise ConfigError(f"{where} contains itself")
        self.active.add(id(value))
        try:
            return self.container(value, path, where)
        finally:
            self.active.discard(id(value))

    def container(self, value: Any, path: tuple[str | int, ...], where: str) -> Node:
        if isinstance(value, torch.nn.Module):
            if self.frozen:  # state_dict() detaches: requires_grad is read from the parameters
                for name, param in value.named_parameters():
                    key = ".".join(map(str, (*path, name)))
                    (self.out.trained if param.requires_grad else self.out.frozen).add(key)
            return {"t": "module", "state": self.encode(value.state_dict(), path)}
        if isinstance(value, torch.optim.Optimizer):
            before = len(self.out.tensors)
            node = {"t": "optimizer", "state": self.encode(value.state_dict(), path)}
            if self.frozen:
                self.out.trained.update(list(self.out.tensors)[before:])
            return node
        if isinstance(value, Mapping):
            return {"t": "dict", "items": self.items(value.items(), path, where)}
        if isinstance(value, argparse.Namespace):
            return {"t": "namespace", "items": self.items(vars(value).items(), path, where)}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {"t": kind, "items": [self.encode(item, (*path, i)) for i, item in enumerate(value)]}
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            # LR schedulers, samplers, StatefulDataLoader: the torch.distributed.checkpoint
            # Stateful protocol, restored in place like a module.
            state = value.state_dict()
            return {"t": "stateful", "class": type(value).__name__, "state": self.encode(state, path)}
        raise ConfigError(
            f"{where} holds a {type(value).__name__}, which nbckpt cannot checkpoint; it takes "
            "tensors, numpy arrays, modules, optimizers, objects with state_dict()/"
            "load_state_dict(), dicts, lists, tuples, argparse.Namespace, str, int, float, "
            "bool, bytes, None, pathlib paths, torch dtypes and devices"
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
        chunk: Region | None = None
        whole: tuple[int, ...] | None = None
        # the common case (a plain tensor or parameter) skips the subclass checks
        if type(tensor) not in _PLAIN_TENSORS:
            if is_dtensor(tensor):
                whole = tuple(tensor.shape)
                if is_replicated(tensor):
                    self.out.replicas.add(key)
                tensor, chunk = local_part(tensor, key)
            elif type(tensor).__name__ == "ShardedTensor":
                raise ConfigError(
                    f"{key} is a ShardedTensor (FSDP1's sharded state dict); save FSDP2/DTensor "
                    "state (get_state_dict) or a full state dict"
                )
        _check_dense(tensor, key)
        if key in self.out.tensors:
            raise ConfigError(f"two tensors flatten to the same key {key!r}; rename one")
        shape = tuple(tensor.shape)
        spec = TensorSpec(key, tensor.dtype, shape, None if chunk is None else chunk.offsets, whole)
        self.out.tensors[key] = tensor.detach()
        self.out.paths[key] = path
        first = self.seen.setdefault(_identity(tensor, spec), key) if tensor.numel() else key
        if first != key:
            self.out.aliases[key] = first  # staged and written once, under the first key
        else:
            self.out.specs.append(spec)
            self.out.nbytes += spec.nbytes
        return {
            "t": kind,
            "key": key,
            "dtype": dtype_name(tensor.dtype),
            "shape": list(spec.whole),
            "device": tensor.device.type,
        }


def _bytes_node(value: bytes | bytearray, where: str) -> Node:
    """Opaque bytes (torchtitan's ``pickle.dumps`` of its data loader): kept as they are, never
    unpickled by nbckpt; a bytearray comes back as bytes."""
    if len(value) > MAX_BYTES_VALUE:
        raise ConfigError(
            f"{where} is {len(value)} bytes, over the {MAX_BYTES_VALUE} a bytes value may hold; save it as a "
            "uint8 tensor (torch.frombuffer)"
        )
    return {"t": "bytes", "v": _b64(bytes(value))}


def _check_dense(tensor: torch.Tensor, key: str) -> None:
    if tensor.is_nested:
        raise ConfigError(f"{key} is a nested tensor; nbckpt saves dense tensors (save its .unbind() parts)")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta or tensor.dtype in _UNSTORABLE:
        raise ConfigError(f"{key} is not a dense tensor with data; nbckpt saves dense tensors only")


def _identity(tensor: torch.Tensor, spec: TensorSpec) -> tuple[Any, ...]:
    """What makes two tensors one: the same bytes, seen the same way (tied weights)."""
    return (tensor.device, tensor.data_ptr(), tensor.stride(), spec[1:])


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _from_numpy(array: Any, where: str) -> torch.Tensor:
    """A numpy array as a tensor: a view where torch can share it, a native-order copy otherwise."""
    if array.dtype.fields is not None or array.dtype.kind not in "biufc":
        raise ConfigError(f"{where} is a numpy array of dtype {array.dtype}, which has no torch dtype")
    if array.dtype == np.longdouble and np.dtype(np.longdouble).itemsize > 8:
        raise ConfigError(f"{where} is a numpy array of dtype {array.dtype}, which has no torch dtype")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if any(stride < 0 for stride in array.strides):
        array = np.ascontiguousarray(array)
    return torch.from_numpy(array)


def _children(node: Node) -> Iterator[Node]:
    kind = node.get("t")
    if kind in STATEFUL:
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
    """Every tensor the tree references: key to the spec of the whole tensor."""
    specs = {}
    for leaf in node_tensors(node):
        shape = tuple(int(n) for n in leaf["shape"])
        specs[leaf["key"]] = TensorSpec(leaf["key"], dtype_from_name(leaf["dtype"]), shape)
    return specs


def decode(node: Node, tensors: Mapping[str, Any]) -> Any:
    """The Python value a node stands for (modules, optimizers, stateful objects as state dicts)."""
    kind = node.get("t")
    if kind == "tensor":
        return tensors[node["key"]]
    if kind == "ndarray":
        array = tensors[node["key"]]
        return array if array.is_meta else array.numpy()  # a peek on meta has no data to give
    if kind in STATEFUL:
        return decode(node["state"], tensors)
    if kind in ("dict", "namespace"):
        pairs = {key: decode(child, tensors) for key, child in node["items"]}
        return pairs if kind == "dict" else argparse.Namespace(**pairs)
    if kind in ("list", "tuple"):
        items = [decode(child, tensors) for child in node["items"]]
        return items if kind == "list" else tuple(items)
    if kind not in _VALUES:
        raise CheckpointError(f"manifest tree has an unknown node type {kind!r}")
    return _VALUES[kind](node["v"])


#: What the ``v`` of each kind of value node stands for.
_VALUES: dict[Any, Callable[[Any], Any]] = {
    "value": lambda v: v,
    "float": float,
    "bytes": lambda v: base64.b64decode(v, validate=True),
    "path": pathlib.Path,
    "dtype": lambda v: dtype_from_name(v),
    "device": torch.device,
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_process() -> tuple[int, int]:
    """This process's rank and world size in the default process group ((0, 1) without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rng_owner(record: Any, rank: int) -> tuple[int, int]:
    """The (rank, world size) of the process whose streams ``record`` holds (records of older
    nbckpt say nothing: they were stored under their own rank)."""
    saved = record.get("process") if isinstance(record, dict) else None
    if isinstance(saved, list) and len(saved) == 2 and all(isinstance(n, int) for n in saved):
        return saved[0], saved[1]
    return rank, -1


def rng_capture() -> dict[str, Any]:
    """The torch (CPU and every CUDA device), numpy and ``random`` states of this process, as JSON
    for the manifest (beside the user's state, so no key of theirs collides), naming the process
    that drew them, so that a rank never takes another rank's streams."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "process": list(rng_process()),
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


def rng_parse(state: Any) -> Callable[[], None]:
    """What sets every generator :func:`rng_capture` recorded, checked first: CheckpointError if the
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
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, OverflowError) as exc:
        raise CheckpointError(f"the manifest's RNG record is malformed ({exc})") from None

    def restore() -> None:
        torch.set_rng_state(torch_state)
        random.setstate(random_state)
        np.random.set_state(numpy_state)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])

    return restore
