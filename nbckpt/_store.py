"""Where checkpoints live: a local (or NFS) directory, or an fsspec URL such as ``s3://``.

Layout of a checkpoint directory::

    run1/
      .nbckpt.lock          held by the one writer (local only)
      step-000120/          committed: DCP files + manifest.json (written last)
      .tmp-step-000140-ab12 being written (local only); never counts
      .trash-step-000100-ab12 being deleted by retention; never counts
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO, Any

from ._dcp import hashing_writer, is_url, safe_reader
from ._errors import CheckpointError, describe_error

MANIFEST = "manifest.json"
LOCK_FILE = ".nbckpt.lock"
_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^\.(tmp|trash)-step-\d+-[0-9a-f]+$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is out: on a nearly full disk one call may write only part."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Store(ABC):
    """Storage primitives the engine needs; subclasses decide how commit is made atomic."""

    url: str
    storage_options: dict[str, Any]

    @abstractmethod
    def prepare(self) -> None:
        """Create the root if needed and prove it is writable; raise CheckpointError if not."""

    def lock(self) -> None:  # noqa: B027 - object stores have no lock; local ones override
        """Stop a second writer on the same root (where the storage allows it)."""

    def unlock(self) -> None:  # noqa: B027
        """Release :meth:`lock`."""

    @abstractmethod
    def stale(self) -> list[str]:
        """Leftovers of interrupted saves or deletes: names under the root."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove a leftover or a checkpoint location, recursively."""

    @abstractmethod
    def begin(self, step: int, nonce: str) -> str:
        """Where the data of a new checkpoint is written (the writer's path)."""

    @abstractmethod
    def commit(self, location: str, step: int, manifest: bytes) -> str:
        """Write the manifest last and make ``location`` the committed ``step``; return its path."""

    @abstractmethod
    def delete(self, step: int, nonce: str) -> None:
        """Remove a committed checkpoint so that it stops counting before any byte is deleted."""

    @abstractmethod
    def committed(self) -> dict[int, str]:
        """Committed steps (those with a manifest) and their paths."""

    @abstractmethod
    def open(self, location: str, name: str) -> Any:
        """A binary read stream of file ``name`` in a checkpoint (a context manager)."""

    @abstractmethod
    def list_files(self, location: str) -> dict[str, int]:
        """The files of a checkpoint and their sizes."""

    def writer(self, location: str, threads: int) -> Any:
        return hashing_writer(location, threads=threads, storage_options=self.storage_options)

    def reader(self, location: str) -> Any:
        return safe_reader(location, self.storage_options)


class LocalStore(Store):
    """A POSIX directory (local disk, NFS, tmpfs): temp directory, fsync, rename, fsync parent."""

    def __init__(self, root: str) -> None:
        self.url = os.path.abspath(os.path.expanduser(root))
        self.storage_options = {}
        self._lock_fd: int | None = None

    def prepare(self) -> None:
        if os.path.exists(self.url) and not os.path.isdir(self.url):
            raise CheckpointError(f"{self.url} is not writable (it is a file, not a directory)")
        probe = os.path.join(self.url, f".nbckpt-probe-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(self.url, exist_ok=True)
            fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
            try:
                os.write(fd, b"nbckpt")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise CheckpointError(f"{self.url} is not writable ({exc.strerror or exc})") from exc

    def lock(self) -> None:
        import fcntl

        path = os.path.join(self.url, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(
                    f"{self.url} is in use by another Checkpointer (pid {holder}); "
                    "use a different directory or close the other one first"
                ) from exc
            raise CheckpointError(f"cannot lock {path} ({exc.strerror})") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.url)
        except FileNotFoundError:
            return []

    def stale(self) -> list[str]:
        return sorted(n for n in self._names() if _STALE_RE.match(n))

    def remove(self, name: str) -> None:
        shutil.rmtree(os.path.join(self.url, os.path.basename(name)), ignore_errors=True)

    def begin(self, step: int, nonce: str) -> str:
        location = os.path.join(self.url, f".tmp-{step_name(step)}-{nonce}")
        os.makedirs(location)
        return location

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        path = os.path.join(location, MANIFEST)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644)
        try:
            write_all(fd, manifest)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(location)
        from . import _faults

        _faults.hit("before_rename")
        final = os.path.join(self.url, step_name(step))
        if os.path.exists(final):  # saving a step again replaces it
            self._replace(location, final, step)
        else:
            os.rename(location, final)
        fsync_dir(self.url)
        return final

    def _replace(self, location: str, final: str, step: int) -> None:
        """Swap a new copy of a step in atomically where the kernel can; else old out, new in."""
        trash = os.path.join(self.url, f".trash-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        if _exchange(location, final):
            os.rename(location, trash)  # ``location`` now holds the old copy
        else:
            os.rename(final, trash)  # a crash before the next rename loses this step only
            os.rename(location, final)
        fsync_dir(self.url)
        shutil.rmtree(trash, ignore_errors=True)

    def delete(self, step: int, nonce: str) -> None:
        from . import _faults

        trash = os.path.join(self.url, f".trash-{step_name(step)}-{nonce}")
        os.rename(os.path.join(self.url, step_name(step)), trash)
        fsync_dir(self.url)
        _faults.hit("during_delete")
        shutil.rmtree(trash)

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self._names():
            match = _STEP_RE.match(name)
            path = os.path.join(self.url, name)
            if match and os.path.isfile(os.path.join(path, MANIFEST)):
                steps[int(match.group(1))] = path
        return dict(sorted(steps.items()))

    @contextmanager
    def open(self, location: str, name: str) -> Iterator[IO[bytes]]:
        with open(os.path.join(location, name), "rb") as stream:
            yield stream

    def list_files(self, location: str) -> dict[str, int]:
        return {
            entry.name: entry.stat().st_size for entry in os.scandir(location) if entry.is_file()
        }


class FsspecStore(Store):
    """An object store through fsspec (``s3://``...): no rename, so the manifest is the commit."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self._protocol = self.url.split("://", 1)[0]
        self.storage_options = fsspec_options(self._protocol, storage_options)
        try:
            self.fs, self._root = url_to_fs(self.url, **self.storage_options)
        except (ImportError, ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot open {self.url}: {describe_error(exc)}") from exc

    def _url(self, path: str) -> str:
        return f"{self._protocol}://{path}"

    def _where(self) -> str:
        return where(self.url, self.storage_options)

    def prepare(self) -> None:
        probe = f"{self._root}/.nbckpt-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.pipe_file(probe, b"nbckpt")
            self.fs.rm_file(probe)
        except Exception as exc:
            raise CheckpointError(
                f"{self._where()} is not writable ({explain_fsspec_error(exc, self._root)})"
            ) from exc

    def _names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        return [os.path.basename(str(e).rstrip("/")) for e in entries]

    def stale(self) -> list[str]:
        names = self._names()
        return sorted(
            n for n in names
            if _STEP_RE.match(n) and not self.fs.exists(f"{self._root}/{n}/{MANIFEST}")
        )

    def remove(self, name: str) -> None:
        # Best effort, like LocalStore: it runs after a failed save, when the endpoint may be
        # down; what it leaves has no manifest, never counts, and goes at the next open.
        path = f"{self._root}/{os.path.basename(name.rstrip('/'))}"
        with suppress(Exception):
            self.fs.rm(path, recursive=True)

    def begin(self, step: int, nonce: str) -> str:
        path = f"{self._root}/{step_name(step)}"
        if self.fs.exists(path):  # saving a step again: it stops counting first
            self.delete(step, nonce)
        return self._url(path)

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        from . import _faults

        _faults.hit("before_rename")
        self.fs.pipe_file(f"{self._root}/{step_name(step)}/{MANIFEST}", manifest)
        return location

    def delete(self, step: int, nonce: str) -> None:
        from . import _faults

        path = f"{self._root}/{step_name(step)}"
        self.fs.rm_file(f"{path}/{MANIFEST}")
        _faults.hit("during_delete")
        self.fs.rm(path, recursive=True)

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self._names():
            match = _STEP_RE.match(name)
            if match and self.fs.exists(f"{self._root}/{name}/{MANIFEST}"):
                steps[int(match.group(1))] = self._url(f"{self._root}/{name}")
        return dict(sorted(steps.items()))

    def open(self, location: str, name: str) -> Any:
        return self.fs.open(f"{location.split('://', 1)[1]}/{name}", "rb")

    def list_files(self, location: str) -> dict[str, int]:
        self.fs.invalidate_cache()
        entries = self.fs.ls(location.split("://", 1)[1], detail=True)
        return {os.path.basename(e["name"]): int(e["size"]) for e in entries if e["type"] == "file"}


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result: int = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return result == 0


# botocore's "legacy" retry mode makes 5 attempts per request and s3fs retries timeouts
# another 5 times on top: a hung endpoint would stall a save for many minutes. "standard"
# mode with 3 attempts still rides out a brief outage; storage_options config_kwargs override it.
S3_DEFAULT_RETRIES = {"max_attempts": 3, "mode": "standard"}


def fsspec_options(protocol: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """``storage_options`` plus nbckpt's defaults for the protocol (bounded retries for S3)."""
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", dict(S3_DEFAULT_RETRIES))
        options["config_kwargs"] = config
    return options


def endpoint(storage_options: dict[str, Any]) -> str | None:
    """The S3 endpoint that will be used: storage options first, then the AWS environment."""
    client_kwargs = storage_options.get("client_kwargs") or {}
    return (
        storage_options.get("endpoint_url")
        or client_kwargs.get("endpoint_url")
        or os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
    )


def where(url: str, storage_options: dict[str, Any]) -> str:
    """``url`` with the endpoint it goes to, for error messages."""
    at = endpoint(storage_options)
    return f"{url} (endpoint {at})" if at else url


def explain_fsspec_error(exc: BaseException, path: str) -> str:
    """One line for an object-store error, saying what to check for the common ones."""
    text = describe_error(exc)
    if isinstance(exc, PermissionError):
        return (
            f"access denied, {text}; check the key and secret (storage_options key/secret "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket's permissions"
        )
    if isinstance(exc, FileNotFoundError):
        return f"bucket {path.split('/', 1)[0]!r} does not exist"
    return text


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    if is_url(url):
        return FsspecStore(url, storage_options)
    return LocalStore(url.removeprefix("file://"))
