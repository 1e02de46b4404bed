"""Load for tests that measure on a busy machine: another process that keeps a core busy."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .sync import until

__all__ = ["spinning_core"]

_SPIN = "import sys; print('spinning', flush=True)\nwhile True: pass"


@contextmanager
def spinning_core() -> Iterator[subprocess.Popen[str]]:
    """A Python process that spins at the caller's priority until the block ends (it is ended
    by its own handle, whatever the block raised)."""
    spinner = subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE, text=True)
    try:
        assert spinner.stdout is not None
        assert spinner.stdout.readline().strip() == "spinning"  # it runs: the load is on
        assert until(lambda: spinner.poll() is None, timeout=1.0)
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()
