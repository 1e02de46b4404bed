"""DCP storage writers that checksum while they write, and readers that never run pickled code."""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import xxhash
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from ._errors import CheckpointError

METADATA_FILE = ".metadata"


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/run``; ``file://`` counts as local."""
    return "://" in path and not path.startswith("file://")


def new_hasher() -> Any:
    return xxhash.xxh3_64()


class _HashingStream(io.RawIOBase):
    """Write-through wrapper that hashes and counts every byte written."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._hasher = new_hasher()
        self._size = 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._inner.write(view)
        except BaseException as exc:
            # torch.save turns this into a RuntimeError without errno; keep the real cause.
            self.error = exc
            raise
        # A raw stream may write less than asked: hash exactly what reached the file.
        count = len(view) if written is None else int(written)
        self._hasher.update(view[:count])
        self._size += count
        return count

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return int(self._inner.fileno())

    def flush(self) -> None:
        self._inner.flush()

    def close(self) -> None:
        # DCP closes the per-item transform stream, which is this one: only the
        # real close from create_stream may finish the file.
        pass

    def finish(self) -> tuple[int, str]:
        return self._size, self._hasher.hexdigest()


class HashingFileSystem(FileSystemBase):
    """Delegates to a DCP filesystem and records (size, xxh3) of every file it writes."""

    def __init__(self, inner: FileSystemBase, *, fsync: bool) -> None:
        self.inner = inner
        self.fsync = fsync
        self._lock = threading.Lock()
        self.files: dict[str, tuple[int, str]] = {}
        self.fsyncs: list[tuple[int, int, str]] = []
        self.errors: list[BaseException] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        hashing: _HashingStream | None = None
        try:
            with self.inner.create_stream(path, mode) as raw:
                hashing = _HashingStream(raw)
                yield hashing  # type: ignore[misc]
                raw.flush()
                if self.fsync:
                    start = time.perf_counter_ns()
                    os.fsync(raw.fileno())
                    with self._lock:
                        self.fsyncs.append((start, time.perf_counter_ns(), name))
        except Exception as exc:
            # torch.save turns a write error into a RuntimeError without errno, and DCP's
            # extra writer threads only print theirs: keep the real one, with the path.
            error = hashing.error if hashing is not None and hashing.error is not None else exc
            if isinstance(error, OSError) and error.filename is None:
                error.filename = os.fspath(path)
            with self._lock:
                self.errors.append(error)
            raise
        assert hashing is not None
        with self._lock:
            self.files[name] = hashing.finish()

    def first_error(self) -> BaseException | None:
        """The first error any writer thread hit (DCP itself may not have raised it)."""
        with self._lock:
            return self.errors[0] if self.errors else None

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str | os.PathLike[str]:
        return self.inner.concat_path(path, suffix)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        self.inner.rename(path, new_path)
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        with self._lock:
            if old in self.files:
                self.files[new] = self.files.pop(old)

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        return self.inner.init_path(path)

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.inner.rm_file(path)


def hashing_writer(path: str, *, threads: int, storage_options: dict[str, Any] | None) -> Any:
    """A DCP writer for ``path`` (local directory or fsspec URL) whose ``fs`` hashes every file."""
    # DCP's own fsync is off: HashingFileSystem fsyncs local files itself so it can time them.
    writer: FileSystemWriter
    if is_url(path):
        writer = FsspecWriter(path, thread_count=threads, sync_files=False, **(storage_options or {}))
    else:
        writer = FileSystemWriter(path, thread_count=threads, sync_files=False, overwrite=False)
    writer.fs = HashingFileSystem(writer.fs, fsync=not is_url(path))  # type: ignore[assignment]
    return writer


# Everything DCP's .metadata legitimately pickles; any other global is refused.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("torch", "strided"),
    ("torch", "device"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def load_metadata(stream: Any, where: str) -> Metadata:
    """Unpickle DCP metadata allowing only DCP's own classes; every entry must be a tensor."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except Exception as exc:
        raise CheckpointError(f"{where}: unsafe or unreadable DCP metadata ({exc})") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: DCP metadata is a {type(metadata).__name__}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{where}: entry {key!r} is not a tensor; refusing to unpickle it")
    return metadata


class _SafeMetadataMixin:
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))  # type: ignore[attr-defined]
        with self.fs.create_stream(path, "rb") as stream:  # type: ignore[attr-defined]
            metadata = load_metadata(stream, os.fspath(path))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[attr-defined]
        return metadata


class SafeFileSystemReader(_SafeMetadataMixin, FileSystemReader):
    pass


class SafeFsspecReader(_SafeMetadataMixin, FsspecReader):
    pass


def safe_reader(path: str, storage_options: dict[str, Any] | None) -> Any:
    if is_url(path):
        return SafeFsspecReader(path, **(storage_options or {}))
    return SafeFileSystemReader(path)
