"""Published checkpointing figures that results are compared with, each with its source: the one
copy is the package data file ``nbckpt/analysis/data/published.json``."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SOURCE_PATH", "cite", "load_published", "published_table"]

#: The file, inside the package.
SOURCE_PATH = Path(__file__).resolve().parent / "data" / "published.json"


@cache
def _load() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SOURCE_PATH.read_text("utf-8"))
    return data


def load_published() -> dict[str, Any]:
    """The published figures: ``{"schema", "description", "anchors": {id: entry}}``, a copy.

    Each entry has ``what``, ``compares`` (what the figure sets against what, so that only
    like is set beside like), ``values`` (name -> ``{"value", "units"[, "qualifier"]}``), an
    optional ``quote`` (the source's own words) and ``source`` (``title``, ``venue``, ``date``,
    ``url``).
    """
    return copy.deepcopy(_load())


def cite(anchor: str) -> str:
    """A one-line citation: ``title (venue, date) url``."""
    anchors = _load()["anchors"]
    if anchor not in anchors:
        raise ConfigError(f"no published anchor {anchor!r}; known: {', '.join(sorted(anchors))}")
    source = anchors[anchor]["source"]
    where = ", ".join(str(part) for part in (source.get("venue"), source.get("date")) if part)
    url = f" {source['url']}" if source.get("url") else ""
    return f"{source['title']} ({where}){url}"


def published_table() -> pd.DataFrame:
    """One row per published value: anchor, what, compares, quantity, value, units, qualifier, source."""
    import pandas as pd

    rows = [
        {
            "anchor": anchor,
            "what": entry["what"],
            "compares": entry.get("compares", ""),
            "quantity": name,
            "value": item["value"],
            "units": item["units"],
            "qualifier": item.get("qualifier", ""),
            "source": cite(anchor),
        }
        for anchor, entry in _load()["anchors"].items()
        for name, item in entry["values"].items()
    ]
    return pd.DataFrame(rows)
