"""The caller's state as the template of a restore (the rules: ``Checkpointer.restore``): what it
asks that the checkpoint cannot give, which part of each saved tensor it wants (a DTensor: its
own shard, whatever world size or placements saved it), and loading what was read into it.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, cast

import torch

from .._errors import describe_error
from ._shards import is_dtensor
from ._state import STATEFUL, Node, decode, dtype_from_name, dtype_name, node_tensors

__all__ = [
    "Loaders",
    "Refused",
    "align",
    "apply",
    "check_loadable",
    "check_template",
    "destinations",
    "own_loaders",
    "sharded_targets",
]


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


def check_template(template: Mapping[Any, Any], saved: Node, where: str) -> list[str]:
    """What the caller's ``template`` asks that the saved tree cannot give, one line each: checked
    before a byte is read, so the caller's mistake is never taken for a damaged checkpoint."""
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
    if isinstance(current, torch.optim.Optimizer) and kind not in ("optimizer", "dict"):
        return [f"{name} is an optimizer, the checkpoint holds a {kind}"]
    if _is_stateful(current) and kind not in (*STATEFUL, "dict"):  # never replaced by the saved value
        return [f"{name} is a {type(current).__name__}, the checkpoint holds a {kind}"]
    if isinstance(current, dict) and kind == "dict":
        return check_template(current, node, f"{name}.")
    return []


def _numbered(optimizer_state: Any) -> Any:
    """An optimizer's state dict as a plain DCP checkpoint nests it: its ``state`` keyed by the
    parameters' numbers as text ("0"), which ``Optimizer.load_state_dict`` needs as ints."""
    state = optimizer_state.get("state") if isinstance(optimizer_state, dict) else None
    if isinstance(state, dict) and all(isinstance(k, str) and k.isdigit() for k in state):
        return {**optimizer_state, "state": {int(k): v for k, v in state.items()}}
    return optimizer_state


def _check_module(module: torch.nn.Module, saved: Node, name: str) -> list[str]:
    wanted = {key: (t.dtype, tuple(t.shape)) for key, t in module.state_dict().items()}
    if saved.get("t") != "dict":
        return [f"{name}: the checkpoint's module state is not a dict"]
    have = {key: child for key, child in saved["items"]}
    problems = []
    missing = [key for key in wanted if key not in have]
    unexpected = [key for key in have if key not in wanted]
    if missing:
        problems.append(f"{name}: the checkpoint lacks {_first_few(missing)}")
    if unexpected:
        problems.append(f"{name}: the checkpoint has keys the module lacks: {_first_few(unexpected)}")
    for key, (_, shape) in wanted.items():
        child = have.get(key)
        if child is not None and child.get("t") == "tensor" and tuple(child["shape"]) != shape:
            problems.append(
                f"{name}.{key}: the checkpoint has shape {_shape(child['shape'])}, "
                f"the module has {_shape(shape)}"
            )
    return problems


def _first_few(keys: list[Any]) -> str:
    return ", ".join(map(str, keys[:5])) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


_COMPILED = "_orig_mod."  # torch.compile's prefix on the keys of a compiled module
_WRAPPED = "module."  # DDP's (and DataParallel's) prefix on the keys of the model it wraps


def align(template: Mapping[Any, Any], saved: Node, key_map: Callable[[str], str | None] | None) -> Node:
    """The saved tree with each module's keys as the template's module names them: mapped
    through ``key_map`` (None drops a key), or else with torch.compile's ``_orig_mod.`` prefix or
    DDP's ``module.`` added or removed where that, and only that, makes the keys match."""
    items = []
    for key, node in saved["items"]:
        current = template.get(key)
        if isinstance(current, torch.nn.Module) and node.get("t") == "module":
            state = node["state"]
            if state.get("t") == "dict":
                node = {**node, "state": {**state, "items": _renamed(current, state["items"], key_map)}}
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
    renames: list[Callable[[str], str]] = [
        lambda key: key.removeprefix(_COMPILED),
        lambda key: _COMPILED + key,
        lambda key: key.removeprefix(_WRAPPED),
        lambda key: _WRAPPED + key,
    ]
    for rename in renames:
        if {rename(k) for k in have} == wanted:
            return [[rename(str(key)), child] for key, child in pairs]
    return pairs


def sharded_targets(template: Mapping[Any, Any], saved: Node) -> dict[str, Any]:
    """The saved tensors the template holds as DTensors: saved key -> that DTensor (whose shard,
    mesh and placements the restored tensor takes). Every other tensor is read whole."""
    return {key: tensor for key, tensor, _ in _holders(template, saved) if is_dtensor(tensor)}


def _holders(template: Mapping[Any, Any], saved: Node) -> Iterator[tuple[str, Any, bool]]:
    """``(saved key, tensor, own)`` of each saved tensor the template holds: its own tensor, or
    (``own`` False) for an optimizer's state before its first step, the parameter it belongs to
    when the saved tensor has that parameter's shape (its state is sharded as the parameter)."""
    items = dict(saved["items"])
    for key, current in template.items():
        if key in items:
            yield from _node_holders(current, items[key])


def _node_holders(current: Any, node: Node) -> Iterator[tuple[str, Any, bool]]:
    kind = node.get("t")
    if isinstance(current, torch.Tensor):
        if kind == "tensor":
            yield node["key"], current, True
    elif isinstance(current, torch.nn.Module) and kind in ("module", "dict"):
        yield from _state_holders(current.state_dict(), node["state"] if kind == "module" else node)
    elif isinstance(current, torch.optim.Optimizer) and kind == "optimizer":
        yield from _optimizer_holders(current, node["state"])
    elif isinstance(current, dict) and kind == "dict":
        yield from _state_holders(current, node)


def _state_holders(current: Mapping[Any, Any], node: Node) -> Iterator[tuple[str, Any, bool]]:
    if node.get("t") == "dict":
        for key, child in node["items"]:
            if key in current:
                yield from _node_holders(current[key], child)


def _optimizer_holders(optimizer: torch.optim.Optimizer, node: Node) -> Iterator[tuple[str, Any, bool]]:
    saved_state = dict(node.get("items", [])).get("state")
    if saved_state is None or saved_state.get("t") != "dict":
        return
    current = optimizer.state_dict()["state"]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, per_param in saved_state["items"]:
        if not isinstance(index, int) or per_param.get("t") != "dict":
            continue
        for name, leaf in per_param["items"]:
            if leaf.get("t") != "tensor":
                continue
            now = current.get(index, {}).get(name)
            if now is not None:
                yield from _node_holders(now, leaf)
            elif index < len(params) and list(params[index].shape) == leaf["shape"]:
                yield leaf["key"], params[index], False


def check_loadable(target: Mapping[Any, Any], saved: Node, tensors: Mapping[str, Any]) -> list[str]:
    """What :func:`apply` would fail on after changing something (an optimizer refuses other
    parameter groups, or another optimizer's state, only once called, when a model beside it is
    already overwritten): each optimizer loads its state into a stand-in first."""
    problems = []
    items = {key: child for key, child in saved["items"]}
    for key, current in target.items():
        node = items[key]
        if isinstance(current, torch.optim.Optimizer) and node.get("t") == "optimizer":
            groups = decode(node["state"], tensors).get("param_groups")
            theirs = [len(g.get("params", ())) for g in groups] if isinstance(groups, list) else "?"
            mine = [len(g["params"]) for g in current.param_groups]
            if theirs != mine:
                problems.append(
                    f"{key}: the checkpoint's optimizer has parameter groups of {theirs} "
                    f"parameters, this one {mine}"
                )
    for name, current, node in own_loaders(target, saved):
        if isinstance(current, torch.optim.Optimizer) and not problems:
            problem = _trial(name, current, _loadable(current, node, tensors))
            problems.extend([problem] if problem else [])
    return problems


def _trial(name: str, optimizer: torch.optim.Optimizer, value: Any) -> str | None:
    """Why ``optimizer`` would refuse ``value``, found on a stand-in: its class and settings,
    its parameters and the value's tensors as meta tensors (no memory, nothing of the caller's
    changed). Confirmed with the real tensors before the restore is refused, so a class that
    computes on its state (which meta tensors cannot) is never refused for that. A wrapper
    (accelerate's AcceleratedOptimizer, Lightning's) keeps its state in the optimizer it wraps,
    so a stand-in would write into the caller's: it is not tried."""
    if not _stands_in(optimizer):
        return None
    try:
        _stand_in(optimizer, meta=True).load_state_dict(_as_meta(value))
        return None
    except Exception:  # whatever its class raises: confirmed below on the real tensors
        pass
    try:
        _stand_in(optimizer, meta=False).load_state_dict(value)
    except Exception as exc:  # what the caller's optimizer would raise, once its model was loaded
        return f"{name}: {type(optimizer).__name__} refuses the saved state ({describe_error(exc)})"
    return None


def _stands_in(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a stand-in of ``optimizer`` shares nothing that loading changes: its state and
    groups are its own attributes (not properties over another's) and it wraps no optimizer."""
    own = vars(optimizer)
    return (
        "state" in own
        and "param_groups" in own
        and not any(isinstance(value, torch.optim.Optimizer) for value in own.values())
    )


def _stand_in(optimizer: torch.optim.Optimizer, *, meta: bool) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class sharing its settings (and hooks), not its state:
    loading into it replaces the stand-in's ``state`` and ``param_groups`` only."""
    stand_in = object.__new__(type(optimizer))
    vars(stand_in).update(vars(optimizer))
    stand_in.state = defaultdict(dict)
    stand_in.param_groups = [
        {**group, "params": [_as_meta(p) if meta else p for p in group["params"]]}
        for group in optimizer.param_groups
    ]
    return stand_in


def _as_meta(value: Any) -> Any:
    """``value`` with every tensor a meta tensor of its dtype and shape (no bytes)."""
    if isinstance(value, torch.Tensor):
        local = cast(Any, value).to_local() if is_dtensor(value) else value
        return torch.empty(local.shape, dtype=local.dtype, device="meta")
    if isinstance(value, dict):
        return {key: _as_meta(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_meta(item) for item in value)
    return value


def own_loaders(target: Mapping[Any, Any], saved: Node) -> list[tuple[str, Any, Node]]:
    """``(name, object, saved node)`` of each object other than a module that :func:`apply` loads
    through its own ``load_state_dict`` (optimizers, LR schedulers, GradScalers, data loaders),
    in the order it loads them."""
    items = {key: child for key, child in saved["items"]}
    return [found for key, current in target.items() for found in _loaders(current, items[key], str(key))]


def _loaders(current: Any, node: Node, name: str) -> Iterator[tuple[str, Any, Node]]:
    kind = node.get("t")
    if _loads_itself(current, kind):
        if not isinstance(current, torch.nn.Module):  # checked key by key and shape by shape
            yield name, current, node
    elif isinstance(current, dict) and kind == "dict":
        for key, child in node["items"]:
            if key in current:
                yield from _loaders(current[key], child, f"{name}.{key}")


def _loads_itself(current: Any, kind: Any) -> bool:
    """Whether ``current`` takes the saved ``kind`` through its own ``load_state_dict``: a state
    dict saved as a plain dict loads into any object of the caller's too (plain DCP saves every
    Stateful, torchtitan's LR schedulers, data loaders and TrainState, as its state dict)."""
    return _is_stateful(current) and (kind in STATEFUL or kind == "dict")


def _is_stateful(current: Any) -> bool:
    """An object with ``state_dict``/``load_state_dict`` (DCP's Stateful), not a dict itself."""
    return (
        not isinstance(current, Mapping)
        and callable(getattr(current, "load_state_dict", None))
        and callable(getattr(current, "state_dict", None))
    )


def _loadable(current: Any, node: Node, tensors: Mapping[str, Any]) -> Any:
    """The value ``current.load_state_dict`` is given for ``node``."""
    value = decode(node, tensors)
    if isinstance(current, torch.optim.Optimizer) and node.get("t") == "dict":
        value = _numbered(value)
    return value


class Refused(ValueError):
    """An object of the caller's refused its saved state (its own load_state_dict raised)."""


class Loaders:
    """The objects other than modules and optimizers that load their own state (LR schedulers,
    GradScalers, data loaders, the caller's own): loaded first, before any byte of the caller's
    state changes, each after a copy of its own state is taken, so that one refusing its state
    puts those loaded before it back (:meth:`undo`) and nothing is changed. Their state is
    small; a module's or optimizer's is not, and is checked before instead (shapes, groups, a
    stand-in's load)."""

    def __init__(self, target: Mapping[Any, Any], saved: Node) -> None:
        self.pending = [
            found for found in own_loaders(target, saved) if not isinstance(found[1], torch.optim.Optimizer)
        ]
        self.loaded: list[tuple[Any, Any]] = []  # (object, its state before), in the order loaded

    @property
    def done(self) -> set[int]:
        return {id(current) for current, _ in self.loaded}

    def tensor_keys(self) -> set[str]:
        """The saved tensors in the state of these objects (read before they load)."""
        return {leaf["key"] for _, _, node in self.pending for leaf in node_tensors(node)}

    def load(self, tensors: Mapping[str, Any]) -> None:
        """Load each; the first to refuse puts back every one loaded, itself included, and
        raises :class:`Refused` naming it."""
        for name, current, node in self.pending:
            value = _loadable(current, node, tensors)
            self.loaded.append((current, _state_before(current)))
            try:
                current.load_state_dict(value)
            except Exception as exc:  # the object's own refusal, of whatever type its class raises
                raise Refused(_refusal(name, current, node, exc) + self.undo()) from exc

    def undo(self) -> str:
        """Put back every object loaded, the last first; what could not be put back, or ''."""
        failed = []
        while self.loaded:
            current, before = self.loaded.pop()
            try:
                current.load_state_dict(before)
            except Exception:  # said in the error; the others are still put back
                failed.append(type(current).__name__)
        return f"; could not put back the state of {', '.join(failed)}" if failed else ""


def _state_before(current: Any) -> Any:
    """A copy of ``current``'s state to put back: deep, since ``load_state_dict`` may change the
    objects it holds in place (a SequentialLR loads its schedulers); as it is where it cannot
    be copied (a lock or a generator in it)."""
    state = current.state_dict()
    try:
        return copy.deepcopy(state)
    except Exception:  # copying fails in the ways each of its values' classes chooses
        return state


def _refusal(name: str, current: Any, node: Node, exc: BaseException) -> str:
    """``name`` refused its state, in one line (naming the class that saved it, where another)."""
    mine, theirs = type(current).__name__, node.get("class")
    of = f" of a {theirs}" if isinstance(theirs, str) and theirs != mine else ""
    return f"{name}: {mine} refuses the saved state{of} ({describe_error(exc)})"


def apply(
    target: dict[Any, Any], saved: Node, tensors: Mapping[str, Any], done: Collection[int] = ()
) -> None:
    """Load the saved tree into ``target`` in place (checked by :func:`check_template` and
    :func:`check_loadable` first); the objects whose ids are in ``done`` are loaded already."""
    items = {key: child for key, child in saved["items"]}
    for key in list(target):
        target[key] = _apply_one(target[key], items[key], tensors, done)


def _apply_one(current: Any, node: Node, tensors: Mapping[str, Any], done: Collection[int]) -> Any:
    kind = node.get("t")
    if _loads_itself(current, kind):
        if id(current) not in done:
            current.load_state_dict(_loadable(current, node, tensors))
        return current
    if isinstance(current, torch.Tensor) and kind == "tensor":
        restored = tensors[node["key"]]
        local = cast(Any, current).to_local() if is_dtensor(current) else current
        source = restored.to_local() if is_dtensor(restored) else restored
        if source.data_ptr() != local.data_ptr() or source.shape != local.shape:  # read into it already
            with torch.no_grad():
                local.copy_(source)
        return current
    if isinstance(current, dict) and kind == "dict":
        for key, child in node["items"]:
            current[key] = (
                _apply_one(current[key], child, tensors, done) if key in current else decode(child, tensors)
            )
        return current
    return decode(node, tensors)


def destinations(
    template: Mapping[Any, Any], saved: Node, targets: Mapping[str, Any], specs: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """The caller's own tensors a restore can read straight into: saved key -> the tensor (a
    DTensor's local shard) that :func:`apply` would copy into anyway, where it takes the bytes
    as they are (on the CPU, contiguous, the saved dtype and the wanted shape) and shares no
    memory with another. Every other key is read into fresh memory."""
    holders = [(key, tensor) for key, tensor, own in _holders(template, saved) if own]
    found = {key: cast(Any, tensor).to_local() if is_dtensor(tensor) else tensor for key, tensor in holders}
    usable: dict[str, torch.Tensor] = {}
    spans: list[tuple[int, int, str]] = []
    for key, tensor in found.items():
        spec = specs.get(key)
        like = targets.get(key)
        shape = tuple(like.to_local().shape) if like is not None else (spec.shape if spec else None)
        if (
            spec is not None
            and tensor.device.type == "cpu"
            and tensor.layout == torch.strided
            and tensor.is_contiguous()
            and tensor.dtype == spec.dtype
            and tuple(tensor.shape) == shape
            and tensor.numel()
        ):
            usable[key] = tensor
            spans.append((tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes, key))
    spans.sort()
    reach, holder = -1, ""  # the furthest end so far, and whose
    for start, end, key in spans:
        if start < reach:  # one memory under two keys (a template's tied weights): read it fresh
            usable.pop(key, None)
            usable.pop(holder, None)
        if end > reach:
            reach, holder = end, key
    return usable
