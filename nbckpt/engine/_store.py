"""Where checkpoints live, and how one commits: a local (or NFS) directory, or an fsspec URL.

Layout of a run directory::

    run1/
      .nbckpt.lock             held by the one writer (local only)
      step-000120/             committed: data files, .metadata, manifest.json (written last)
      .tmp-step-000140-ab12    a save being written; never counts
      .trash-step-000100-ab12  a checkpoint being deleted; never counts
      .old-step-000120-ab12    the previous copy of a step being saved again; put back by the
                               next open if the new copy never arrived

Exactly one spelling names a step: ``step-`` and at least six ASCII digits, with no extra
leading zeros (``step-000002``, ``step-1234567``); ``step-2`` or ``step-0000002`` never count.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
import uuid
from abc import ABC, abstractmethod
from typing import Any

from .. import _faults
from .._errors import CheckpointError, ConfigError, describe_error
from .._util import is_url, open_fsspec
from ._files import LocalSink, LocalSource, Sink, Source, StreamSink, StreamSource, with_filename

__all__ = [
    "LOCK_FILE",
    "MANIFEST",
    "FsspecStore",
    "LocalStore",
    "Store",
    "explain_fsspec_error",
    "fsync_dir",
    "open_store",
    "parse_step",
    "step_name",
    "where",
]

MANIFEST = "manifest.json"
LOCK_FILE = ".nbckpt.lock"
_log = logging.getLogger("nbckpt")
_STEP_RE = re.compile(r"step-([0-9]{6,})", re.ASCII)
_LEFTOVER_RE = re.compile(r"\.(tmp|trash|old)-(step-[0-9]{6,})-[0-9a-f]+", re.ASCII)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def parse_step(name: str) -> int | None:
    """The step a directory name stands for, or None (one canonical spelling per step)."""
    match = _STEP_RE.fullmatch(name)
    if match is None or step_name(int(match.group(1))) != name:
        return None
    return int(match.group(1))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise with_filename(exc, path) from None
    finally:
        os.close(fd)


class Store(ABC):
    """The storage primitives the engine needs; each subclass decides how a commit is atomic."""

    url: str
    is_local: bool = False

    @abstractmethod
    def prepare(self) -> None:
        """Create the root if needed and prove it is writable; CheckpointError if not."""

    def lock(self) -> None:  # noqa: B027 - object stores have no lock; local ones override
        """Stop a second writer on the same root (where the storage allows it)."""

    def unlock(self) -> None:  # noqa: B027
        """Release :meth:`lock`."""

    @abstractmethod
    def recover(self) -> list[str]:
        """Clean up after interrupted saves and deletes; return what was done, one phrase each."""

    @abstractmethod
    def committed(self) -> dict[int, str]:
        """Committed steps (those with a manifest) and their locations, oldest first."""

    @abstractmethod
    def begin(self, step: int, nonce: str) -> str:
        """A new, empty location the files of ``step`` are written to."""

    @abstractmethod
    def sink(self, location: str, name: str) -> Sink:
        """A new file ``name`` in ``location``."""

    @abstractmethod
    def source(self, location: str, name: str, size: int) -> Source:
        """File ``name`` of a checkpoint, which the manifest says has ``size`` bytes."""

    @abstractmethod
    def read_small(self, location: str, name: str, limit: int) -> bytes:
        """A whole small file (the manifest); CheckpointError if it is larger than ``limit``."""

    @abstractmethod
    def commit(self, location: str, step: int, manifest: bytes) -> str:
        """Write the manifest last and make ``location`` the committed ``step``; return its path."""

    @abstractmethod
    def discard(self, location: str) -> None:
        """Remove an uncommitted location (best effort: what stays never counts)."""

    @abstractmethod
    def delete(self, step: int) -> None:
        """Remove a committed checkpoint; it stops counting before any byte is deleted."""


class LocalStore(Store):
    """A POSIX directory (local disk, NFS, tmpfs): temp directory, fsync, rename, fsync parent."""

    is_local = True

    def __init__(self, root: str) -> None:
        self.url = os.path.abspath(os.path.expanduser(root))
        self._lock_fd: int | None = None

    def _path(self, name: str) -> str:
        return os.path.join(self.url, name)

    def prepare(self) -> None:
        if os.path.lexists(self.url) and not os.path.isdir(self.url):
            raise CheckpointError(f"{self.url} is not writable (it is a file, not a directory)")
        try:
            created = []
            path = self.url
            while not os.path.lexists(path):
                created.append(path)
                path = os.path.dirname(path)
            for directory in reversed(created):
                os.mkdir(directory)
                # A new directory exists for good only once its parent's entry is on disk.
                fsync_dir(os.path.dirname(directory))
            probe = LocalSink(self._path(f".nbckpt-probe-{uuid.uuid4().hex[:8]}"))
            try:
                probe.write(memoryview(b"nbckpt"))
                probe.sync()
            finally:
                probe.close()
                os.unlink(probe.path)
        except OSError as exc:
            raise CheckpointError(f"{self.url} is not writable ({exc.strerror or exc})") from exc

    def lock(self) -> None:
        import fcntl

        path = self._path(LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"cannot lock {path} ({exc.strerror})") from exc
            if holder == str(os.getpid()):
                raise CheckpointError(
                    f"{self.url} is in use by another Checkpointer in this process; close it "
                    "(ckpt.close()) or call nbckpt.close_all()"
                ) from exc
            raise CheckpointError(
                f"{self.url} is in use by another Checkpointer (pid {holder}); "
                "use a different directory or close the other one first"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fd, self._lock_fd = self._lock_fd, None
            os.close(fd)  # closing releases the flock

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.url)
        except FileNotFoundError:
            return []

    def recover(self) -> list[str]:
        done = []
        names = set(self._names())
        for name in sorted(names):
            match = _LEFTOVER_RE.fullmatch(name)
            if match is None:
                continue
            kind, step = match.groups()
            if kind == "old" and step not in names and self._has_manifest(self._path(name)):
                # A re-save was cut between moving the old copy out and the new one in.
                os.rename(self._path(name), self._path(step))
                fsync_dir(self.url)
                names.add(step)
                done.append(f"{name} (put back as {step})")
            else:
                self._remove(self._path(name))
                done.append(name)
        return done

    @staticmethod
    def _has_manifest(path: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(os.path.join(path, MANIFEST)).st_mode) and not os.path.islink(path)
        except OSError:
            return False

    @staticmethod
    def _remove(path: str) -> None:
        # A symlink is removed itself, never followed (rmtree refuses links, and would
        # otherwise report success and leave it).
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path)

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self._names():
            step = parse_step(name)
            if step is not None and self._has_manifest(self._path(name)):
                steps[step] = self._path(name)
        return dict(sorted(steps.items()))

    def begin(self, step: int, nonce: str) -> str:
        location = self._path(f".tmp-{step_name(step)}-{nonce}")
        if not os.path.isdir(self.url):  # removed under us: the next save brings it back
            self.prepare()
        os.mkdir(location)
        return location

    def sink(self, location: str, name: str) -> Sink:
        return LocalSink(os.path.join(location, name))

    def source(self, location: str, name: str, size: int) -> Source:
        return LocalSource(os.path.join(location, name), size)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        path = os.path.join(location, name)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointError(f"{name} is not a regular file")
            if info.st_size > limit:
                raise CheckpointError(f"{name} has {info.st_size} bytes, more than a manifest may ({limit})")
            data = os.pread(fd, limit + 1, 0)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise CheckpointError(f"{name} is larger than a manifest may be ({limit} bytes)")
        return data

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        sink = LocalSink(os.path.join(location, MANIFEST))
        try:
            sink.write(memoryview(manifest))
            sink.sync()
        finally:
            sink.close()
        fsync_dir(location)
        _faults.hit("before_rename")
        final = self._path(step_name(step))
        old = self._path(f".old-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        replaced = os.path.lexists(final)
        if replaced:
            self._swap_in(location, final, old)
        else:
            os.rename(location, final)
        try:
            fsync_dir(self.url)
        except OSError:
            self._withdraw(location, final, old if replaced else None)
            raise
        if replaced:
            _faults.hit("after_swap")
            self._remove(old)
        return final

    def _swap_in(self, location: str, final: str, old: str) -> None:
        """Make ``location`` the step at ``final``; the previous copy ends up at ``old``."""
        if _exchange(location, final):
            os.rename(location, old)  # ``location`` now holds the previous copy
            return
        os.rename(final, old)  # from here the next open puts ``old`` back if we stop
        _faults.hit("between_renames")
        try:
            os.rename(location, final)
        except OSError:
            os.rename(old, final)
            raise

    def _withdraw(self, location: str, final: str, old: str | None) -> None:
        """Undo a commit whose parent fsync failed, so the caller's "failed" matches the disk."""
        try:
            os.rename(final, location)
            if old is not None:
                os.rename(old, final)
        except OSError as exc:  # nothing more can be done here; the next open sorts it out
            _log.warning("nbckpt: could not withdraw %s after a failed fsync: %s", final, describe_error(exc))

    def discard(self, location: str) -> None:
        try:
            self._remove(location)
        except OSError as exc:
            _log.warning("nbckpt: could not remove %s: %s", location, describe_error(exc))

    def delete(self, step: int) -> None:
        trash = self._path(f".trash-{step_name(step)}-{uuid.uuid4().hex[:8]}")
        os.rename(self._path(step_name(step)), trash)
        fsync_dir(self.url)
        _faults.hit("during_delete")
        self._remove(trash)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically with Linux renameat2(RENAME_EXCHANGE).

    False only where the kernel or filesystem does not offer it; any other failure (a full
    disk, a lost server) is raised, not mistaken for "unsupported".
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), a, None, b)


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


#: Object stores nbckpt commits to; others (``memory://`` lives in this process only,
#: ``ftp://``/``zip://`` cannot hold a checkpoint safely) are refused up front.
OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


class FsspecStore(Store):
    """An object store through fsspec (``s3://``...): no rename, so the manifest is the commit."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self._protocol = self.url.split("://", 1)[0]
        if self._protocol not in OBJECT_STORES:
            raise ConfigError(
                f"{self._protocol}:// cannot hold checkpoints; use a directory or one of "
                + ", ".join(f"{p}://" for p in OBJECT_STORES)
            )
        self.storage_options = fsspec_options(self._protocol, storage_options)
        self.fs, root = open_fsspec(self.url, self.storage_options)
        self._root = root.rstrip("/")

    def _url(self, name: str) -> str:
        """A location: the full URL of ``name`` under the root (what records and errors show)."""
        return f"{self._protocol}://{self._root}/{name}"

    @staticmethod
    def _path(location: str) -> str:
        return location.split("://", 1)[-1]

    def prepare(self) -> None:
        probe = f"{self._root}/.nbckpt-probe-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.pipe_file(probe, b"nbckpt")
            self.fs.rm_file(probe)
        except Exception as exc:
            reason = explain_fsspec_error(exc, self._root)
            target = where(self.url, self.storage_options)
            raise CheckpointError(f"{target} is not writable ({reason})") from exc

    def _names(self) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def _has_manifest(self, name: str) -> bool:
        return bool(self.fs.exists(f"{self._root}/{name}/{MANIFEST}"))

    def recover(self) -> list[str]:
        done = []
        for name in sorted(self._names()):
            if parse_step(name) is not None and not self._has_manifest(name):
                self.discard(name)
                done.append(name)
        return done

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self._names():
            step = parse_step(name)
            if step is not None and self._has_manifest(name):
                steps[step] = self._url(name)
        return dict(sorted(steps.items()))

    def begin(self, step: int, nonce: str) -> str:
        if self.fs.exists(f"{self._root}/{step_name(step)}"):  # saving a step again: it stops counting first
            self.delete(step)
        return self._url(step_name(step))

    def sink(self, location: str, name: str) -> Sink:
        return StreamSink(self.fs, f"{self._path(location)}/{name}")

    def source(self, location: str, name: str, size: int) -> Source:
        return StreamSource(self.fs, f"{self._path(location)}/{name}", size)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        path = f"{self._path(location)}/{name}"
        size = int(self.fs.info(path)["size"])
        if size > limit:
            raise CheckpointError(f"{name} has {size} bytes, more than a manifest may ({limit})")
        return bytes(self.fs.cat_file(path))

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        _faults.hit("before_rename")
        self.fs.pipe_file(f"{self._path(location)}/{MANIFEST}", manifest)
        return location

    def discard(self, location: str) -> None:
        # Best effort: it runs after a failed save, when the endpoint may be down; what it
        # leaves has no manifest, never counts, and goes at the next open.
        path = self._path(location) if "://" in location else f"{self._root}/{location}"
        try:
            self.fs.rm(path, recursive=True)
        except Exception as exc:
            _log.warning("nbckpt: could not remove %s: %s", path, describe_error(exc))

    def delete(self, step: int) -> None:
        path = f"{self._root}/{step_name(step)}"
        self.fs.rm_file(f"{path}/{MANIFEST}")
        _faults.hit("during_delete")
        self.fs.rm(path, recursive=True)


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> Store:
    if is_url(url):
        return FsspecStore(url, storage_options)
    return LocalStore(url.removeprefix("file://"))
