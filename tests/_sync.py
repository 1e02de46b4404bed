"""Transition shim for the flat tests: the helpers moved to ``tests/helpers`` (removed with the layout)."""

from helpers.sync import main_thread_blocked, until

__all__ = ["main_thread_blocked", "until"]
