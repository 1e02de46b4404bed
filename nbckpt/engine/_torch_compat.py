"""Every use of a private torch API in nbckpt, in one place, with the versions it was checked on.

Checked against torch 2.13.0 and 2.14.1. If an upgrade breaks one of these, this module is
the only one to change, and ``tests/engine/test_layout.py`` (the plain ``dcp.load`` round
trip) is the test that says so.
"""

from __future__ import annotations

from typing import Any

# DCP's FileSystemReader looks each item up in ``Metadata.storage_data`` and expects this
# dataclass (relative path, offset, length) there: nbckpt writes DCP's format itself, so it
# has to build the same records. It is pickled by its qualified name
# ``torch.distributed.checkpoint.filesystem._StorageInfo``.
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = ["STORAGE_INFO_GLOBAL", "default_store", "dtensor_spec", "storage_info"]

#: The (module, name) under which DCP's metadata pickle refers to :func:`storage_info` records.
STORAGE_INFO_GLOBAL = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one item's bytes are: a file of the step and a byte range in it."""
    return _StorageInfo(relative_path, offset, length)


def default_store() -> Any:
    """The key-value store of the default process group (where the ranks first met), or None.

    Private in torch (``distributed_c10d._get_default_store``) and stable since torch 1.8;
    nbckpt uses it only to see, with a deadline, whether every rank arrived.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # another backend or a future torch: the group setup's own timeout applies
        return None


def dtensor_spec(tensor: Any) -> Any:
    """A DTensor's spec (its mesh, placements and shape: hashable, the same object every save).

    Private in torch (``DTensor._spec``), stable since DTensor became public (2.4); nbckpt keys
    the cache of each DTensor's chunk by it.
    """
    return tensor._spec
