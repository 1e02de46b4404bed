"""A checkpoint's plain values where a plain ``torch.distributed.checkpoint.load`` finds them.

nbckpt keeps the plain values (numbers, strings, lists of them) in the manifest as JSON; DCP
keeps them as ``torch.save`` blobs ("byte items") listed in ``.metadata``. Each rank writes its
own there too (:func:`value_items`), and :func:`dcp_metadata` lists them beside the tensors, so
that both readers find the same state. :mod:`._dcp_check` refuses a step where they disagree.
"""

from __future__ import annotations

import io
import itertools
import pickle
from typing import Any, NamedTuple

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ._format import DCP_VERSION, Layout, pad, torch_save
from ._state import decode, node_tensors
from ._torch_compat import storage_info

__all__ = ["ValueItem", "dcp_metadata", "dcp_values", "value_items"]


#: Plain values DCP stores as byte items (what ``torch.load(weights_only=True)`` gives back too).
_PLAIN = (type(None), bool, int, float, str, bytes)
#: The pickle protocol of a value's byte item: 3 is the first that writes bytes as bytes (2 calls
#: ``_codecs.encode``, a global, which the plain reader refuses).
VALUE_PROTOCOL = 3


def dcp_values(tree: dict[str, Any]) -> list[tuple[str, tuple[str | int, ...], Any]]:
    """The state's plain values as DCP's flattening sees them: ``(key, path, value)`` of every
    leaf that is not a tensor, made of None, bool, int, float, str and bytes in lists, tuples and
    dicts.

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


class ValueItem(NamedTuple):
    """A plain value's DCP byte item as a rank wrote it: its key, path, file and byte range."""

    key: str
    path: tuple[str | int, ...]
    file: str
    offset: int
    length: int


def value_items(
    layout: Layout, tree: dict[str, Any], name: str, skip: frozenset[str]
) -> tuple[bytes, list[ValueItem]]:
    """This rank's plain values (those of its own tree, but the keys in ``skip``: rank 0's, which
    rank 0 writes) as DCP byte items of a data file ``name``: that file's bytes (b"" when there
    are none), and where each is. Every rank writes its own, as DCP's planner would, so a plain
    ``dcp.load`` on each rank finds its per-rank keys."""
    image = io.BytesIO()
    items = []
    for key, path, value in dcp_values(tree):
        if key in layout.locations or key in skip:
            continue
        image.write(bytes(pad(image.tell())))
        start = image.tell()
        torch_save(value, image, pickle_protocol=VALUE_PROTOCOL)
        items.append(ValueItem(key, path, name, start, image.tell() - start))
    return image.getvalue(), items


def dcp_metadata(layout: Layout, written: list[list[ValueItem]]) -> bytes:
    """The layout's DCP metadata with the byte items every rank wrote (``written``, by rank): a key
    several ranks hold (a value all ranks share) is the lowest rank's, as :func:`all_values` reads
    it back."""
    if not any(written):
        return layout.metadata
    dcp = layout.dcp
    state_dict_metadata = dict(dcp.state_dict_metadata)
    storage_data = dict(dcp.storage_data)
    planner_data = dict(dcp.planner_data)
    for item in itertools.chain.from_iterable(written):
        if item.key in state_dict_metadata:
            continue
        state_dict_metadata[item.key] = BytesStorageMetadata()
        storage_data[MetadataIndex(item.key)] = storage_info(item.file, item.offset, item.length)
        planner_data[item.key] = item.path
    metadata = Metadata(state_dict_metadata, planner_data, storage_data, version=DCP_VERSION)
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
