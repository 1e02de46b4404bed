"""Transition shim: the stores moved to :mod:`nbckpt.engine` (removed with the package layout)."""

from .engine._store import (
    endpoint,
    explain_fsspec_error,
    fsspec_options,
    fsync_dir,
    open_store,
    step_name,
    where,
)

__all__ = ["endpoint", "explain_fsspec_error", "fsspec_options", "fsync_dir", "open_store", "step_name", "where"]
