"""What the Lab and the Browser share: their coloured message lines, and closing a widget tree."""

from __future__ import annotations

import html
from collections.abc import Iterator

import ipywidgets as widgets

__all__ = ["close_widgets", "notice"]


def notice(kind: str, text: str, *, pre: bool = False) -> str:
    """A coloured line of HTML: ``error``, ``ok`` or ``info`` (its class is ``nbckpt-<kind>``)."""
    fg, bg = {"error": ("#cf222e", "#ffebe9"), "ok": ("#1a7f37", "#dafbe1"),
              "info": ("#0969da", "#ddf4ff")}[kind]
    body = f"<pre style='margin:0'>{html.escape(text)}</pre>" if pre else html.escape(text)
    return (f'<div class="nbckpt-{kind}" style="color:{fg};background:{bg};border:1px solid {fg};'
            f'border-radius:4px;padding:4px 8px;margin:2px 0">{body}</div>')


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
