"""Plotly figures of experiments, probes, interval advice and projections.

Every builder takes DataFrames (the schemas of ``Comparison.results``, ``Comparison.timeline``,
``ProbeResult.to_pandas()`` and :mod:`nbckpt.analysis`) and returns a static ``go.Figure``, or a
live ``go.FigureWidget`` with ``widget=True`` (which needs ``anywidget``). For live timelines,
:func:`extend_timeline` appends new events to a figure made by :func:`timeline_figure`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from .._errors import ConfigError
from ..analysis import load_published, waste_curve
from ..engine import Event, events_to_pandas

__all__ = [
    "TIMELINE_KINDS",
    "TimelineTraces",
    "anchor_factors",
    "events_frame",
    "extend_timeline",
    "interval_figure",
    "load_published",
    "overhead_figure",
    "probe_figure",
    "projection_figure",
    "scaling_data",
    "scaling_figure",
    "select_repeat",
    "stall_figure",
    "strategy_colour",
    "throughput_figure",
    "timeline_figure",
    "timeline_traces",
]

#: Event kind -> (timeline lane, colour, bar thickness). Blocking kinds go in the "train" lane,
#: work done behind the training loop in the "background" lane; fsync and delete are thin so the
#: persist bar they happen inside stays visible.
TIMELINE_KINDS: dict[str, tuple[str, str, float]] = {
    "step": ("train", "#9ecae1", 0.7),
    "stall": ("train", "#d62728", 0.7),
    "wait": ("train", "#ff7f0e", 0.7),
    "restore": ("train", "#bcbd22", 0.7),
    "stage": ("background", "#9467bd", 0.7),
    "persist": ("background", "#2ca02c", 0.7),
    "commit": ("background", "#8c564b", 0.7),
    "fsync": ("background", "#17becf", 0.3),
    "delete": ("background", "#7f7f7f", 0.3),
    "error": ("background", "#000000", 0.9),
}
_OTHER_KIND = ("background", "#c7c7c7", 0.5)

_STRATEGY_COLOURS = {
    "none": "#7f7f7f",
    "torch-save": "#d62728",
    "dcp-sync": "#ff7f0e",
    "dcp-async": "#bcbd22",
    "dcp-async-process": "#8c564b",
    "dcp-async-stager": "#e377c2",
    "nbckpt-sync": "#9467bd",
    "nbckpt-async": "#2ca02c",
    "nbckpt-async-overlap": "#1f77b4",
}

_TIMELINE_COLUMNS = {"kind", "start_s", "end_s"}


def strategy_colour(strategy: str) -> str:
    """The colour a strategy has in every figure (strategies not built in get a stable one)."""
    if strategy in _STRATEGY_COLOURS:
        return _STRATEGY_COLOURS[strategy]
    palette = qualitative.Dark24
    return str(palette[sum(strategy.encode()) % len(palette)])


def _output(fig: go.Figure, widget: bool) -> go.Figure:
    """The one place that turns a static figure into a live widget."""
    return go.FigureWidget(fig) if widget else fig


def _require(df: pd.DataFrame, columns: Iterable[str], figure: str) -> None:
    if not isinstance(df, pd.DataFrame):
        raise ConfigError(f"{figure} needs a pandas DataFrame, got {type(df).__name__}")
    missing = sorted(set(columns) - set(df.columns))
    if missing:
        got = ", ".join(map(str, df.columns))
        raise ConfigError(f"{figure} needs columns {', '.join(missing)}; got {got}")


def _strategy_names(df: pd.DataFrame) -> pd.Series:
    """Strategy of each event row: ``strategy``, else ``label`` (what the engine's events carry)."""
    if "strategy" in df.columns:
        names = df["strategy"]
    elif "label" in df.columns:
        names = df["label"]
    else:
        names = pd.Series("run", index=df.index)
    return names.fillna("").astype(str).replace("", "run")


def _series_names(df: pd.DataFrame, by_rank: bool | None = None) -> pd.Series:
    """Strategy of each event row, with its rank when ``by_rank`` (default: when there are several)."""
    names = _strategy_names(df)
    if by_rank is None:
        by_rank = "rank" in df.columns and df["rank"].nunique() > 1
    if by_rank:
        names = names + " r" + df["rank"].astype(str)
    return names


def select_repeat(timeline_df: pd.DataFrame, repeat: int | None = None) -> pd.DataFrame:
    """The events of one repeat of each strategy (default: each strategy's last, the warmest)."""
    if "repeat" not in timeline_df.columns or timeline_df.empty:
        return timeline_df
    if repeat is not None:
        return timeline_df[timeline_df["repeat"] == repeat]
    last = timeline_df.groupby(_strategy_names(timeline_df))["repeat"].transform("max")
    return timeline_df[timeline_df["repeat"] == last]


@dataclass
class TimelineTraces:
    """Bar data of a timeline: the lanes in display order and, per event kind, the lists that
    go into a horizontal ``go.Bar`` (``x`` durations, ``base`` starts, ``y`` lanes, ``hovertext``)."""

    lanes: list[str] = field(default_factory=list)
    kinds: dict[str, dict[str, list[Any]]] = field(default_factory=dict)


def _hover(series: str, kind: str, step: Any, start: float, duration: float, nbytes: float) -> str:
    text = f"<b>{series}</b> {kind}"
    if step is not None and pd.notna(step):
        text += f" · step {int(step)}"
    text += f"<br>start {start:.3f} s · {duration * 1e3:.1f} ms"
    if nbytes > 0:
        text += f"<br>{nbytes / 1e6:.1f} MB"
        if duration > 0:
            text += f" · {nbytes / duration / 1e9:.2f} GB/s"
    return text


def events_frame(events: Iterable[Event], origin_ns: int) -> pd.DataFrame:
    """Rows for :func:`timeline_traces` from live :class:`~nbckpt.Event` objects (for example
    those ``compare(on_event=...)`` passes); ``start_s`` counts from ``origin_ns``, ``strategy``
    is the event's label."""
    frame = events_to_pandas(events, origin_ns)
    frame.insert(0, "strategy", frame["label"])
    return frame


def timeline_traces(timeline_df: pd.DataFrame, *, by_rank: bool | None = None) -> TimelineTraces:
    """Convert event rows (``Timeline.to_pandas()`` columns, optionally ``strategy``) to bar data.

    Used by :func:`timeline_figure` and, for live updates, by :func:`extend_timeline`. ``by_rank``
    gives each rank its own lanes (default: when the rows hold several ranks; pass it explicitly
    when rows arrive a few at a time).
    """
    _require(timeline_df, _TIMELINE_COLUMNS, "timeline_traces")
    data = TimelineTraces()
    if timeline_df.empty:
        return data
    series = _series_names(timeline_df, by_rank)
    steps = timeline_df["step"] if "step" in timeline_df.columns else pd.Series(None, index=timeline_df.index)
    nbytes = timeline_df["bytes"] if "bytes" in timeline_df.columns else pd.Series(0, index=timeline_df.index)
    for name, kind, step, start, end, size in zip(
        series, timeline_df["kind"], steps, timeline_df["start_s"], timeline_df["end_s"], nbytes, strict=True
    ):
        lane_kind = TIMELINE_KINDS.get(str(kind), _OTHER_KIND)[0]
        for lane in (f"{name} · train", f"{name} · background"):
            if lane not in data.lanes:
                data.lanes.append(lane)
        lane = f"{name} · {lane_kind}"
        values = data.kinds.setdefault(str(kind), {"x": [], "y": [], "base": [], "hovertext": []})
        duration = float(end) - float(start)
        values["x"].append(duration)
        values["base"].append(float(start))
        values["y"].append(lane)
        values["hovertext"].append(
            _hover(name, str(kind), step, float(start), duration, float(size) if pd.notna(size) else 0.0)
        )
    return data


def _kind_order(kinds: Iterable[str]) -> list[str]:
    known = [kind for kind in TIMELINE_KINDS if kind in kinds]
    return known + sorted(set(kinds) - set(known))


def _timeline_bar(kind: str, values: Mapping[str, list[Any]]) -> go.Bar:
    _, colour, width = TIMELINE_KINDS.get(kind, _OTHER_KIND)
    return go.Bar(
        name=kind,
        orientation="h",
        x=values["x"],
        base=values["base"],
        y=values["y"],
        width=width,
        marker={"color": colour, "line": {"width": 0}},
        hovertext=values["hovertext"],
        hovertemplate="%{hovertext}<extra></extra>",
    )


def _timeline_height(lanes: int) -> int:
    return 140 + 30 * max(lanes, 2)


def timeline_figure(
    timeline_df: pd.DataFrame,
    *,
    repeat: int | None = None,
    by_rank: bool | None = None,
    widget: bool = False,
) -> go.Figure:
    """Gantt chart of a run: per strategy (and rank) a "train" lane (steps, stalls, waits) and a
    "background" lane (staging, persistence, fsync, commit).

    A sync strategy's train lane stops for each checkpoint (red); an async one keeps stepping while
    its persistence (green) runs in the background lane. ``repeat`` picks one repeat of a
    ``Comparison.timeline`` (default: each strategy's last).
    """
    data = timeline_traces(select_repeat(timeline_df, repeat), by_rank=by_rank)
    fig = go.Figure([_timeline_bar(kind, data.kinds[kind]) for kind in _kind_order(data.kinds)])
    fig.update_layout(
        title="Timeline: training steps, stalls (red) and background persistence (green)",
        barmode="overlay",
        height=_timeline_height(len(data.lanes)),
        xaxis_title="seconds since the strategy's run started",
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": data.lanes,
               "autorange": "reversed"},
        legend={"title_text": "event", "orientation": "h", "yanchor": "bottom", "y": 1.0,
                "xanchor": "right", "x": 1.0},
        margin={"t": 90},
    )
    return _output(fig, widget)


def extend_timeline(fig: go.Figure, timeline_df: pd.DataFrame, *, by_rank: bool = False) -> None:
    """Append new events to a figure (or FigureWidget) from :func:`timeline_figure`, in one update.

    New kinds get new traces and new strategies new lanes, so a widget can start empty and grow
    as ``on_event`` callbacks arrive (see :func:`events_frame`). ``by_rank=True`` for runs with
    several ranks.
    """
    data = timeline_traces(timeline_df, by_rank=by_rank)
    if not data.kinds:
        return
    with fig.batch_update():
        traces = {trace.name: trace for trace in fig.data}
        for kind in _kind_order(data.kinds):
            values = data.kinds[kind]
            trace = traces.get(kind)
            if trace is None:
                fig.add_trace(_timeline_bar(kind, values))
                continue
            for key in ("x", "base", "y", "hovertext"):
                setattr(trace, key, tuple(getattr(trace, key) or ()) + tuple(values[key]))
        lanes = list(fig.layout.yaxis.categoryarray or ())
        added = [lane for lane in data.lanes if lane not in lanes]
        if added:
            fig.layout.yaxis.categoryarray = lanes + added
            fig.layout.height = _timeline_height(len(lanes) + len(added))


def throughput_figure(
    timeline_df: pd.DataFrame, *, repeat: int | None = None, widget: bool = False
) -> go.Figure:
    """Steps per second over time per strategy: ``1 / (time between consecutive step ends)``,
    so a checkpoint that holds the loop shows as a dip at the step after it."""
    _require(timeline_df, _TIMELINE_COLUMNS, "throughput_figure")
    events = select_repeat(timeline_df, repeat)
    events = events.assign(series=_series_names(events), strategy_name=_strategy_names(events))
    steps = events[events["kind"] == "step"]
    stalls = events[events["kind"] == "stall"]
    saved = set(zip(stalls["series"], stalls["step"], strict=True)) if "step" in stalls else set()
    fig = go.Figure()
    for name, group in steps.groupby("series", sort=False):
        group = group.sort_values("end_s")
        ends = group["end_s"].astype(float).tolist()
        first = float(group["end_s"].iloc[0] - group["start_s"].iloc[0])
        gaps = [first] + [later - earlier for earlier, later in itertools.pairwise(ends)]
        rates = [1.0 / gap if gap > 0 else None for gap in gaps]
        colour = strategy_colour(str(group["strategy_name"].iloc[0]))
        fig.add_trace(
            go.Scatter(
                name=str(name),
                x=ends,
                y=rates,
                mode="lines+markers",
                line={"color": colour},
                legendgroup=str(name),
                hovertemplate="%{x:.3f} s: %{y:.1f} steps/s<extra>%{fullData.name}</extra>",
            )
        )
        numbers = group["step"].tolist() if "step" in group else []
        after = [i for i in range(1, len(numbers)) if (name, numbers[i - 1]) in saved]
        if after:
            fig.add_trace(
                go.Scatter(
                    name=f"{name} after a checkpoint",
                    x=[ends[i] for i in after],
                    y=[rates[i] for i in after],
                    mode="markers",
                    marker={"color": colour, "symbol": "x", "size": 10},
                    legendgroup=str(name),
                    showlegend=False,
                    hovertemplate="%{x:.3f} s: %{y:.1f} steps/s, the step after a checkpoint"
                                  "<extra>%{fullData.name}</extra>",
                )
            )
    fig.update_layout(
        title="Training throughput per step (x: the step after a checkpoint); the none baseline "
              "dips only from this machine's own noise",
        xaxis_title="seconds since the strategy's run started",
        yaxis_title="steps per second",
    )
    return _output(fig, widget)


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
    published: Mapping[str, Any] | None = None,
    *,
    anchors: bool = True,
    log: bool = False,
    widget: bool = False,
) -> go.Figure:
    """Left: mean stall per checkpoint by strategy (error bar up to p95). Right: how many times
    shorter each stall is than a synchronous save's: ``dcp-sync``'s when it was measured, with
    the published factor that compares the same thing (PyTorch/IBM: synchronous DCP against
    ``async_save``, 23.6x for a 7B model on GPUs) as a reference line; else ``torch-save``'s,
    with no published line (no source compares against torch.save). Partial rows are left out.
    ``published`` defaults to ``load_published()``."""
    _require(results_df, {"strategy", "stall_mean_s"}, "stall_figure")
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
        showlegend=False,
    )
    if log:
        fig.update_yaxes(type="log")
    return _output(fig, widget)


def overhead_figure(results_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Overhead against the ``none`` baseline per strategy: the mean over repeats with its 95 %
    interval as error bars (``overhead_ci_pct``), bars whose interval contains 0 labelled "no
    measurable difference", partial rows left out (``nbckpt.bench.OVERHEAD_DEFINITION``)."""
    _require(results_df, {"strategy", "overhead_pct", "overhead_ci_pct"}, "overhead_figure")
    from ..bench import measurable

    rows = results_df[results_df["strategy"] != "none"]
    if "partial" in rows.columns:
        rows = rows[~rows["partial"].fillna(False).astype(bool)]
    rows = rows[rows["overhead_pct"].notna()]
    names = rows["strategy"].astype(str).tolist()
    points = rows["overhead_pct"].astype(float).tolist()
    intervals = [tuple(float(v) for v in ci) for ci in rows["overhead_ci_pct"]]
    above = [max(hi - point, 0.0) for point, (_lo, hi) in zip(points, intervals, strict=True)]
    below = [max(point - lo, 0.0) for point, (lo, _hi) in zip(points, intervals, strict=True)]
    texts = [f"{point:+.1f} %" if measurable(ci) else "no measurable difference"
             for point, ci in zip(points, intervals, strict=True)]
    fig = go.Figure(go.Bar(
        name="overhead",
        x=names,
        y=points,
        error_y={"type": "data", "array": above, "arrayminus": below},
        marker_color=[strategy_colour(name) for name in names],
        text=texts,
        textposition="outside",
        hovertext=[f"{name}: {text}, 95 % interval [{lo:+.1f}, {hi:+.1f}] %"
                   for name, text, (lo, hi) in zip(names, texts, intervals, strict=True)],
        hovertemplate="%{hovertext}<extra></extra>",
        showlegend=False,
    ))
    fig.add_hline(y=0.0, line={"color": "#444444", "width": 1})
    fig.update_layout(
        title="Overhead against training without checkpoints: mean of the repeats, 95 % interval",
        yaxis_title="% longer training loop than the none baseline of the same repeat",
    )
    return _output(fig, widget)


def scaling_data(comparisons: Iterable[Any]) -> pd.DataFrame:
    """Stack the results of comparisons run at different sizes for :func:`scaling_figure`:
    each ``Comparison.results`` row with the checkpoint size (``Comparison.bytes``) in ``bytes``."""
    frames = []
    for comparison in comparisons:
        _require(comparison.results, {"strategy", "stall_mean_s"}, "scaling_data")
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
    _require(df, {"strategy", "bytes", "stall_mean_s"}, "scaling_figure")
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
    return _output(fig, widget)


def interval_figure(advice_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Expected time lost against checkpoint interval per strategy, the advised interval marked
    (from :func:`nbckpt.analysis.advise`)."""
    _require(advice_df, {"strategy", "interval_s", "waste_pct"}, "interval_figure")
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
    return _output(fig, widget)


def projection_figure(projection_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Projected stall per checkpoint and overhead by model size and rank count per strategy
    (from :func:`nbckpt.analysis.project_scale`), titled as a projection."""
    _require(projection_df, {"strategy", "model", "ranks", "stall_s", "overhead_pct"}, "projection_figure")
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
    return _output(fig, widget)


def probe_figure(probe_df: pd.DataFrame, *, widget: bool = False) -> go.Figure:
    """Write (and read, when measured) bandwidth against parallel streams, from
    ``ProbeResult.to_pandas()``."""
    _require(probe_df, {"streams", "write_gbs"}, "probe_figure")
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
    return _output(fig, widget)
