"""Every use of a private torch API in nbckpt, in one place, checked against torch 2.13.0 and
2.14.1: if an upgrade breaks one, this module is the only one to change."""

from __future__ import annotations

import io
from typing import Any

import torch

# DCP's FileSystemReader looks each item up in ``Metadata.storage_data`` and expects this
# dataclass (relative path, offset, length) there: nbckpt writes DCP's format itself, so it
# has to build the same records. It is pickled by its qualified name
# ``torch.distributed.checkpoint.filesystem._StorageInfo``.
from torch.distributed.checkpoint.filesystem import _StorageInfo

__all__ = [
    "STORAGE_INFO_GLOBAL",
    "default_store",
    "dtensor_spec",
    "missing",
    "own_connection",
    "pickle_record",
    "storage_info",
    "torch_archive_records",
    "version_of",
]

#: The (module, name) under which DCP's metadata pickle refers to :func:`storage_info` records.
STORAGE_INFO_GLOBAL = ("torch.distributed.checkpoint.filesystem", "_StorageInfo")


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's record of where one item's bytes are: a file of the step and a byte range in it."""
    return _StorageInfo(relative_path, offset, length)


def default_store() -> Any:
    """The key-value store of the default process group (``_get_default_store``, stable since
    torch 1.8), or None: nbckpt sees in it, with a deadline, whether every rank arrived."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # another backend or a future torch: the group setup's own timeout applies
        return None


def own_connection(store: Any) -> Any | None:
    """A client of ``store`` with a connection of its own (``Store.clone``, public since torch
    2.6), or None where the store cannot make one. A TCPStore client runs one request at a time:
    a thread blocked in its ``wait`` holds up every other thread's ``set`` on the same client."""
    try:
        return store.clone()
    except Exception:  # a store without clone (a custom one): the caller decides what to do
        return None


def dtensor_spec(tensor: Any) -> Any:
    """A DTensor's ``_spec`` (mesh, placements and shape: hashable, the same object every save;
    stable since 2.4), the key of the cache of each DTensor's chunk."""
    return tensor._spec


def version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (``_version``: bumped by every in-place op autograd sees,
    shared by ``detach()`` views; stable since 0.4), or None where it keeps none (an inference
    tensor). It is a hint that a tensor changed, never proof that it did not: writes through
    ``.data``, through NumPy, and torch 2.13's fused AdamW on CPU leave it unchanged."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def pickle_record(blob: bytes) -> bytes:
    """The ``data.pkl`` record of a ``torch.save`` zip, read by the zip reader ``torch.load`` uses
    (``torch._C.PyTorchFileReader``, stable since 1.6): the very pickle it would unpickle."""
    return bytes(torch._C.PyTorchFileReader(io.BytesIO(blob)).get_record("data.pkl"))


def torch_archive_records(data: bytes) -> dict[str, bytes]:
    """Every record of a ``torch.save`` archive as torch's own reader reads it
    (``torch._C.PyTorchFileReader``, what ``torch.load`` and so a plain ``dcp.load`` use; stable
    since 1.6): zip parsing only, nothing unpickled. An archive it refuses (its zip headers are
    stricter than Python's ``zipfile``) raises here too, so nbckpt never reads a value that a
    plain ``dcp.load`` of the same bytes would fail on."""
    import io

    import torch

    reader = torch._C.PyTorchFileReader(io.BytesIO(data))
    return {name: reader.get_record(name) for name in reader.get_all_records()}


def _reads_archives() -> bool:
    blob = io.BytesIO()
    torch.save({"x": 1}, blob)
    try:
        return torch_archive_records(blob.getvalue()).get("data.pkl") == pickle_record(blob.getvalue())
    except (AttributeError, RuntimeError, TypeError):
        return False


def missing() -> list[str]:
    """The private torch names above that this torch lacks or changed (none: all is well); a
    change in any of them would otherwise show as a refused step or a missed fault, far away."""
    import dataclasses

    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import DTensor

    fields = (
        [field.name for field in dataclasses.fields(_StorageInfo)]
        if dataclasses.is_dataclass(_StorageInfo)
        else []
    )
    found = {
        # pickled by this name into every .metadata nbckpt writes; its first three fields positional
        "distributed.checkpoint.filesystem._StorageInfo": (_StorageInfo.__module__, _StorageInfo.__qualname__)
        == STORAGE_INFO_GLOBAL
        and fields[:3] == ["relative_path", "offset", "length"],
        "distributed.distributed_c10d._get_default_store": callable(
            getattr(distributed_c10d, "_get_default_store", None)
        ),
        "distributed.tensor.DTensor._spec": "_spec" in getattr(DTensor, "__slots__", ()),
        "Tensor._version": isinstance(getattr(torch.zeros(1), "_version", None), int),
        "_C.PyTorchFileReader": _reads_archives(),
    }
    return [f"torch {torch.__version__}: torch.{name}" for name, ok in found.items() if not ok]
