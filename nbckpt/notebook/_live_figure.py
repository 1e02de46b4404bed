"""Live plotly figures: a ``go.FigureWidget`` whose views leave no listeners behind.

Plotly's widget registers the listeners of each view on the model it got in ``initialize()``,
so they outlive the view: once a cell's output is cleared (the cell runs again), every later
update of the figure calls Plotly on a purged ``<div>``, and ipywidgets logs "Error setting
state: gd.data must be an array" for each. The wrapper below hands plotly, while it renders,
the view's own model, whose listeners anywidget removes with the view. And plotly measures its
``<div>`` once, when it draws it, usually before the notebook has laid it out (it then falls
back to 700 px): a responsive chart measures again on a window resize, sent here when the
width of the ``<div>`` changes.
"""

from __future__ import annotations

import functools
import json
from copy import deepcopy
from typing import Any

import plotly.graph_objects as go

__all__ = ["live_figure"]

_SCOPED_ESM = """\
const source = __PLOTLY_ESM__;
const url = URL.createObjectURL(new Blob([source], { type: "text/javascript" }));
const plotly = await import(url);
URL.revokeObjectURL(url);

export default () => {
  const base = typeof plotly.default === "function" ? plotly.default() : plotly.default;
  let rendering = null;
  return {
    initialize(context) {
      const model = context.model;
      const routed = {
        ...model,
        on: (name, callback) => (rendering ?? model).on(name, callback),
        off: (name, callback) => (rendering ?? model).off(name, callback),
      };
      return base.initialize?.({ ...context, model: routed });
    },
    render(context) {
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
    esm = _SCOPED_ESM.replace("__PLOTLY_ESM__", json.dumps(str(go.FigureWidget._esm)))

    class LiveFigure(go.FigureWidget):  # type: ignore[misc]
        """Plotly's widget, its views scoped (``_SCOPED_ESM``) and its state following the figure.

        Plotly syncs the figure's data and layout (``_widget_data``, ``_widget_layout``) when
        the widget is created and when it is displayed on its own; every later change travels
        as a message (``_py2js_restyle``, ``_py2js_addTraces``, ...) that the page applies to
        the views it has. A page loaded later asks the kernel for the state and got the figure
        as it was created (a figure inside a VBox is never displayed on its own): an empty
        timeline under its first title. Here each message, once sent (plotly sets it back to
        None at once), is followed by the state it produced, as plotly's ``_repr_mimebundle_``
        computes it; the page's copy already holds that state, so no view redraws.
        """

        _esm = esm

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            messages = [name for name in self.trait_names() if name.startswith("_py2js_")]
            self.observe(self._sync_state, names=messages)

        def _sync_state(self, change: dict[str, Any]) -> None:
            if change["new"] is None:
                self._widget_layout = deepcopy(self._layout_obj._props)
                self._widget_data = deepcopy(self._data)

    LiveFigure.__module__ = __name__
    return LiveFigure


def live_figure(fig: go.Figure) -> go.FigureWidget:
    """``fig`` as a live widget (needs ``anywidget``) that a re-run cell can clear safely."""
    return _live_figure_class()(fig)
