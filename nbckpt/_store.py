"""Transition shim: the stores moved to :mod:`nbckpt.engine` (removed with the package layout)."""

from .engine._object_store import endpoint, explain_fsspec_error, fsspec_options, where
from .engine._store import fsync_dir, open_store, step_name

__all__ = [
    "endpoint",
    "explain_fsspec_error",
    "fsspec_options",
    "fsync_dir",
    "open_store",
    "step_name",
    "where",
]
