"""Test helpers shared by every layer's tests (a package: ``from helpers.sync import until``)."""

from pathlib import Path

#: The repository's root (notebooks/, scripts/, docs/ are under it).
ROOT = Path(__file__).resolve().parents[2]
