"""A table whose rows a user can click to select and whose columns sort on a click of the header.

ipywidgets has no table a click can come back from; this one is an anywidget: Python gives
the cells as text with a sort key each, the browser draws them, and a click on a row changes
``selected``, which Python observes like any other trait (tests set it the same way).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import anywidget
import traitlets

__all__ = ["DataTable", "column", "table_row"]

_ESM = """
function compare(a, b, descending) {
  if (a === b) return 0;
  if (a === null || a === undefined) return 1;  // no value: last, whichever the direction
  if (b === null || b === undefined) return -1;
  const order = a < b ? -1 : 1;
  return descending ? -order : order;
}

function render({ model, el }) {
  let sortColumn = -1;
  let descending = false;

  const toggle = (id) => {
    const before = model.get("selected");
    let chosen = before.filter((x) => x !== id);
    if (chosen.length === before.length) {
      chosen.push(id);
      const limit = model.get("selectable");
      if (chosen.length > limit) chosen = chosen.slice(chosen.length - limit);  // the oldest goes
    }
    model.set("selected", chosen);
    model.save_changes();
  };

  const draw = () => {
    const columns = model.get("columns");
    const rows = [...model.get("rows")];
    const selected = new Set(model.get("selected"));
    const selectable = model.get("selectable") > 0;
    if (sortColumn >= 0 && sortColumn < columns.length) {
      rows.sort((a, b) => compare(a.keys[sortColumn], b.keys[sortColumn], descending));
    }
    const table = document.createElement("table");
    table.className = "nbckpt-table";
    const head = table.createTHead().insertRow();
    if (selectable) head.appendChild(document.createElement("th"));
    columns.forEach((column, i) => {
      const th = document.createElement("th");
      th.textContent = column.label + (i === sortColumn ? (descending ? " \\u25BC" : " \\u25B2") : "");
      th.title = "sort by " + column.label;
      if (column.numeric) th.classList.add("nbckpt-num");
      th.addEventListener("click", () => {
        descending = i === sortColumn ? !descending : column.numeric;  // numbers: largest first
        sortColumn = i;
        draw();
      });
      head.appendChild(th);
    });
    const body = table.createTBody();
    for (const row of rows) {
      const tr = body.insertRow();
      tr.dataset.id = row.id;
      if (row.tone) tr.classList.add("nbckpt-row-" + row.tone);
      if (selectable) {
        const box = document.createElement("input");
        box.type = "checkbox";
        box.checked = selected.has(row.id);
        tr.insertCell().appendChild(box);
        tr.classList.add("nbckpt-selectable");
        if (selected.has(row.id)) tr.classList.add("nbckpt-selected");
        tr.addEventListener("click", () => toggle(row.id));
      }
      row.cells.forEach((text, i) => {
        const td = tr.insertCell();
        td.title = text;
        if (columns[i].numeric) td.classList.add("nbckpt-num");
        if (columns[i].bar && row.bar !== null && row.bar !== undefined) {
          const bar = document.createElement("span");
          bar.className = "nbckpt-bar";
          bar.style.width = Math.max(1, Math.round(80 * row.bar)) + "px";
          td.appendChild(bar);
        }
        td.appendChild(document.createTextNode(text));
      });
    }
    const scroll = document.createElement("div");
    scroll.className = "nbckpt-table-scroll";
    scroll.appendChild(table);
    el.replaceChildren(scroll);
  };

  const events = ["change:columns", "change:rows", "change:selected", "change:selectable"];
  events.forEach((name) => model.on(name, draw));
  draw();
  return () => events.forEach((name) => model.off(name, draw));
}

export default { render };
"""

_CSS = """
.nbckpt-table-scroll { max-height: 420px; overflow: auto; }
.nbckpt-table {
  border-collapse: collapse; font-size: 12px; font-variant-numeric: tabular-nums;
  color: var(--jp-ui-font-color1, #1f2328);
}
.nbckpt-table th, .nbckpt-table td {
  padding: 2px 8px; text-align: left; white-space: nowrap; max-width: 360px;
  overflow: hidden; text-overflow: ellipsis; border-bottom: 1px solid var(--jp-border-color2, #eaeef2);
}
.nbckpt-table th {
  position: sticky; top: 0; cursor: pointer; user-select: none;
  background: var(--jp-layout-color1, #fff); border-bottom: 1px solid var(--jp-border-color1, #8c959f);
}
.nbckpt-table .nbckpt-num { text-align: right; }
.nbckpt-table tr.nbckpt-selectable { cursor: pointer; }
.nbckpt-table tr.nbckpt-selectable:hover { background: var(--jp-layout-color2, #f6f8fa); }
.nbckpt-table tr.nbckpt-selected, .nbckpt-table tr.nbckpt-selected:hover { background: #ddf4ff; }
.nbckpt-table tr.nbckpt-row-damaged td { color: #cf222e; }
.nbckpt-table tr.nbckpt-row-verified td { color: #1a7f37; }
.nbckpt-table tr.nbckpt-row-quiet td { color: var(--jp-ui-font-color2, #57606a); }
.nbckpt-bar {
  display: inline-block; height: 9px; margin-right: 6px; vertical-align: middle;
  background: #0969da; border-radius: 2px;
}
"""

# The largest sort key JSON can carry: the comm refuses inf and NaN.
_HUGE = 1e308


def column(label: str, *, numeric: bool = False, bar: bool = False) -> dict[str, Any]:
    """A column: numbers align right and sort largest first; ``bar`` draws each row's ``bar`` there."""
    return {"label": label, "numeric": numeric, "bar": bar}


def table_row(
    row_id: str,
    cells: Sequence[str],
    keys: Sequence[float | str | None],
    *,
    tone: str = "",
    bar: float | None = None,
) -> dict[str, Any]:
    """A row: its text per column, the key each column sorts it by, a tone (``damaged``,
    ``verified``, ``quiet``) and the length of its bar (0 to 1)."""
    if len(cells) != len(keys):
        raise ValueError(f"row {row_id!r} has {len(cells)} cells and {len(keys)} sort keys")
    return {"id": row_id, "cells": list(cells), "keys": [_json_key(k) for k in keys], "tone": tone,
            "bar": None if bar is None or not math.isfinite(bar) else min(1.0, max(0.0, bar))}


def _json_key(key: float | str | None) -> float | str | None:
    if isinstance(key, float) and not math.isfinite(key):
        return None if math.isnan(key) else math.copysign(_HUGE, key)
    return key


class DataTable(anywidget.AnyWidget):  # type: ignore[misc]
    """``columns`` (from :func:`column`) over ``rows`` (from :func:`table_row`); clicking a row
    toggles it in ``selected`` (ids, in the order clicked; at most ``selectable``, the oldest
    dropping out; 0: rows do not select)."""

    _esm = _ESM
    _css = _CSS
    columns = traitlets.List(traitlets.Dict()).tag(sync=True)
    rows = traitlets.List(traitlets.Dict()).tag(sync=True)
    selected = traitlets.List(traitlets.Unicode()).tag(sync=True)
    selectable = traitlets.Int(0).tag(sync=True)
