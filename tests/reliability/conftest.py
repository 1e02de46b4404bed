"""Fixtures the reliability tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hostile import two_steps


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run of two committed steps (see :func:`helpers.hostile.two_steps`)."""
    return two_steps(tmp_path / "run")
