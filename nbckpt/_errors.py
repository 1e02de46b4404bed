"""Exceptions raised by nbckpt; every one derives from :class:`NbckptError`."""

from __future__ import annotations


class NbckptError(Exception):
    """Base class of every error nbckpt raises on purpose."""


class CheckpointError(NbckptError):
    """A checkpoint could not be saved, committed, verified or restored.

    Errors from background work (staging, persisting, committing) are re-raised
    as this type from the next ``save``, ``wait`` or ``close``, with the
    original exception chained as ``__cause__``.
    """


class ConfigError(NbckptError, ValueError):
    """An argument or parameter given by the user is invalid."""
