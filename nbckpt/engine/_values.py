"""A state's plain values (a learning rate, a step counter, parameter names) as DCP byte items.

nbckpt keeps every value in its manifest, as JSON; a plain ``dcp.load`` looks for them in the
checkpoint's data, each a ``torch.save`` blob under the key DCP's flattening gives it. So rank 0
writes them there too, in one more data file, and adds them to the ``.metadata``: built on the
persist thread for every save, since values change from save to save while the tensors'
layout stays the same.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ._format import DCP_VERSION, Layout, pad
from ._state import decode, node_tensors
from ._torch_compat import storage_info

__all__ = ["dcp_values", "with_values"]


#: Plain values DCP stores as byte items (what ``torch.load(weights_only=True)`` gives back too).
_PLAIN = (type(None), bool, int, float, str)


def dcp_values(tree: dict[str, Any]) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """The state's plain values as DCP's flattening sees them: ``(key, path, value)`` of every
    leaf that is not a tensor, made of None, bool, int, float and str in lists, tuples and dicts.

    DCP descends into mappings (modules, optimizers and stateful objects are their state dicts)
    and into lists that hold tensors or mappings; any other value is one leaf. A leaf of another
    kind (a path, a dtype, a namespace) is nbckpt's alone: a plain ``dcp.load`` skips it.
    """
    found: list[tuple[str, tuple[str | int, ...], Any]] = []
    stack: list[tuple[tuple[str | int, ...], dict[str, Any]]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        kind = node.get("t")
        if kind in ("module", "optimizer", "stateful"):
            stack.append((path, node["state"]))
        elif kind == "dict":
            stack.extend(((*path, str(key)), child) for key, child in reversed(node["items"]))
        elif kind == "list" and not _dcp_terminal(node):
            stack.extend(((*path, index), child) for index, child in reversed(list(enumerate(node["items"]))))
        elif kind not in ("tensor", "ndarray") and path:
            value = decode(node, {}) if not any(True for _ in node_tensors(node)) else None
            if _plain_value(value):
                found.append((".".join(map(str, path)), path, value))
    return found


def _dcp_terminal(node: dict[str, Any]) -> bool:
    """DCP's ``_is_terminal`` for a list: no tensor in it, no mapping, no list that is not one."""
    for child in node["items"]:
        kind = child.get("t")
        if kind in ("tensor", "dict", "module", "optimizer", "stateful"):
            return False
        if kind == "list" and not _dcp_terminal(child):
            return False
    return True


def _plain_value(value: Any) -> bool:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, (list, tuple)):
            stack.extend(current)
        elif isinstance(current, dict):
            if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in current):
                return False
            stack.extend(current.values())
        elif not isinstance(current, _PLAIN):
            return False
    return True


def with_values(layout: Layout, tree: dict[str, Any], name: str) -> tuple[bytes, bytes]:
    """The plain values of ``tree`` as DCP byte items in a data file ``name``: that file's bytes,
    and the DCP metadata of the layout with them added (both b"" for the file when there are none).

    Built on the persist thread, not cached: the values (a step counter, a learning rate) change
    from save to save while the tensors' layout stays the same.
    """
    values = [(key, path, value) for key, path, value in dcp_values(tree) if key not in layout.locations]
    if not values:
        return b"", layout.metadata
    image = io.BytesIO()
    dcp = layout.dcp
    state_dict_metadata = dict(dcp.state_dict_metadata)
    storage_data = dict(dcp.storage_data)
    planner_data = dict(dcp.planner_data)
    for key, path, value in values:
        image.write(bytes(pad(image.tell())))
        start = image.tell()
        torch.save(value, image)
        state_dict_metadata[key] = BytesStorageMetadata()
        storage_data[MetadataIndex(key)] = storage_info(name, start, image.tell() - start)
        planner_data[key] = path
    metadata = Metadata(state_dict_metadata, planner_data, storage_data, version=DCP_VERSION)
    return image.getvalue(), pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
