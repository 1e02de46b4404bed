"""Figures of results: stalls, overhead, scaling, the storage probe, interval advice and
the scale-out projection.

Each builder takes a DataFrame (the schemas of ``Comparison.results``, ``ProbeResult.to_pandas()``
and :mod:`nbckpt.analysis`) and returns a static ``go.Figure``, or a live ``go.FigureWidget``
with ``widget=True`` (which needs ``anywidget``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .._errors import ConfigError
from ..analysis._internal import load_published, waste_curve
from ._plotting import output, require_columns, strategy_colour

__all__ = [
    "anchor_factors",
    "interval_figure",
    "overhead_figure",
    "probe_figure",
    "projection_figure",
    "scaling_data",
    "scaling_figure",
    "stall_figure",
]


def anchor_factors(published: Mapping[str, Any]) -> list[tuple[str, float, str]]:
    """The published stall-reduction factors that compare what :func:`stall_figure`'s right panel
    compares (a synchronous DCP save against an asynchronous one): (label, factor, source).

    Only PyTorch/IBM's 7B figure qualifies. Pure Storage's post states an overhead cut "often
    by 90% or more" with no setup, and ByteCheckpoint's 54.2x is against other systems: both
    are cited in the reference table, neither is drawn as a line.
    """
    anchors = published["anchors"]
    factors = []
    ibm = anchors.get("pytorch_ibm_7b")
    if ibm:
        values = ibm["values"]
        factor = values["reduction_factor"]["value"]
        label = (f"PyTorch/IBM, 7B on GPUs, sync DCP {values['sync_downtime']['value']} s → "
                 f"async DCP {values['async_downtime']['value']} s ({factor}x)")
        factors.append((label, float(factor), ibm["source"]["title"]))
    return factors


def _reduction(rows: pd.DataFrame, reference: str) -> pd.Series:
    column = f"reduction_vs_{reference.replace('-', '_')}"
    if column in rows.columns:
        return rows[column].astype(float)
    theirs = rows.loc[rows["strategy"] == reference, "stall_mean_s"]
    if theirs.empty:
        return pd.Series(float("nan"), index=rows.index)
    return float(theirs.iloc[0]) / rows["stall_mean_s"].astype(float)


def stall_figure(
    results_df: pd.DataFrame,
    *,
    published: Mapping[str, Any] | None = None,
    anchors: bool = True,
    log: bool = False,
    widget: bool = False,
) -> go.Figure:
    """Left: mean stall per checkpoint by strategy, stacked from its two parts (the save stall and
    the wait for the earlier save) where the results have them, the whisker up to the p95 of the
    stall. Right: how many times
    shorter each stall is than a synchronous save's: ``dcp-sync``'s when it was measured, with
    the published factor that compares the same thing (PyTorch/IBM: synchronous DCP against
    ``async_save``, 23.6x for a 7B model on GPUs) as a reference line; else ``torch-save``'s,
    with no published line (no source compares against torch.save). Partial rows are left out.
    ``published`` defaults to ``load_published()``."""
    require_columns(results_df, {"strategy", "stall_mean_s"}, "stall_figure")
    rows = results_df[(results_df["strategy"] != "none") & results_df["stall_mean_s"].notna()]
    if "checkpoints" in rows.columns:
        rows = rows[rows["checkpoints"] > 0]
    if "partial" in rows.columns:
        rows = rows[~rows["partial"].fillna(False).astype(bool)]
    strategies = rows["strategy"].astype(str).tolist()
    stall = rows["stall_mean_s"].astype(float)
    reference = "dcp-sync" if "dcp-sync" in strategies else "torch-save"
    reduction = _reduction(rows, reference)
    error = (rows["stall_p95_s"].astype(float) - stall).clip(lower=0) if "stall_p95_s" in rows else None
    colours = [strategy_colour(name) for name in strategies]
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.12,
        subplot_titles=("stall per checkpoint (s)", f"stall reduction vs {reference} (x)"),
    )
    parts = {"save_stall_s", "wait_s"} <= set(rows.columns)
    if parts:
        # the stall in its two parts, by the names every table uses (nbckpt.bench.STALL_NAMES)
        from ..bench._internal import STALL_NAMES

        for column, opacity in (("save_stall_s", 1.0), ("wait_s", 0.45)):
            name = STALL_NAMES[column]
            fig.add_trace(
                go.Bar(name=name, x=strategies, y=rows[column].astype(float).tolist(),
                       marker_color=colours, marker_opacity=opacity, legendgroup=name,
                       hovertemplate=f"%{{x}}: {name} %{{y:.4f}} s per checkpoint<extra></extra>",
                       showlegend=True),
                row=1, col=1,
            )
        fig.add_trace(
            go.Scatter(name="stall (p95)", x=strategies, y=stall.tolist(), mode="markers",
                       marker={"color": "#444444", "size": 4},
                       error_y=None if error is None else {"type": "data", "array": error.tolist(),
                                                           "arrayminus": [0.0] * len(error)},
                       hovertemplate="%{x}: stall %{y:.4f} s per checkpoint<extra>save stall + "
                       "wait (bar to p95)</extra>", showlegend=False),
            row=1, col=1,
        )
    else:
        fig.add_trace(
            go.Bar(
                name="stall per checkpoint",
                x=strategies,
                y=stall.tolist(),
                error_y=None if error is None else {"type": "data", "array": error.tolist(),
                                                    "arrayminus": [0.0] * len(error)},
                marker_color=colours,
                hovertemplate="%{x}: %{y:.4f} s per checkpoint<extra>mean (bar to p95)</extra>",
                showlegend=False,
            ),
            row=1, col=1,
        )
    fig.add_trace(
        go.Bar(
            name="measured reduction",
            x=strategies,
            y=reduction.tolist(),
            marker_color=colours,
            text=[f"{value:.1f}x" if pd.notna(value) else "" for value in reduction],
            textposition="outside",
            hovertemplate=f"%{{x}}: %{{y:.1f}}x less stall than {reference}<extra>measured</extra>",
            showlegend=False,
        ),
        row=1, col=2,
    )
    if anchors and reference == "dcp-sync":
        source = published if published is not None else load_published()
        for label, factor, _source in anchor_factors(source):
            fig.add_hline(
                y=factor, row=1, col=2, line={"dash": "dash", "color": "#444444", "width": 1.5},
                annotation_text=f"published: {label}", annotation_position="top left",
                annotation_font_size=11,
            )
    fig.update_layout(
        title=f"Stall per checkpoint, and reduction against {reference}"
        + (" beside the published figure that compares the same" if reference == "dcp-sync" else ""),
        showlegend=parts, barmode="stack",
    )
    if log:
        fig.update_yaxes(type="log")
    return output(fig, widget)


def overhead_figure(results_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Overhead against the ``none`` baseline per strategy: the estimate with its 95 % interval
    as error bars (``overhead_ci_pct``, never below -100 %), labelled as every table labels it
    (:func:`nbckpt.bench.overhead_text`: the number always, "no measurable difference" beside an
    interval that contains 0), each repeat's overhead and what it rests on in the hover; a
    partial row (stopped) is drawn paler (``nbckpt.bench.OVERHEAD_METHOD``)."""
    require_columns(results_df, {"strategy", "overhead_pct", "overhead_ci_pct"}, "overhead_figure")
    from ..bench._internal import overhead_text, per_repeat_text

    rows = results_df[(results_df["strategy"] != "none") & results_df["overhead_pct"].notna()]
    records = rows.to_dict(orient="records")
    names = [str(r["strategy"]) for r in records]
    points = [float(r["overhead_pct"]) for r in records]
    intervals = [tuple(float(v) for v in r["overhead_ci_pct"]) for r in records]
    above = [max(hi - point, 0.0) for point, (_lo, hi) in zip(points, intervals, strict=True)]
    below = [max(point - lo, 0.0) for point, (lo, _hi) in zip(points, intervals, strict=True)]
    texts = [overhead_text(r) for r in records]
    hover = [f"{name}: {text}, 95 % interval [{lo:+.1f}, {hi:+.1f}] %; per repeat "
             f"{per_repeat_text(r)}; rests on {r.get('overhead_basis', '-')}"
             for name, text, (lo, hi), r in zip(names, texts, intervals, records, strict=True)]
    partial = [bool(r.get("partial", False)) for r in records]
    fig = go.Figure(go.Bar(
        name="overhead",
        x=names,
        y=points,
        error_y={"type": "data", "array": above, "arrayminus": below},
        marker_color=[strategy_colour(name) for name in names],
        marker_opacity=[0.4 if p else 1.0 for p in partial],
        text=texts,
        textposition="outside",
        hovertext=hover,
        hovertemplate="%{hovertext}<extra></extra>",
        showlegend=False,
    ))
    fig.add_hline(y=0.0, line={"color": "#444444", "width": 1})
    fig.update_layout(
        title="Overhead against training without checkpoints: ratio to the baseline beside it, "
        "95 % interval",
        # Two short lines and room for them: in one line the title was longer than the axis
        # and plotly cut it at both ends.
        yaxis={"title": {"text": "% longer training loop than<br>the none baseline beside it"},
               "automargin": True},
        margin={"l": 100},
    )
    return output(fig, widget)


def scaling_data(comparisons: Iterable[Any]) -> pd.DataFrame:
    """Stack the results of comparisons run at different sizes for :func:`scaling_figure`:
    each ``Comparison.results`` row with the checkpoint size (``Comparison.bytes``) in ``bytes``."""
    frames = []
    for comparison in comparisons:
        require_columns(comparison.results, {"strategy", "stall_mean_s"}, "scaling_data")
        frames.append(comparison.results.assign(bytes=comparison.bytes))
    if not frames:
        raise ConfigError("scaling_data needs at least one comparison")
    stacked: pd.DataFrame = pd.concat(frames, ignore_index=True)
    if "checkpoints" in stacked.columns:
        stacked = stacked[stacked["checkpoints"] > 0]
    return stacked.reset_index(drop=True)


def scaling_figure(df: pd.DataFrame, *, log: bool = True, widget: bool = False) -> go.Figure:
    """Stall per checkpoint against state size per strategy (columns ``strategy, bytes,
    stall_mean_s``; a ``persist_s`` column adds dashed persist-time lines)."""
    require_columns(df, {"strategy", "bytes", "stall_mean_s"}, "scaling_figure")
    fig = go.Figure()
    for name, group in df.sort_values("bytes").groupby("strategy", sort=False):
        colour = strategy_colour(str(name))
        megabytes = (group["bytes"].astype(float) / 1e6).tolist()
        fig.add_trace(go.Scatter(
            name=f"{name} stall", x=megabytes, y=group["stall_mean_s"].astype(float).tolist(),
            mode="lines+markers", line={"color": colour},
            hovertemplate="%{x:.0f} MB: stall %{y:.4f} s<extra>%{fullData.name}</extra>",
        ))
        if "persist_s" in group.columns and group["persist_s"].notna().any():
            fig.add_trace(go.Scatter(
                name=f"{name} persist", x=megabytes, y=group["persist_s"].astype(float).tolist(),
                mode="lines+markers", line={"color": colour, "dash": "dash"},
                hovertemplate="%{x:.0f} MB: persist %{y:.4f} s<extra>%{fullData.name}</extra>",
            ))
    axis_type = "log" if log else "linear"
    fig.update_layout(
        title="Stall per checkpoint against checkpoint size",
        xaxis={"title": "checkpoint size (MB)", "type": axis_type},
        yaxis={"title": "seconds per checkpoint", "type": axis_type},
    )
    return output(fig, widget)


def interval_figure(advice_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Expected time lost against checkpoint interval per strategy, the advised interval marked
    (from :func:`nbckpt.analysis.advise`)."""
    require_columns(advice_df, {"strategy", "interval_s", "waste_pct"}, "interval_figure")
    curve = waste_curve(advice_df)
    fig = go.Figure()
    for row in advice_df.to_dict("records"):
        name = str(row["strategy"])
        points = curve[curve["strategy"] == name]
        colour = strategy_colour(name)
        fig.add_trace(go.Scatter(
            name=name, x=points["interval_s"].tolist(), y=points["waste_pct"].tolist(),
            mode="lines", line={"color": colour}, legendgroup=name,
            hovertemplate="every %{x:.0f} s: %{y:.2f}% lost<extra>%{fullData.name}</extra>",
        ))
        fig.add_trace(go.Scatter(
            name=f"{name} advised", x=[row["interval_s"]], y=[row["waste_pct"]],
            mode="markers+text", marker={"color": colour, "size": 11, "symbol": "diamond"},
            text=[f"{row['interval_s']:.0f} s, {row['waste_pct']:.2f}%"], textposition="top center",
            legendgroup=name, showlegend=False,
            hovertemplate=(f"{name}: checkpoint every %{{x:.0f}} s, %{{y:.2f}}% lost, "
                           f"{row.get('gpu_hours_lost_per_day', float('nan')):.1f} GPU-h/day<extra></extra>"),
        ))
    mtbf = advice_df["cluster_mtbf_h"].iloc[0] if "cluster_mtbf_h" in advice_df and len(advice_df) else None
    title = "Expected time lost against checkpoint interval (Young/Daly)"
    if mtbf is not None:
        title += f", job MTBF {mtbf:.1f} h"
    attrs = advice_df.attrs
    if {"gpus", "mtbf_hours"} <= set(attrs):
        title += (f" (assumed: {attrs['gpus']} GPUs, node MTBF {float(attrs['mtbf_hours']):g} h"
                  + (f", restore {float(attrs['restore_s']):g} s" if "restore_s" in attrs else "") + ")")
    fig.update_layout(
        title=title,
        xaxis={"title": "training seconds between checkpoints", "type": "log"},
        yaxis={"title": "% of time lost (stalls + rework)", "rangemode": "tozero"},
    )
    return output(fig, widget)


def projection_figure(projection_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Projected stall per checkpoint and overhead by model size and rank count per strategy
    (from :func:`nbckpt.analysis.project_scale`), titled as a projection."""
    require_columns(projection_df, {"strategy", "model", "ranks", "stall_s", "overhead_pct"},
                    "projection_figure")
    left_out = 0
    attrs = dict(projection_df.attrs)
    if "feasible" in projection_df.columns:
        feasible = projection_df["feasible"].fillna(True).astype(bool)
        left_out = len(projection_df.loc[~feasible, ["model", "ranks"]].drop_duplicates())
        projection_df = projection_df[feasible]
    fig = make_subplots(
        rows=1, cols=2, horizontal_spacing=0.1,
        subplot_titles=("projected stall per checkpoint (s)", "projected overhead (% of training time)"),
    )
    labels = projection_df["model"].astype(str) + " × " + projection_df["ranks"].astype(str) + " ranks"
    frame = projection_df.assign(label=labels)
    for name, group in frame.groupby("strategy", sort=False):
        hover = [
            f"{name}, {label}<br>stall {stall:.3g} s, overhead {overhead:.3g}%"
            for label, stall, overhead in zip(
                group["label"], group["stall_s"], group["overhead_pct"], strict=True
            )
        ]
        if {"persist_s", "limited_by"} <= set(group.columns):
            hover = [
                f"{text}<br>persist {persist:.1f} s, limited by {limit}"
                for text, persist, limit in zip(hover, group["persist_s"], group["limited_by"], strict=True)
            ]
        if {"drag_s", "storage_duty_pct"} <= set(group.columns):
            hover = [
                f"{text}<br>drag {drag:.3g} s, storage busy {duty:.0f} % of the time"
                for text, drag, duty in zip(hover, group["drag_s"], group["storage_duty_pct"], strict=True)
            ]
        for col, column in ((1, "stall_s"), (2, "overhead_pct")):
            fig.add_trace(go.Bar(
                name=str(name), x=group["label"].tolist(), y=group[column].astype(float).tolist(),
                marker_color=strategy_colour(str(name)), legendgroup=str(name), showlegend=col == 1,
                hovertext=hover, hovertemplate="%{hovertext}<extra>projection</extra>",
            ), row=1, col=col)
    storage = attrs.get("storage_gbs")
    title = "Projection (not measured): checkpoint stall and overhead at scale"
    if storage:
        title += f", aggregate storage {storage:g} GB/s"
    sharding = attrs.get("sharding")
    if sharding:
        title += f", state {'sharded evenly' if sharding == 'full' else 'replicated'} over ranks"
    if left_out:
        title += (f"<br><sup>{left_out} configuration(s) left out: more state per rank than "
                  f"{attrs.get('gpu_memory_gb', 0):g} GB of GPU memory</sup>")
    fig.update_layout(title=title, barmode="group")
    fig.update_yaxes(type="log", row=1, col=1)
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
            fig.add_trace(go.Scatter(
                name=label, x=streams, y=rows[column].astype(float).tolist(), mode="lines+markers",
                line={"color": colour},
                hovertemplate="%{x} streams: %{y:.2f} GB/s<extra>%{fullData.name}</extra>",
            ))
    fig.update_layout(
        title="Storage bandwidth against parallel streams",
        xaxis={"title": "parallel streams", "type": "log", "tickvals": streams, "ticktext": streams},
        yaxis={"title": "GB/s", "rangemode": "tozero"},
    )
    return output(fig, widget)
