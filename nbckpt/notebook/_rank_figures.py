"""Figures of a bench on many ranks (``nbckpt report --from``): a swimlane per rank grouped by
host, the stall over ranks, the aggregate write rate per checkpoint and over time, and the
measured scaling curve. Each draws a table of :mod:`nbckpt.analysis._job_report` (the numbers
live there, tested without plotly)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ._plotting import require_columns, strategy_colour
from ._timeline_figures import TIMELINE_KINDS

__all__ = [
    "checkpoint_rate_figure",
    "rank_stall_figure",
    "rate_over_time_figure",
    "scaling_figure",
    "swimlane_figure",
]

# Within a rank's lane the loop's events (steps, stalls) take the upper half and the work behind
# it (staging, persist, commit) the lower, so that both show where they overlap in time.
_HALF = {"train": -0.42, "background": 0.0}


def swimlane_figure(lanes: pd.DataFrame, strategy: str) -> go.Figure:
    """One lane per rank, grouped by host (rows of ``analysis._job_report.swimlanes``): training
    steps and stalls on top, staging, persistence and commit below, on the ranks' shared clock."""
    require_columns(lanes, {"lane", "kind", "start_s", "end_s"}, "swimlane_figure")
    order = list(dict.fromkeys(lanes["lane"]))
    fig = go.Figure()
    for kind, group in lanes.groupby("kind", sort=False):
        where, colour, _ = TIMELINE_KINDS.get(str(kind), ("background", "#c7c7c7", 0.5))
        durations = (group["end_s"] - group["start_s"]).astype(float)
        hover = [
            f"<b>{lane}</b> {kind}"
            + (f" · step {int(step)}" if pd.notna(step) else "")
            + f"<br>start {start:.3f} s · {duration * 1e3:.1f} ms"
            for lane, step, start, duration in zip(
                group["lane"], group["step"], group["start_s"], durations, strict=True
            )
        ]
        fig.add_trace(
            go.Bar(
                name=str(kind),
                orientation="h",
                y=group["lane"].tolist(),
                x=durations.tolist(),
                base=group["start_s"].astype(float).tolist(),
                offset=_HALF[where],
                width=0.4,
                marker={"color": colour, "line": {"width": 0}},
                hovertext=hover,
                hovertemplate="%{hovertext}<extra></extra>",
            )
        )
    fig.update_layout(
        title=f"{strategy}: every rank's steps and stalls (upper half) and background writes (lower)",
        barmode="overlay",
        height=140 + 36 * max(len(order), 2),
        xaxis_title="seconds since the repeat's first event on any rank",
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": order, "autorange": "reversed"},
        legend={
            "title_text": "event",
            "orientation": "h",
            "yanchor": "bottom",
            "y": 1.0,
            "xanchor": "right",
            "x": 1.0,
        },
        margin={"t": 90},
    )
    return fig


def rank_stall_figure(ranks: pd.DataFrame, stragglers: pd.DataFrame) -> go.Figure:
    """Each rank's mean stall per checkpoint, per strategy (``analysis._job_report.rank_rows``),
    the straggler of each (``job_table``'s ``straggler_rank``) marked."""
    require_columns(ranks, {"strategy", "rank", "host", "stall_s"}, "rank_stall_figure")
    late = dict(zip(stragglers["strategy"], stragglers["straggler_rank"], strict=True))
    fig = go.Figure()
    for name, group in ranks.groupby("strategy", sort=False):
        is_late = [late.get(name) is not None and rank == late.get(name) for rank in group["rank"]]
        colour = strategy_colour(str(name))
        stalls = group["stall_s"].astype(float).tolist()
        fig.add_trace(
            go.Box(name=str(name), y=stalls, boxpoints=False, line={"color": colour}, hoverinfo="skip")
        )
        fig.add_trace(
            go.Scatter(
                name=str(name),
                x=[str(name)] * len(group),
                y=stalls,
                mode="markers",
                marker={
                    "color": colour,
                    "symbol": ["star" if flag else "circle" for flag in is_late],
                    "size": [14 if flag else 7 for flag in is_late],
                },
                hovertext=[
                    f"rank {rank} on {host}" + (" (straggler)" if flag else "")
                    for rank, host, flag in zip(group["rank"], group["host"], is_late, strict=True)
                ],
                hovertemplate="%{hovertext}: %{y:.4f} s<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_layout(
        title="Stall per checkpoint on each rank (a star: the straggler)",
        yaxis_title="mean stall per checkpoint (s)",
        showlegend=False,
    )
    return fig


def checkpoint_rate_figure(checkpoints: pd.DataFrame, floor_gbs: float) -> go.Figure:
    """Every checkpoint's aggregate write rate (all ranks' bytes over first start to last commit;
    ``analysis._job_report.checkpoint_rates``) beside the concurrent raw-write floor."""
    require_columns(
        checkpoints, {"strategy", "repeat", "step", "aggregate_write_gbs"}, "checkpoint_rate_figure"
    )
    fig = go.Figure()
    for name, group in checkpoints.groupby("strategy", sort=False):
        fig.add_trace(
            go.Bar(
                name=str(name),
                x=[f"repeat {r} · step {s}" for r, s in zip(group["repeat"], group["step"], strict=True)],
                y=group["aggregate_write_gbs"].astype(float).tolist(),
                marker_color=strategy_colour(str(name)),
                hovertemplate="%{x}: %{y:.3f} GB/s<extra>%{fullData.name}</extra>",
            )
        )
    if floor_gbs == floor_gbs:  # not NaN
        fig.add_hline(
            y=floor_gbs,
            line_dash="dash",
            line_color="#444",
            annotation_text=f"every rank writing raw at once: {floor_gbs:.2f} GB/s",
        )
    fig.update_layout(
        title="Aggregate write rate of each checkpoint, all ranks together",
        yaxis_title="GB/s (all ranks' bytes / time to durable)",
        barmode="group",
    )
    return fig


def rate_over_time_figure(rates: dict[str, pd.DataFrame]) -> go.Figure:
    """All ranks' persist rate over time, per strategy (``analysis._job_report.rate_over_time``)."""
    fig = go.Figure()
    for name, frame in rates.items():
        fig.add_trace(
            go.Scatter(
                name=name,
                x=frame["start_s"].astype(float).tolist(),
                y=frame["write_gbs"].astype(float).tolist(),
                mode="lines",
                line={"shape": "hv", "color": strategy_colour(name)},
                hovertemplate="%{x:.3f} s: %{y:.3f} GB/s<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_layout(
        title="Aggregate write rate over time (all ranks' persists, last repeat)",
        xaxis_title="seconds since the strategy's repeat started on any rank",
        yaxis_title="GB/s",
    )
    return fig


#: The concurrent raw-write floors the curve draws: the idle one (what the storage gives this
#: many writers, no rank training) and, where the ranks trained on the host, the one beside
#: training (what it gives them while the host's cores also train).
_FLOORS = (
    ("concurrent_floor_gbs", "concurrent raw-write floor", "dash"),
    ("floor_beside_training_gbs", "concurrent raw-write floor beside training", "dot"),
)


def scaling_figure(table: pd.DataFrame) -> go.Figure:
    """The measured curve (``analysis._job_report.scaling_table``): aggregate write rate beside
    the concurrent raw-write floors (idle, and beside training where measured), the stall
    (median, bar to the max) and the overhead at the slowest rank, against the number of ranks;
    points only where a run was measured."""
    require_columns(
        table,
        {
            "ranks",
            "strategy",
            "aggregate_write_gbs",
            "concurrent_floor_gbs",
            "stall_median_s",
            "stall_max_s",
            "overhead_pct",
        },
        "scaling_figure",
    )
    fig = make_subplots(
        rows=1,
        cols=3,
        horizontal_spacing=0.08,
        subplot_titles=(
            "aggregate write GB/s",
            "stall per checkpoint over ranks (s)",
            "overhead at the slowest rank (%)",
        ),
    )
    ranks = sorted(set(int(count) for count in table["ranks"]))
    floors = table.drop_duplicates("ranks").sort_values("ranks")
    for column, label, dash in _FLOORS:
        values = floors[column].astype(float) if column in floors else pd.Series(dtype=float)
        if not values.notna().any():  # the floor beside training: host compute only
            continue
        fig.add_trace(
            go.Scatter(
                name=label,
                x=floors["ranks"].tolist(),
                y=values.tolist(),  # NaN (a gap) at a size that did not measure it
                mode="lines+markers",
                line={"dash": dash, "color": "#444"},
            ),
            row=1,
            col=1,
        )
    for name, group in table.groupby("strategy", sort=False):
        group = group.sort_values("ranks")
        style = {"color": strategy_colour(str(name))}
        common = {
            "name": str(name),
            "x": group["ranks"].tolist(),
            "mode": "lines+markers",
            "legendgroup": str(name),
            "line": style,
        }
        fig.add_trace(
            go.Scatter(y=group["aggregate_write_gbs"].astype(float).tolist(), **common), row=1, col=1
        )
        median = group["stall_median_s"].astype(float)
        above = (group["stall_max_s"].astype(float) - median).tolist()  # the bar reaches the max
        fig.add_trace(
            go.Scatter(
                y=median.tolist(),
                showlegend=False,
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": above,
                    "arrayminus": [0.0] * len(group),
                },
                **common,
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(y=group["overhead_pct"].astype(float).tolist(), showlegend=False, **common),
            row=1,
            col=3,
        )
    fig.update_xaxes(title_text="ranks", tickvals=ranks)
    fig.update_layout(
        title=f"Measured on {', '.join(map(str, ranks))} ranks (no projection beyond)", height=420
    )
    return fig
