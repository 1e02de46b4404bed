"""Checkpoints in an object store through fsspec (``s3://``...): no rename, so the manifest,
written last, is the commit; and the errors an object store gives, explained in one line."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any

from .._errors import CheckpointError, ConfigError, describe_error, require_extra
from ._faults import fault_point
from ._files import Sink, Source, StreamSink, StreamSource
from ._format import MANIFEST, METADATA_FILE, PROBE_PREFIX, parse_step, step_name
from ._store import Store, crash_point

__all__ = ["FsspecStore", "endpoint", "explain_fsspec_error", "fsspec_options", "open_fsspec", "where"]

_log = logging.getLogger("nbckpt")


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
        probe = f"{self._root}/{PROBE_PREFIX}{uuid.uuid4().hex[:8]}"
        try:
            self.fs.pipe_file(probe, b"nbckpt")
            self.fs.rm_file(probe)
        except Exception as exc:
            reason = explain_fsspec_error(exc, self._root)
            target = where(self.url, self.storage_options)
            raise CheckpointError(f"{target} is not writable ({reason})") from exc

    def names(self) -> list[str]:
        fault_point("store.names", self.url)
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self._root, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:  # no credentials, access denied, no endpoint: one line
            reason = explain_fsspec_error(exc, self._root)
            raise CheckpointError(f"cannot list {where(self.url, self.storage_options)} ({reason})") from exc
        return [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def child(self, name: str) -> FsspecStore:
        return FsspecStore(f"{self.url}/{name}", self.storage_options)  # an object store has no links

    def _has_manifest(self, name: str) -> bool:
        return bool(self.fs.exists(f"{self._root}/{name}/{MANIFEST}"))

    def recover(self) -> list[str]:
        done = []
        for name in sorted(self.names()):
            if parse_step(name) is not None and not self._has_manifest(name):
                self.discard(name)
                done.append(name)
        return done

    def committed(self) -> dict[int, str]:
        steps = {}
        for name in self.names():
            step = parse_step(name)
            if step is not None and self._has_manifest(name):
                steps[step] = self._url(name)
        return dict(sorted(steps.items()))

    def committed_at(self, step: int) -> str | None:
        name = step_name(step)
        self.fs.invalidate_cache(f"{self._root}/{name}")  # another writer may have committed it
        return self._url(name) if self._has_manifest(name) else None

    def modified(self, location: str, name: str) -> float:
        info = self.fs.info(f"{self._path(location)}/{name}")
        stamp = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
        return float(stamp.timestamp()) if hasattr(stamp, "timestamp") else float(stamp)

    def write_small(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self._root}/{name}", data)  # an object appears whole or not at all

    def begin(self, step: int, nonce: str) -> str:
        if self.fs.exists(f"{self._root}/{step_name(step)}"):  # saving a step again: it stops counting first
            self.delete(step)
        return self._url(step_name(step))

    def sink(self, location: str, name: str) -> Sink:
        return StreamSink(self.fs, f"{self._path(location)}/{name}")

    def source(self, location: str, name: str, size: int | None) -> Source:
        return StreamSource(self.fs, f"{self._path(location)}/{name}", size)

    def read_small(self, location: str, name: str, limit: int) -> bytes:
        path = f"{self._path(location)}/{name}"
        size = int(self.fs.info(path)["size"])
        if size > limit:
            raise CheckpointError(f"{name} has {size} bytes, more than a manifest may ({limit})")
        return bytes(self.fs.cat_file(path))

    def commit(self, location: str, step: int, manifest: bytes) -> str:
        crash_point("before_rename")
        self.fs.pipe_file(f"{self._path(location)}/{MANIFEST}", manifest)
        return location

    def share(self, source: str, location: str, name: str) -> None:
        # CopyObject (s3fs copies objects over 5 GB in parts, still server-side): no bytes pass
        # through this process, and the new step's object is its own.
        self.fs.copy(f"{self._path(source)}/{name}", f"{self._path(location)}/{name}")

    def remove_small(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{self._root}/{name}")

    def move(self, name: str, into: Store) -> None:
        # No rename: every object is copied server-side, the commit marker last, so the copy
        # counts only once whole; then the source's marker goes first, so it stops counting
        # before its files go. A crash in between leaves two whole copies: the next open's
        # finish copies again (the same bytes) and deletes the source.
        assert isinstance(into, FsspecStore)
        source = f"{self._root}/{name}"
        self.fs.invalidate_cache(source)
        try:
            found = [str(path)[len(source) + 1 :] for path in self.fs.find(source)]
        except FileNotFoundError:
            found = []
        if not found:
            return
        markers = [n for n in (MANIFEST, METADATA_FILE) if n in found]
        for relative in [n for n in found if n not in markers] + markers:
            self.fs.copy(f"{source}/{relative}", f"{into._root}/{name}/{relative}")
        crash_point("set_aside_copied")
        for marker in markers:
            self.fs.rm_file(f"{source}/{marker}")
        self.fs.rm(source, recursive=True)
        self.fs.invalidate_cache(source)

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
        crash_point("during_delete")
        self.fs.rm(path, recursive=True)


def open_fsspec(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(filesystem, path)`` for an fsspec URL; ConfigError in one line when it cannot be opened."""
    if url.partition("://")[0] in ("s3", "s3a"):
        require_extra("an s3:// directory")
    from fsspec.core import url_to_fs

    try:
        fs, path = url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot open {url}: {type(exc).__name__}: {exc}".splitlines()[0]) from None
    return fs, str(path)


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
    if any(type(cause).__name__ == "NoCredentialsError" for cause in _causes(exc)):  # botocore's
        return (
            "no credentials found; give a key and secret (storage_options key/secret, or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        )
    if isinstance(exc, PermissionError):
        return (
            f"access denied, {text}; check the key and secret (storage_options key/secret "
            "or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the bucket's permissions"
        )
    if isinstance(exc, FileNotFoundError):
        return f"bucket {path.split('/', 1)[0]!r} does not exist"
    return text


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it was raised from (s3fs wraps botocore's errors), at most 8 deep."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain
