"""Transition shim: ``is_url`` moved to :mod:`nbckpt._util` (removed with the package layout)."""

from ._util import is_url

__all__ = ["is_url"]
