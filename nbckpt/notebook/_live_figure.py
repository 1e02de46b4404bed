"""Live plotly figures: a ``go.FigureWidget`` whose views leave no listeners behind.

Plotly's widget registers each view's listeners on the model of ``initialize()``, so they outlive
the view: after a cell re-runs, every update calls Plotly on a purged ``<div>`` ("Error setting
state: gd.data must be an array"). The wrapper hands plotly, while it renders, the view's own
model, whose listeners anywidget removes with the view. Plotly also measures its ``<div>`` once,
usually before the notebook laid it out (700 px): a width change here sends a window resize.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

import plotly.graph_objects as go
import traitlets

from ._plotly_compat import widget_esm, widget_state

__all__ = ["live_figure"]

# anywidget applies no message to a model until its module is imported and initialized, and
# gives that 2 s ("[anywidget] Failed to initialize model."); past them the model drops every
# update for good, and its views draw the figure as created: an empty timeline. Importing
# plotly's 4.6 MB module took longer on a busy page, so the module here is small and waits for
# nothing: plotly's source travels as a trait (_plotly_esm), imported once per page, and only
# a view waits for it. Plotly's model part (initialize) is made by the first view; its
# listeners only edit copies (plotly's get deserializes), so making it late loses nothing.
_SCOPED_ESM = """\
const key = "__nbckpt_plotly_" + __PLOTLY_KEY__;
const plotlyModule = (model) => (globalThis[key] ??= (async () => {
  const url = URL.createObjectURL(new Blob([model.get("_plotly_esm")], { type: "text/javascript" }));
  try {
    return await import(url);
  } finally {
    URL.revokeObjectURL(url);
  }
})());

export default () => {
  let initial = null;
  let base = null;
  let rendering = null;
  return {
    initialize(context) {
      initial = context;
    },
    async render(context) {
      const plotly = await plotlyModule(context.model);
      if (base === null) {
        base = typeof plotly.default === "function" ? plotly.default() : plotly.default;
        const model = initial.model;
        const routed = {
          ...model,
          on: (name, callback) => (rendering ?? model).on(name, callback),
          off: (name, callback) => (rendering ?? model).off(name, callback),
        };
        base.initialize?.({ ...initial, model: routed });
      }
      rendering = context.model;
      let cleanup;
      try {
        cleanup = base.render(context);
      } finally {
        rendering = null;
      }
      let width = 0;
      const observer = new ResizeObserver((entries) => {
        const now = Math.round(entries[entries.length - 1].contentRect.width);
        if (now > 0 && now !== width) {
          width = now;
          window.dispatchEvent(new Event("resize"));
        }
      });
      observer.observe(context.el);
      return () => {
        observer.disconnect();
        return typeof cleanup === "function" ? cleanup() : undefined;
      };
    },
  };
};
"""


@functools.cache
def _live_figure_class() -> type[go.FigureWidget]:
    # Made on first use: go.FigureWidget itself raises ImportError where anywidget is missing.
    source = widget_esm()
    key = hashlib.sha256(source.encode()).hexdigest()[:16]  # another plotly version: its own import
    esm = _SCOPED_ESM.replace("__PLOTLY_KEY__", json.dumps(key))

    class LiveFigure(go.FigureWidget):  # type: ignore[misc]
        """Plotly's widget, its views scoped (``_SCOPED_ESM``) and its state following the figure.

        Plotly syncs ``_widget_data`` and ``_widget_layout`` only at creation and when displayed on
        its own; later changes travel as ``_py2js_*`` messages, so a page loaded later (a figure
        in a VBox) got the figure as created: an empty timeline. Here each message, once sent
        (plotly resets it to None), is followed by the state it produced, as
        ``_repr_mimebundle_`` computes it; the page already holds it, so no view redraws.
        """

        _esm = esm
        _plotly_esm = traitlets.Unicode(source).tag(sync=True)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            messages = [name for name in self.trait_names() if name.startswith("_py2js_")]
            self.observe(self._sync_state, names=messages)

        def _sync_state(self, change: dict[str, Any]) -> None:
            if change["new"] is None:
                self._widget_layout, self._widget_data = widget_state(self)

    LiveFigure.__module__ = __name__
    return LiveFigure


def live_figure(fig: go.Figure) -> go.FigureWidget:
    """``fig`` as a live widget (needs ``anywidget``) that a re-run cell can clear safely."""
    return _live_figure_class()(fig)
