"""The engine's named fault seams (``nbckpt.engine._faults``), for the tests of the layers above
it, which may not import the engine's private modules themselves."""

from __future__ import annotations

from nbckpt.engine._faults import POINTS, armed

__all__ = ["POINTS", "armed"]
