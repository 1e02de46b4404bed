"""Timeline figures: a run's phases as lanes of bars, and training throughput over time.

Both read event rows (``Timeline.to_pandas()`` columns, and in ``Comparison.timeline`` also
``strategy`` and ``repeat``). :func:`extend_timeline` appends new events to a figure made by
:func:`timeline_figure`, so a live widget can grow as events arrive.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from .._util import GB, format_bytes
from ..engine import Event
from ..engine._internal import events_to_pandas
from ._plotting import output, require_columns, strategy_colour

__all__ = [
    "TIMELINE_KINDS",
    "TimelineTraces",
    "events_frame",
    "extend_timeline",
    "rank_events",
    "select_repeat",
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
    "compare": ("train", "#e377c2", 0.3),  # incremental saves: fingerprints, inside the stall
    "restore": ("train", "#bcbd22", 0.7),
    "stage": ("background", "#9467bd", 0.7),
    "persist": ("background", "#2ca02c", 0.7),
    "commit": ("background", "#8c564b", 0.7),
    "fsync": ("background", "#17becf", 0.3),
    "delete": ("background", "#7f7f7f", 0.3),
    "error": ("background", "#000000", 0.9),
}
_OTHER_KIND = ("background", "#c7c7c7", 0.5)

_TIMELINE_COLUMNS = {"kind", "start_s", "end_s"}


def _strategy_names(df: pd.DataFrame) -> pd.Series:
    """Strategy of each event row: ``strategy``, else ``label`` (what the engine's events carry)."""
    names = df.get("strategy", df.get("label", pd.Series("run", index=df.index)))
    return names.fillna("").astype(str).replace("", "run")


def _series_names(df: pd.DataFrame, by_rank: bool | None = None) -> pd.Series:
    """Strategy of each event row, with its rank when ``by_rank`` (default: when there are several)."""
    if by_rank is None:
        by_rank = "rank" in df.columns and df["rank"].nunique() > 1
    return _strategy_names(df) + (" r" + df["rank"].astype(str) if by_rank else "")


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


def events_frame(events: Iterable[Event], origin_ns: int) -> pd.DataFrame:
    """Rows for :func:`timeline_traces` from live :class:`~nbckpt.Event` objects (for example
    those ``compare(on_event=...)`` passes); ``start_s`` counts from ``origin_ns``, ``strategy``
    is the event's label."""
    frame = events_to_pandas(events, origin_ns)
    frame.insert(0, "strategy", frame["label"])
    return frame


def rank_events(rank_timeline: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """``Comparison.rank_timeline`` (every rank's events, wall-clock ns) as event rows for
    :func:`timeline_figure` with ``by_rank=True``: seconds since the run's first event on any rank."""
    frame = pd.DataFrame(list(rank_timeline))
    if frame.empty:
        columns = ["strategy", "repeat", "rank", "kind", "step", "bytes", "start_s", "end_s"]
        return pd.DataFrame(columns=columns)
    origin = int(frame["start_ns"].min())
    return frame.assign(
        start_s=(frame["start_ns"] - origin) / 1e9, end_s=(frame["end_ns"] - origin) / 1e9
    ).drop(columns=["start_ns", "end_ns"])


def timeline_traces(timeline_df: pd.DataFrame, *, by_rank: bool | None = None) -> TimelineTraces:
    """Event rows (``Timeline.to_pandas()`` columns, optionally ``strategy``) as bar data, for
    :func:`timeline_figure` and :func:`extend_timeline`. ``by_rank`` gives each rank its own lanes
    (default: when the rows hold several ranks; pass it when rows arrive a few at a time)."""
    require_columns(timeline_df, _TIMELINE_COLUMNS, "timeline_traces")
    data = TimelineTraces()
    if timeline_df.empty:
        return data
    events = timeline_df.assign(
        series=_series_names(timeline_df, by_rank),
        step=timeline_df.get("step"),
        bytes=timeline_df.get("bytes", 0.0),
    )
    data.lanes = [
        f"{name} · {lane}" for name in events["series"].unique() for lane in ("train", "background")
    ]
    for row in events.to_dict("records"):
        kind = str(row["kind"])
        values = data.kinds.setdefault(kind, {"x": [], "y": [], "base": [], "hovertext": []})
        start, duration = float(row["start_s"]), float(row["end_s"]) - float(row["start_s"])
        values["x"].append(duration)
        values["base"].append(start)
        values["y"].append(f"{row['series']} · {TIMELINE_KINDS.get(kind, _OTHER_KIND)[0]}")
        hover = f"<b>{row['series']}</b> {kind}"
        if pd.notna(row["step"]):
            hover += f" · step {int(row['step'])}"
        hover += f"<br>start {start:.3f} s · {duration * 1e3:.1f} ms"
        nbytes = float(row["bytes"]) if pd.notna(row["bytes"]) else 0.0
        if nbytes > 0:
            hover += f"<br>{format_bytes(nbytes)}"
            if duration > 0:
                hover += f" · {nbytes / duration / GB:.2f} GB/s"
        values["hovertext"].append(hover)
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


#: The legend of the timeline and throughput figures: right of the plot, outside it.
_SIDE_LEGEND = {"title_text": "event", "x": 1.02, "xanchor": "left", "y": 1.0, "yanchor": "top"}


def _origin(timeline_df: pd.DataFrame) -> str:
    """What time 0 is: a comparison's timeline has its repeats; a Checkpointer's has no strategies."""
    return "the strategy's run started" if "repeat" in timeline_df.columns else "the timeline began"


def _timeline_height(lanes: int) -> int:
    return 140 + 30 * max(lanes, 2)


def timeline_figure(
    timeline_df: pd.DataFrame,
    *,
    repeat: int | None = None,
    by_rank: bool | None = None,
    widget: bool = False,
    origin: str | None = None,
) -> go.Figure:
    """Gantt chart of a run: per strategy (and rank) a "train" lane (steps, stalls, waits) and a
    "background" lane (staging, persistence, fsync, commit). ``repeat`` picks one repeat of a
    ``Comparison.timeline`` (default: each strategy's last); ``origin`` says what time 0 is
    (default: the strategy's run for a comparison's timeline, else the timeline's start)."""
    require_columns(timeline_df, _TIMELINE_COLUMNS, "timeline_figure")  # before _origin reads it
    if origin is None:
        origin = _origin(timeline_df)
    data = timeline_traces(select_repeat(timeline_df, repeat), by_rank=by_rank)
    fig = go.Figure([_timeline_bar(kind, data.kinds[kind]) for kind in _kind_order(data.kinds)])
    fig.update_layout(
        title="Timeline: training steps, stalls (red) and background persistence (green)",
        barmode="overlay",
        height=_timeline_height(len(data.lanes)),
        xaxis_title=f"seconds since {origin}",
        yaxis={
            "type": "category",
            "categoryorder": "array",
            "categoryarray": data.lanes,
            "autorange": "reversed",
        },
        # right of the lanes, one kind a line: a horizontal legend above them wrapped into the
        # title once a run had more kinds than the width held
        legend=_SIDE_LEGEND,
    )
    return output(fig, widget)


def extend_timeline(fig: go.Figure, timeline_df: pd.DataFrame, *, by_rank: bool = False) -> None:
    """Append new events to a figure (or FigureWidget) from :func:`timeline_figure` in one update:
    new kinds get new traces and new strategies new lanes, so a live widget can start empty."""
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
    require_columns(timeline_df, _TIMELINE_COLUMNS, "throughput_figure")
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
        title="Training throughput per step (x: the step after a checkpoint)<br><sup>the none baseline "
        "dips only from this machine's own noise</sup>",
        xaxis_title=f"seconds since {_origin(timeline_df)}",
        yaxis_title="steps per second",
        legend={**_SIDE_LEGEND, "title_text": "strategy"},
    )
    return output(fig, widget)
