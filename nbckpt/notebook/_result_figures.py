"""Figures of results: stalls, overhead, the storage probe and interval advice (the figures of a
bench on many ranks, the measured scaling curve among them, are in :mod:`._rank_figures`).

Each builder takes a DataFrame (the schemas of ``Comparison.results``, ``ProbeResult.to_pandas()``
and :mod:`nbckpt.analysis`) and returns a static ``go.Figure``, or a live ``go.FigureWidget``
with ``widget=True`` (which needs ``anywidget``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis._internal import load_published, waste_curve
from ._plotting import output, require_columns, strategy_colour

__all__ = ["interval_figure", "overhead_figure", "probe_figure", "stall_figure"]

#: Bar labels are never shrunk below this (plotly's default shrinks one to fit its bar).
_READABLE = {"minsize": 10, "mode": "show"}


def stall_figure(
    results_df: pd.DataFrame,
    *,
    published: Mapping[str, Any] | None = None,
    log: bool = False,
    widget: bool = False,
) -> go.Figure:
    """Left: mean stall per checkpoint by strategy, stacked from the save stall and the wait for
    the earlier save where the results have them, the whisker up to the p95. Right: how many
    times shorter each stall is than ``dcp-sync``'s, beside the published figure that compares
    the same (PyTorch/IBM), or else than ``torch-save``'s (no source compares against it).
    Partial rows are left out; ``published`` defaults to ``load_published()``."""
    require_columns(results_df, {"strategy", "stall_mean_s"}, "stall_figure")
    from ..bench._internal import STALL_NAMES

    rows = results_df[(results_df["strategy"] != "none") & results_df["stall_mean_s"].notna()]
    if "checkpoints" in rows.columns:
        rows = rows[rows["checkpoints"] > 0]
    if "partial" in rows.columns:
        rows = rows[~rows["partial"].fillna(False).astype(bool)]
    strategies = rows["strategy"].astype(str).tolist()
    stall = rows["stall_mean_s"].astype(float)
    reference = "dcp-sync" if "dcp-sync" in strategies else "torch-save"
    theirs = stall[rows["strategy"] == reference]
    reduction = (float(theirs.iloc[0]) if len(theirs) else math.nan) / stall.where(stall > 0)
    whisker = None
    if "stall_p95_s" in rows:
        error = (rows["stall_p95_s"].astype(float) - stall).clip(lower=0).tolist()
        whisker = {"type": "data", "array": error, "arrayminus": [0.0] * len(error)}
    colours = [strategy_colour(name) for name in strategies]
    fig = make_subplots(
        rows=1,
        cols=2,
        horizontal_spacing=0.12,
        subplot_titles=("stall per checkpoint (s)", f"stall reduction vs {reference} (x)"),
    )
    parts = {"save_stall_s", "wait_s"} <= set(rows.columns)
    bars = (("save_stall_s", 1.0), ("wait_s", 0.45)) if parts else (("stall_mean_s", 1.0),)
    for column, opacity in bars:
        name = STALL_NAMES[column]
        fig.add_trace(
            go.Bar(
                name=name,
                x=strategies,
                y=rows[column].astype(float).tolist(),
                marker_color=colours,
                marker_opacity=opacity,
                legendgroup=name,
                error_y=None if parts else whisker,
                hovertemplate=f"%{{x}}: {name} %{{y:.4f}} s per checkpoint<extra></extra>",
            ),
            row=1,
            col=1,
        )
    if parts:  # the stall, the two parts together, carries the whisker
        fig.add_trace(
            go.Scatter(
                name="stall (p95)",
                x=strategies,
                y=stall.tolist(),
                mode="markers",
                marker={"color": "#444444", "size": 4},
                error_y=whisker,
                showlegend=False,
                hovertemplate="%{x}: stall %{y:.4f} s per checkpoint<extra>(bar to p95)</extra>",
            ),
            row=1,
            col=1,
        )
    fig.add_trace(
        go.Bar(
            name="measured reduction",
            x=strategies,
            y=reduction.tolist(),
            marker_color=colours,
            text=[f"{value:.1f}x" if pd.notna(value) else "" for value in reduction],
            textposition="outside",
            showlegend=False,
            hovertemplate=f"%{{x}}: %{{y:.1f}}x less stall than {reference}<extra>measured</extra>",
        ),
        row=1,
        col=2,
    )
    if reference == "dcp-sync":
        # Only PyTorch/IBM's 7B figure compares a synchronous DCP save with an asynchronous one:
        # Pure Storage gives no setup and ByteCheckpoint compares against other systems. Its
        # words go in the legend: written beside the line they ran over the bars' labels.
        values = (published or load_published())["anchors"]["pytorch_ibm_7b"]["values"]
        factor = float(values["reduction_factor"]["value"])
        fig.add_trace(
            go.Scatter(
                name=(
                    f"published: PyTorch/IBM, 7B on GPUs, sync DCP {values['sync_downtime']['value']} s"
                    f"<br>→ async DCP {values['async_downtime']['value']} s ({factor}x)"
                ),
                x=strategies,
                y=[factor] * len(strategies),
                mode="lines",
                line={"dash": "dash", "color": "#444444", "width": 1.5},
                hovertemplate=f"published: {factor}x<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.update_layout(
        title=f"Stall per checkpoint, and reduction against {reference}"
        + (
            "<br><sup>beside the published figure that compares the same</sup>"
            if reference == "dcp-sync"
            else ""
        ),
        showlegend=parts or reference == "dcp-sync",
        barmode="stack",
        uniformtext=_READABLE,
    )
    if log:
        fig.update_yaxes(type="log")
    return output(fig, widget)


def overhead_figure(results_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Overhead against the ``none`` baseline per strategy with its 95 % interval as error bars,
    labelled as every table labels it (:func:`nbckpt.bench.overhead_text`), each repeat's
    overhead and what it rests on in the hover; a partial (stopped) row drawn paler."""
    require_columns(results_df, {"strategy", "overhead_pct", "overhead_ci_pct"}, "overhead_figure")
    from ..bench._internal import measurable, overhead_text, per_repeat_text

    rows = results_df[(results_df["strategy"] != "none") & results_df["overhead_pct"].notna()]
    records = rows.to_dict(orient="records")
    names = [str(r["strategy"]) for r in records]
    points = [float(r["overhead_pct"]) for r in records]
    intervals = [tuple(float(v) for v in r["overhead_ci_pct"]) for r in records]
    texts = [overhead_text(r) for r in records]
    hover = [
        f"{name}: {text}, 95 % interval [{lo:+.1f}, {hi:+.1f}] %; per repeat "
        f"{per_repeat_text(r)}; rests on {r.get('overhead_basis', '-')}"
        for name, text, (lo, hi), r in zip(names, texts, intervals, records, strict=True)
    ]
    unmeasured = [not measurable(r.get("overhead_ci_pct")) for r in records]
    fig = go.Figure(
        go.Bar(
            name="overhead",
            x=names,
            y=points,
            showlegend=False,
            error_y={
                "type": "data",
                "array": [max(hi - p, 0.0) for p, (_, hi) in zip(points, intervals, strict=True)],
                "arrayminus": [max(p - lo, 0.0) for p, (lo, _) in zip(points, intervals, strict=True)],
            },
            marker_color=[strategy_colour(name) for name in names],
            marker_opacity=[0.4 if r.get("partial", False) else 1.0 for r in records],
            marker_pattern_shape=["/" if no else "" for no in unmeasured],
            hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>",
        )
    )
    # The estimate above each whisker, never on it: as bar text outside, a table's long words
    # ("no measurable difference") were shrunk to fit the bar and ran into the whisker.
    fig.add_trace(
        go.Scatter(
            name="estimate",
            x=names,
            y=[max(hi, p, 0.0) for p, (_, hi) in zip(points, intervals, strict=True)],
            text=[f"{p:+.1f} %" for p in points],
            mode="text",
            textposition="top center",
            textfont={"size": 12},
            cliponaxis=False,
            showlegend=False,
            hoverinfo="skip",
        )
    )
    fig.add_hline(y=0.0, line={"color": "#444444", "width": 1})
    fig.update_layout(
        title="Overhead against training without checkpoints: ratio to the baseline beside it, 95 % interval"
        + (
            "<br><sup>hatched: the interval contains 0 (what that means: the table)</sup>"
            if any(unmeasured)
            else ""
        ),
        # Two short lines and room for them: in one line the title was longer than the axis
        # and plotly cut it at both ends.
        yaxis={
            "title": {"text": "% longer training loop than<br>the none baseline beside it"},
            "automargin": True,
        },
        margin={"l": 100},
    )
    return output(fig, widget)


def interval_figure(advice_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Expected time lost against checkpoint interval per strategy, the advised interval marked
    (from :func:`nbckpt.analysis.advise`)."""
    require_columns(
        advice_df,
        {
            "strategy",
            "interval_s",
            "waste_pct",
            "cost_s",
            "lag_s",
            "restore_s",
            "job_mtbf_h",
            "gpu_hours_lost_per_day",
        },
        "interval_figure",
    )
    curve = waste_curve(advice_df)
    fig = go.Figure()
    for row in advice_df.to_dict("records"):
        name = str(row["strategy"])
        points = curve[curve["strategy"] == name]
        colour = strategy_colour(name)
        fig.add_trace(
            go.Scatter(
                # the advised values in the legend: as text by the markers, close ones overlapped
                name=f"{name}: every {row['interval_s']:.0f} s, {row['waste_pct']:.2f}% lost",
                x=points["interval_s"].tolist(),
                y=points["waste_pct"].tolist(),
                mode="lines",
                line={"color": colour},
                legendgroup=name,
                hovertemplate="every %{x:.0f} s: %{y:.2f}% lost<extra>%{fullData.name}</extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                name=f"{name} advised",
                x=[row["interval_s"]],
                y=[row["waste_pct"]],
                mode="markers",
                marker={"color": colour, "size": 11, "symbol": "diamond"},
                legendgroup=name,
                showlegend=False,
                hovertemplate=(
                    f"{name}: checkpoint every %{{x:.0f}} s, %{{y:.2f}}% lost, "
                    f"{row['gpu_hours_lost_per_day']:.1f} GPU-h/day<extra></extra>"
                ),
            )
        )
    title = (
        "Expected time lost against checkpoint interval (Young/Daly), job MTBF "
        f"{advice_df['job_mtbf_h'].iloc[0]:.1f} h"
    )
    attrs = advice_df.attrs
    if {"gpus", "mtbf_source", "restore_s"} <= set(attrs):
        title += (
            f"<br><sup>assumed: {attrs['gpus']} GPUs, MTBF {attrs['mtbf_source']}, "
            f"restore {float(attrs['restore_s']):g} s</sup>"
        )
    fig.update_layout(
        title=title,
        xaxis={"title": "training seconds between checkpoints", "type": "log"},
        yaxis={"title": "% of time lost (stalls + rework)", "rangemode": "tozero"},
    )
    return output(fig, widget)


def probe_figure(probe_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Write (and read, when measured) bandwidth against parallel streams, from
    ``ProbeResult.to_pandas()``."""
    require_columns(probe_df, {"streams", "write_gbs"}, "probe_figure")
    rows = probe_df.sort_values("streams")
    streams = rows["streams"].astype(int).tolist()
    fig = go.Figure()
    for column, label, colour in (("write_gbs", "write", "#2ca02c"), ("read_gbs", "read", "#1f77b4")):
        if column in rows.columns and rows[column].notna().any():
            fig.add_trace(
                go.Scatter(
                    name=label,
                    x=streams,
                    y=rows[column].astype(float).tolist(),
                    mode="lines+markers",
                    line={"color": colour},
                    hovertemplate="%{x} streams: %{y:.2f} GB/s<extra>%{fullData.name}</extra>",
                )
            )
    fig.update_layout(
        title="Storage bandwidth against parallel streams",
        xaxis={"title": "parallel streams", "type": "log", "tickvals": streams, "ticktext": streams},
        yaxis={"title": "GB/s", "rangemode": "tozero"},
    )
    return output(fig, widget)
