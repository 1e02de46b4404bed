"""Which store a location names: a local directory (or ``file://`` URL), or an object store
(any other fsspec URL). Above both stores, so that neither needs to know the other."""

from __future__ import annotations

from typing import Any

from .._util import check_path, is_url
from ._object_store import FsspecStore
from ._store import LocalStore, Store

__all__ = ["open_store"]


def open_store(url: str, storage_options: dict[str, Any] | None = None, what: str = "directory") -> Store:
    """The store for a directory (or ``file://`` URL) or an fsspec URL; ConfigError for a path
    that can name nothing (empty, ``file://`` alone, a NUL)."""
    url = check_path(url, what)
    if is_url(url):
        return FsspecStore(url, storage_options)
    return LocalStore(url.removeprefix("file://"))
