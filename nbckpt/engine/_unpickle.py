"""Reading pickles of others safely: DCP's ``.metadata`` with an allow-list of DCP's own classes,
``torch.save`` blobs with weights only, and plain values with no global at all.

Nothing here runs code a file names: a global outside the allow-list is refused before it is
looked up, so a hostile checkpoint is a CheckpointError, never an exploit.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .._errors import CheckpointError, describe_error
from ._torch_compat import STORAGE_INFO_GLOBAL

__all__ = ["MetadataUnpickler", "load_blob", "plain_blob"]


# Everything DCP's .metadata legitimately pickles; any other global is refused.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    STORAGE_INFO_GLOBAL, ("torch.distributed.checkpoint.planner", "WriteItemType"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("torch", "strided"),
    ("torch", "device"), ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch sizes and dtypes; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_blob(data: bytes, what: str) -> Any:
    """A ``torch.save`` blob loaded with weights only (no pickle runs); CheckpointError if refused."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:
        raise CheckpointError(f"{what} does not load with weights only ({describe_error(exc)})") from None


#: The records of a ``torch.save`` zip that holds no storage.
_BLOB_RECORDS = {"data.pkl", ".format_version", ".storage_alignment", "byteorder", "version",
                 ".data/serialization_id"}


class _PlainUnpickler(pickle.Unpickler):
    """Plain Python values only: any global or storage reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refusing a storage in a plain value")


def plain_blob(data: bytes, what: str) -> Any:
    """The value a ``torch.save`` blob of a plain value holds, read without running any pickle."""
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = archive.namelist()
            prefix = names[0].split("/", 1)[0] if names else ""
            records = [n.removeprefix(f"{prefix}/") for n in names]
            if (
                len(set(records)) != len(records)
                or not set(records) <= _BLOB_RECORDS
                or "data.pkl" not in records
            ):
                raise CheckpointError(f"{what} is not a plain value's blob (records {records})")
            if archive.read(f"{prefix}/byteorder") != b"little":
                raise CheckpointError(f"{what} is not little-endian")
            return _PlainUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl"))).load()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"{what} is unreadable ({describe_error(exc)})") from None
