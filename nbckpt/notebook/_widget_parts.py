"""What the Lab and the Browser share: message lines, tables, and closing a widget tree."""

from __future__ import annotations

import html
from collections.abc import Collection, Iterable, Iterator, Sequence

import ipywidgets as widgets

__all__ = ["close_widgets", "html_table", "notice"]


def notice(kind: str, text: str) -> str:
    """A coloured line of HTML: ``error``, ``ok`` or ``info`` (its class is ``nbckpt-<kind>``)."""
    fg, bg = {"error": ("#cf222e", "#ffebe9"), "ok": ("#1a7f37", "#dafbe1"), "info": ("#0969da", "#ddf4ff")}[
        kind
    ]
    return (
        f'<div class="nbckpt-{kind}" style="color:{fg};background:{bg};border:1px solid {fg};'
        f'border-radius:4px;padding:4px 8px;margin:2px 0">{html.escape(text)}</div>'
    )


def html_table(
    css_class: str,
    headers: Sequence[str],
    rows: Iterable[tuple[str, Sequence[str]]],
    *,
    left: Collection[int],
) -> str:
    """An HTML table in tabular figures. ``rows`` are (the ``<tr>``'s attributes, its cells as
    HTML); the columns in ``left`` (text) align left, the others (numbers) right."""
    styles = [
        f"padding:2px 8px;white-space:nowrap;text-align:{'left' if i in left else 'right'}"
        for i in range(len(headers))
    ]
    head = "".join(
        f'<th style="{style}">{html.escape(header)}</th>'
        for header, style in zip(headers, styles, strict=True)
    )
    body = "".join(
        f"<tr{attributes}>"
        + "".join(f'<td style="{style}">{cell}</td>' for cell, style in zip(cells, styles, strict=True))
        + "</tr>"
        for attributes, cells in rows
    )
    return (
        f'<table class="{css_class}" style="border-collapse:collapse;font-variant-numeric:'
        f'tabular-nums"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    )


def _tree(root: widgets.Widget) -> Iterator[widgets.Widget]:
    yield root
    for name in ("layout", "style"):  # each one a comm of its own
        if isinstance(part := getattr(root, name, None), widgets.Widget):
            yield part
    for child in getattr(root, "children", ()):
        yield from _tree(child)


def close_widgets(*roots: widgets.Widget) -> None:
    """Close ``roots``, their children, layouts and styles: nothing of them stays in the kernel."""
    for root in roots:
        for widget in list(_tree(root)):
            widget.close()
