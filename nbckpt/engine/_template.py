"""The caller's state as the template of a restore: what it asks that the checkpoint cannot give,
which part of each saved tensor it wants, and loading what was read into it.

The template rules: each key of the state is filled from the checkpoint's entry of that name.
Modules, optimizers and objects with ``load_state_dict`` load in place; tensors are copied into;
a dict is filled in place with every saved entry; anything else is replaced. A DTensor in the
template (directly, or as a module's or optimizer's state) asks for its own shard only: the
checkpoint may have been written at another world size or with other placements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from ._shards import is_dtensor
from ._state import STATEFUL, Node, decode, dtype_from_name, dtype_name

__all__ = ["align", "apply", "check_loadable", "check_template", "destinations", "sharded_targets"]


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
    if isinstance(current, torch.optim.Optimizer) and kind not in ("optimizer", "dict"):
        return [f"{name} is an optimizer, the checkpoint holds a {kind}"]
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


def sharded_targets(template: Mapping[Any, Any], saved: Node) -> dict[str, Any]:
    """The saved tensors the template holds as DTensors: saved key -> that DTensor (whose shard,
    mesh and placements the restored tensor takes). Every other tensor is read whole."""
    found: dict[str, Any] = {}
    items = {key: child for key, child in saved["items"]}
    for key, current in template.items():
        if key in items:
            _targets(current, items[key], found)
    return found


def _targets(current: Any, node: Node, found: dict[str, Any]) -> None:
    kind = node.get("t")
    if isinstance(current, torch.Tensor):
        if kind == "tensor" and is_dtensor(current):
            found[node["key"]] = current
    elif isinstance(current, torch.nn.Module) and kind in ("module", "dict"):
        _state_targets(current.state_dict(), node["state"] if kind == "module" else node, found)
    elif isinstance(current, torch.optim.Optimizer) and kind == "optimizer":
        _optimizer_targets(current, node["state"], found)
    elif isinstance(current, dict) and kind == "dict":
        _state_targets(current, node, found)


def _state_targets(current: Mapping[Any, Any], node: Node, found: dict[str, Any]) -> None:
    if node.get("t") != "dict":
        return
    for key, child in node["items"]:
        if key in current:
            _targets(current[key], child, found)


def _optimizer_targets(optimizer: torch.optim.Optimizer, node: Node, found: dict[str, Any]) -> None:
    """An optimizer's state is sharded as it is now, or, before its first step (no state yet), as
    the parameter it belongs to, when the saved tensor has that parameter's shape."""
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
                _targets(now, leaf, found)
            elif (
                index < len(params)
                and is_dtensor(params[index])
                and list(params[index].shape) == leaf["shape"]
            ):
                found[leaf["key"]] = params[index]


def check_loadable(target: Mapping[Any, Any], saved: Node, tensors: Mapping[str, Any]) -> list[str]:
    """What :func:`apply` would fail on after changing something: checked before it changes anything.

    An optimizer refuses a state whose parameter groups differ from its own only once called;
    by then a model saved beside it would already be overwritten.
    """
    problems = []
    items = {key: child for key, child in saved["items"]}
    for key, current in target.items():
        node = items[key]
        if isinstance(current, torch.optim.Optimizer) and node.get("t") == "optimizer":
            groups = decode(node["state"], tensors).get("param_groups")
            mine = current.param_groups
            if not isinstance(groups, list) or [len(g.get("params", ())) for g in groups] != [
                len(g["params"]) for g in mine
            ]:
                problems.append(
                    f"{key}: the checkpoint's optimizer has parameter groups of "
                    f"{[len(g.get('params', ())) for g in groups] if isinstance(groups, list) else '?'} "
                    f"parameters, this one {[len(g['params']) for g in mine]}"
                )
    return problems


def apply(target: dict[Any, Any], saved: Node, tensors: Mapping[str, Any]) -> None:
    """Load the saved tree into ``target`` in place (checked by :func:`check_template` and
    :func:`check_loadable` first).

    Modules, optimizers and stateful objects load their state in place; tensors are copied
    into; a dict is filled in place with every saved entry; anything else is replaced.
    """
    items = {key: child for key, child in saved["items"]}
    for key in list(target):
        target[key] = _apply_one(target[key], items[key], tensors)


def _apply_one(current: Any, node: Node, tensors: Mapping[str, Any]) -> Any:
    kind = node.get("t")
    stateful = callable(getattr(current, "load_state_dict", None))
    if stateful and (
        kind in STATEFUL or (kind == "dict" and isinstance(current, (torch.nn.Module, torch.optim.Optimizer)))
    ):
        value = decode(node, tensors)
        if isinstance(current, torch.optim.Optimizer) and kind == "dict":
            value = _numbered(value)
        current.load_state_dict(value)
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
                _apply_one(current[key], child, tensors) if key in current else decode(child, tensors)
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
    found: dict[str, torch.Tensor] = {}
    items = {key: child for key, child in saved["items"]}
    for key, current in template.items():
        if key in items:
            _destinations(current, items[key], found)
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


def _destinations(current: Any, node: Node, found: dict[str, torch.Tensor]) -> None:
    kind = node.get("t")
    if isinstance(current, torch.Tensor):
        if kind == "tensor":
            found[node["key"]] = cast(Any, current).to_local() if is_dtensor(current) else current
    elif isinstance(current, torch.nn.Module) and kind in ("module", "dict"):
        _state_destinations(current.state_dict(), node["state"] if kind == "module" else node, found)
    elif isinstance(current, torch.optim.Optimizer) and kind == "optimizer":
        saved_state = dict(node["state"].get("items", [])).get("state")
        if saved_state is not None and saved_state.get("t") == "dict":
            _state_destinations(current.state_dict()["state"], saved_state, found)
    elif isinstance(current, dict) and kind == "dict":
        _state_destinations(current, node, found)


def _state_destinations(current: Mapping[Any, Any], node: Node, found: dict[str, torch.Tensor]) -> None:
    if node.get("t") != "dict":
        return
    for key, child in node["items"]:
        if key in current:
            _destinations(current[key], child, found)
