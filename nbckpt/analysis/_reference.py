"""Published checkpointing figures that results are compared with, each with its source.

The one copy is ``nbckpt/analysis/data/published.json`` (package data, so an installed
nbckpt finds it too).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, NbckptError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["SOURCE_PATH", "cite", "load_published", "published_table", "published_value"]

#: The file, inside the package.
SOURCE_PATH = Path(__file__).resolve().parent / "data" / "published.json"


@lru_cache(maxsize=1)
def _load_default() -> dict[str, Any]:
    try:
        package = resources.files(__package__ or "nbckpt.analysis")
        text = package.joinpath("data/published.json").read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise NbckptError(f"published.json not found in the nbckpt package ({exc})") from exc
    data: dict[str, Any] = json.loads(text)
    return data


def load_published(path: str | Path | None = None) -> dict[str, Any]:
    """The published figures: ``{"schema", "description", "anchors": {id: entry}}``.

    Each entry has ``what``, ``compares`` (what the figure sets against what, so that only
    like is set beside like), ``values`` (name -> ``{"value", "units"[, "qualifier"]}``), an
    optional ``quote`` (the source's own words) and ``source`` (``title``, ``venue``, ``date``,
    ``url``). A copy is returned, so callers may edit it.
    """
    if path is None:
        return json.loads(json.dumps(_load_default()))  # type: ignore[no-any-return]
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"published figures file not found: {path}")
    data: dict[str, Any] = json.loads(path.read_text("utf-8"))
    if not isinstance(data.get("anchors"), dict):
        raise ConfigError(f"{path} has no 'anchors' object")
    return data


def published_value(anchor: str, name: str, published: dict[str, Any] | None = None) -> Any:
    """One value, e.g. ``published_value("pytorch_ibm_7b", "reduction_factor") == 23.6``."""
    anchors = (published if published is not None else load_published())["anchors"]
    try:
        return anchors[anchor]["values"][name]["value"]
    except KeyError:
        raise ConfigError(f"no published value {anchor}.{name}") from None


def cite(anchor: str, published: dict[str, Any] | None = None) -> str:
    """A one-line citation: ``title (venue, date) url``."""
    anchors = (published if published is not None else load_published())["anchors"]
    if anchor not in anchors:
        raise ConfigError(f"no published anchor {anchor!r}; known: {', '.join(sorted(anchors))}")
    source = anchors[anchor]["source"]
    where = ", ".join(str(part) for part in (source.get("venue"), source.get("date")) if part)
    url = f" {source['url']}" if source.get("url") else ""
    return f"{source['title']} ({where}){url}"


def published_table(published: dict[str, Any] | None = None) -> pd.DataFrame:
    """One row per published value: anchor, what, compares, quantity, value, units, qualifier,
    source."""
    import pandas as pd

    anchors = (published if published is not None else load_published())["anchors"]
    rows = [
        {
            "anchor": anchor,
            "what": entry["what"],
            "compares": entry.get("compares", ""),
            "quantity": name,
            "value": item["value"],
            "units": item["units"],
            "qualifier": item.get("qualifier", ""),
            "source": cite(anchor, {"anchors": anchors}),
        }
        for anchor, entry in anchors.items()
        for name, item in entry["values"].items()
    ]
    return pd.DataFrame(rows)
