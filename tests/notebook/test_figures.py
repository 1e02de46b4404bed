"""nbckpt.notebook figures: checked on their traces and data, from hand-made DataFrames."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import pytest
from helpers import ROOT

from nbckpt import ConfigError, Timeline
from nbckpt.analysis import advise, read_jobs, scaling_table
from nbckpt.analysis._internal import load_published
from nbckpt.bench import Comparison
from nbckpt.notebook import (
    interval_figure,
    overhead_figure,
    probe_figure,
    scaling_figure,
    stall_figure,
    throughput_figure,
    timeline_figure,
)
from nbckpt.notebook._plotting import strategy_colour
from nbckpt.notebook._timeline_figures import events_frame, extend_timeline, timeline_traces

MB = 10**6


def event(
    strategy: str,
    kind: str,
    start: float,
    end: float,
    step: int | None = None,
    nbytes: int = 0,
    rank: int = 0,
    repeat: int = 0,
) -> dict[str, Any]:
    """One row of ``Comparison.timeline``: ``Timeline.to_pandas()`` columns + strategy, repeat."""
    return {
        "kind": kind,
        "label": strategy,
        "step": step,
        "rank": rank,
        "start_s": start,
        "end_s": end,
        "duration_s": end - start,
        "bytes": nbytes,
        "thread": "MainThread",
        "pid": 1,
        "start_ns": int(start * 1e9),
        "end_ns": int(end * 1e9),
        "strategy": strategy,
        "repeat": repeat,
    }


def sync_and_async_timeline(repeat: int = 0) -> pd.DataFrame:
    """Four 0.1 s steps each, a checkpoint after steps 2 and 4: torch-save stalls 0.5 s while it
    writes; nbckpt-async stalls 0.02 s to stage and persists for 0.38 s behind the next steps."""

    def run(strategy: str, stall_s: float, background: Any) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        clock = 0.0
        for step in range(1, 5):
            rows.append(event(strategy, "step", clock, clock + 0.1, step, repeat=repeat))
            clock += 0.1
            if step % 2 == 0:
                rows.append(event(strategy, "stall", clock, clock + stall_s, step, 100 * MB, repeat=repeat))
                rows += background(clock, step)
                clock += stall_s
        return rows

    def torch_save(clock: float, step: int) -> list[dict[str, Any]]:
        return [event("torch-save", "persist", clock, clock + 0.5, step, 100 * MB, repeat=repeat)]

    def nbckpt_async(clock: float, step: int) -> list[dict[str, Any]]:
        return [
            event("nbckpt-async", "stage", clock, clock + 0.02, step, 100 * MB, repeat=repeat),
            event("nbckpt-async", "persist", clock + 0.02, clock + 0.4, step, 100 * MB, repeat=repeat),
            event("nbckpt-async", "commit", clock + 0.38, clock + 0.4, step, repeat=repeat),
        ]

    return pd.DataFrame(run("torch-save", 0.5, torch_save) + run("nbckpt-async", 0.02, nbckpt_async))


RESULTS = pd.DataFrame(
    {
        "strategy": ["none", "torch-save", "nbckpt-async"],
        "steps": [20, 20, 20],
        "checkpoints": [0, 4, 4],
        "mean_step_s": [0.1, 0.1, 0.1],
        "stall_mean_s": [math.nan, 0.5, 0.02],
        "stall_p95_s": [math.nan, 0.6, 0.03],
        "overhead_pct": [0.0, 100.0, 4.0],
        "persist_s": [math.nan, 0.5, 0.38],
        "write_gbs": [math.nan, 0.2, 0.26],
        "reduction_vs_torch_save": [math.nan, 1.0, 25.0],
    }
)


def traces_by_name(fig: go.Figure) -> dict[str, Any]:
    return {trace.name: trace for trace in fig.data}


def test_timeline_lanes_and_kinds() -> None:
    fig = timeline_figure(sync_and_async_timeline())
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    assert list(fig.layout.yaxis.categoryarray) == [
        "torch-save · train",
        "torch-save · background",
        "nbckpt-async · train",
        "nbckpt-async · background",
    ]
    traces = traces_by_name(fig)
    assert list(traces) == ["step", "stall", "stage", "persist", "commit"]
    assert {trace.orientation for trace in fig.data} == {"h"}
    assert len(traces["step"].x) == 8
    stall = traces["stall"]
    # torch-save's first stall starts after two 0.1 s steps and lasts 0.5 s
    assert stall.base[0] == pytest.approx(0.2) and stall.x[0] == pytest.approx(0.5)
    assert stall.y[0] == "torch-save · train"
    assert set(traces["persist"].y) == {"torch-save · background", "nbckpt-async · background"}
    assert "step 2" in stall.hovertext[0] and "100.0 MB" in stall.hovertext[0]
    assert traces["stall"].marker.color != traces["persist"].marker.color
    assert fig.layout.xaxis.title.text == "seconds since the strategy's run started"
    # a notebook session's timeline has no strategy: its caller says where its times count from
    session = timeline_figure(sync_and_async_timeline(), origin="the session started")
    assert session.layout.xaxis.title.text == "seconds since the session started"


def test_timeline_shows_async_training_on_while_persisting() -> None:
    data = timeline_traces(sync_and_async_timeline())

    def total(kind: str, lane: str) -> float:
        values = data.kinds[kind]
        return sum(x for x, y in zip(values["x"], values["y"], strict=True) if y == lane)

    assert total("stall", "torch-save · train") == pytest.approx(1.0)
    assert total("stall", "nbckpt-async · train") == pytest.approx(0.04)
    # nbckpt-async's step 3 runs while its first checkpoint persists
    steps = data.kinds["step"]
    persist = data.kinds["persist"]
    async_steps = [
        (b, b + x)
        for b, x, y in zip(steps["base"], steps["x"], steps["y"], strict=True)
        if y.startswith("nbckpt-async")
    ]
    first_persist = next(
        b for b, y in zip(persist["base"], persist["y"], strict=True) if y.startswith("nbckpt")
    )
    assert any(start < first_persist + 0.38 and end > first_persist for start, end in async_steps)


def test_timeline_picks_last_repeat_and_splits_ranks() -> None:
    both = pd.concat([sync_and_async_timeline(repeat=0), sync_and_async_timeline(repeat=1).head(3)])
    fig = timeline_figure(both)
    assert len(traces_by_name(fig)["step"].x) == 2 + 4  # torch-save's repeat 1 (2 steps), async's repeat 0
    assert len(traces_by_name(timeline_figure(both, repeat=0))["step"].x) == 8

    ranks = pd.DataFrame([event("dcp-async", "step", 0, 0.1, 1, rank=rank) for rank in (0, 1)])
    assert list(timeline_figure(ranks).layout.yaxis.categoryarray) == [
        "dcp-async r0 · train",
        "dcp-async r0 · background",
        "dcp-async r1 · train",
        "dcp-async r1 · background",
    ]


def test_timeline_without_strategy_column_uses_label() -> None:
    plain = sync_and_async_timeline().drop(columns=["strategy", "repeat"])
    assert "torch-save · train" in timeline_figure(plain).layout.yaxis.categoryarray


def test_a_timeline_without_strategies_does_not_speak_of_the_strategys_run() -> None:
    """Issue 29 (minor): notebooks 01 and 05 draw a Checkpointer's timeline, which has no
    strategies, under the axis title "seconds since the strategy's run started"."""
    timeline = Timeline()
    timeline.record("step", timeline.origin_ns, step=1)
    assert timeline_figure(timeline.to_pandas()).layout.xaxis.title.text == "seconds since the timeline began"
    compared = timeline_figure(sync_and_async_timeline()).layout.xaxis.title.text
    assert compared == "seconds since the strategy's run started"


def test_the_figures_keep_their_labels_apart_and_readable() -> None:
    """Issue 29 (minor): report figures with overlapping labels and unreadable bar labels. The
    timeline's horizontal legend above the lanes wrapped into the title; the published line's
    words ran over the reduction bars' labels; plotly shrank bar labels to fit their bars."""
    for fig in (timeline_figure(sync_and_async_timeline()), throughput_figure(sync_and_async_timeline())):
        legend = fig.layout.legend
        assert legend.orientation != "h" and legend.x >= 1 and legend.xanchor == "left", legend
    stall = stall_figure(DCP_RESULTS)
    assert (stall.layout.uniformtext.minsize, stall.layout.uniformtext.mode) == (10, "show")
    titles = {"stall per checkpoint (s)", "stall reduction vs dcp-sync (x)"}
    assert {
        annotation.text for annotation in stall.layout.annotations
    } == titles  # nothing else written on it
    advice = advise(RESULTS, job_mtbf_hours=24.0, gpus=512, restore_s=120.0)
    for fig in (
        stall,
        overhead_figure(RESULTS.assign(overhead_ci_pct=[[0.0, 0.0], [80.0, 120.0], [-1.0, 9.0]])),
        interval_figure(advice),
        timeline_figure(sync_and_async_timeline()),
        throughput_figure(sync_and_async_timeline()),
    ):  # a title line longer than the plot is cut at both ends (plotly never wraps it)
        lines = [re.sub(r"<[^>]+>", "", line) for line in fig.layout.title.text.split("<br>")]
        assert max(len(line) for line in lines) <= 100, lines
    timeline = Timeline()
    timeline.record("step", timeline.origin_ns, step=1)
    plain = throughput_figure(timeline.to_pandas())
    assert plain.layout.xaxis.title.text == "seconds since the timeline began"  # no strategies in it


def test_extend_timeline_appends_to_a_live_widget() -> None:
    timeline = sync_and_async_timeline()
    fig = timeline_figure(timeline.iloc[:0], widget=True)
    assert isinstance(fig, go.FigureWidget) and len(fig.data) == 0
    first, rest = timeline.iloc[:3], timeline.iloc[3:]
    extend_timeline(fig, first)
    extend_timeline(fig, rest)
    extend_timeline(fig, timeline.iloc[:0])
    whole = timeline_figure(timeline)
    assert {t.name: len(t.x) for t in fig.data} == {t.name: len(t.x) for t in whole.data}
    assert list(fig.layout.yaxis.categoryarray) == list(whole.layout.yaxis.categoryarray)
    assert sorted(traces_by_name(fig)["step"].base) == sorted(traces_by_name(whole)["step"].base)


def test_live_events_from_a_timeline_extend_per_rank_lanes() -> None:
    timeline = Timeline(rank=1, label="nbckpt-async")
    start = timeline.origin_ns + 10**8
    events = [
        timeline.record("step", start, start + 2 * 10**8, step=1),
        timeline.record("persist", start + 2 * 10**8, start + 5 * 10**8, step=1, nbytes=3 * MB),
    ]
    rows = events_frame(events, timeline.origin_ns)
    assert rows["start_s"].tolist() == pytest.approx([0.1, 0.3])
    fig = timeline_figure(rows.iloc[:0])
    for index in range(len(rows)):  # one event at a time, as a listener receives them
        extend_timeline(fig, rows.iloc[index : index + 1], by_rank=True)
    assert list(fig.layout.yaxis.categoryarray) == ["nbckpt-async r1 · train", "nbckpt-async r1 · background"]
    persist = traces_by_name(fig)["persist"]
    assert list(persist.base) == pytest.approx([0.3]) and list(persist.x) == pytest.approx([0.3])
    assert "3.0 MB" in persist.hovertext[0] and "0.01 GB/s" in persist.hovertext[0]


def test_unknown_event_kinds_are_drawn_in_the_background_lane() -> None:
    data = timeline_traces(pd.DataFrame([event("mine", "upload", 0.0, 1.0)]))
    assert data.kinds["upload"]["y"] == ["mine · background"]


def test_throughput_dips_after_a_stall_and_marks_the_steps_after_checkpoints() -> None:
    fig = throughput_figure(sync_and_async_timeline())
    traces = traces_by_name(fig)
    # torch-save step ends: 0.1, 0.2, 0.8 (after a 0.5 s stall), 0.9 -> 10, 10, 1/0.6, 10 steps/s
    assert list(traces["torch-save"].x) == pytest.approx([0.1, 0.2, 0.8, 0.9])
    assert list(traces["torch-save"].y) == pytest.approx([10.0, 10.0, 1 / 0.6, 10.0])
    # nbckpt-async: the 0.02 s stall only dents step 3: 1 / 0.12
    assert list(traces["nbckpt-async"].y) == pytest.approx([10.0, 10.0, 1 / 0.12, 10.0])
    # checkpoints after steps 2 and 4: step 3 is marked (step 4's checkpoint has no next step)
    marked = traces["torch-save after a checkpoint"]
    assert list(marked.x) == pytest.approx([0.8]) and marked.marker.symbol == "x"
    assert "none baseline" in fig.layout.title.text and "dips are checkpoints" not in fig.layout.title.text


# A run with DCP's own sync and async saves, the comparison PyTorch/IBM published.
DCP_RESULTS = pd.DataFrame(
    {
        "strategy": ["none", "torch-save", "dcp-sync", "dcp-async", "nbckpt-async"],
        "checkpoints": [0, 4, 4, 4, 4],
        "stall_mean_s": [math.nan, 0.5, 0.6, 0.2, 0.02],
        "stall_p95_s": [math.nan, 0.6, 0.7, 0.3, 0.03],
    }
)


def test_stall_figure_compares_with_dcp_sync_beside_the_like_for_like_figure() -> None:
    fig = stall_figure(DCP_RESULTS)
    stall, reduction, _published = fig.data
    assert list(stall.x) == ["torch-save", "dcp-sync", "dcp-async", "nbckpt-async"]
    assert list(stall.error_y.array) == pytest.approx([0.1, 0.1, 0.1, 0.01])
    assert list(reduction.y) == pytest.approx([1.2, 1.0, 3.0, 30.0])  # dcp-sync's 0.6 s / stall
    published = fig.data[-1]  # only PyTorch/IBM's compares this; its words in the legend
    assert set(published.y) == {23.6} and published.xaxis == "x2" and published.showlegend is not False
    assert "sync DCP 148.8 s<br>→ async DCP 6.3 s (23.6x)" in published.name
    texts = " ".join(annotation.text for annotation in fig.layout.annotations)
    assert "10x" not in texts and "54.2" not in texts and "published" not in texts
    assert "vs dcp-sync" in texts


def test_stall_figure_against_torch_save_draws_no_published_line() -> None:
    fig = stall_figure(RESULTS)
    stall, reduction = fig.data
    assert list(stall.x) == ["torch-save", "nbckpt-async"]  # the no-checkpoint baseline is left out
    assert list(stall.y) == [0.5, 0.02]
    assert list(reduction.y) == [1.0, 25.0]
    assert list(reduction.text) == ["1.0x", "25.0x"]
    assert len(fig.layout.shapes) == 0  # no source compares against torch.save
    assert fig.layout.yaxis.type != "log"


def test_stall_figure_computes_reduction_and_honours_options() -> None:
    results = RESULTS.drop(columns=["reduction_vs_torch_save", "stall_p95_s"])
    fig = stall_figure(results, log=True)
    assert list(fig.data[1].y) == pytest.approx([1.0, 25.0])
    assert fig.data[0].error_y.array is None
    assert len(fig.layout.shapes) == 0
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    partial = RESULTS.assign(partial=[False, False, True])
    assert list(stall_figure(partial).data[0].x) == ["torch-save"]  # a stopped run is left out


def test_stall_figure_uses_given_published_figures() -> None:
    published = load_published()
    published["anchors"]["pytorch_ibm_7b"]["values"]["reduction_factor"]["value"] = 30.0
    fig = stall_figure(DCP_RESULTS, published=published)
    assert set(fig.data[-1].y) == {30.0}
    assert (
        fig.data[-1].name
        == "published: PyTorch/IBM, 7B on GPUs, sync DCP 148.8 s<br>→ async DCP 6.3 s (30.0x)"
    )


def test_overhead_figure_labels_every_bar_as_the_tables_do() -> None:
    results = pd.DataFrame(
        {
            "strategy": ["none", "torch-save", "nbckpt-async", "stopped"],
            "overhead_pct": [0.0, 30.0, 2.0, 5.0],
            "overhead_ci_pct": [[0.0, 0.0], [20.0, 45.0], [-1.0, 5.0], [1.0, 9.0]],
            "overhead_by_repeat_pct": [[], [25.0, 30.0, 35.0], [1.0, 2.0, 3.0], [5.0]],
            "overhead_basis": [
                "baseline",
                "3 repeats, 12 cycles",
                "3 repeats, 12 cycles",
                "1 repeat, 2 cycles (widened), stopped",
            ],
            "partial": [False, False, False, True],
        }
    )
    fig = overhead_figure(results)
    bars, labels = fig.data
    assert list(bars.x) == ["torch-save", "nbckpt-async", "stopped"]  # the baseline left out
    assert list(bars.error_y.array) == pytest.approx([15.0, 3.0, 4.0])
    assert list(bars.error_y.arrayminus) == pytest.approx([10.0, 3.0, 4.0])
    # issue 29: the estimate above each whisker, short (the table's long words, as bar text
    # outside, were shrunk to fit the bar and ran into the whisker); an interval containing 0
    # hatched, its words in the hover as the table writes them
    assert bars.text is None and labels.mode == "text" and labels.textposition == "top center"
    assert list(labels.text) == ["+30.0 %", "+2.0 %", "+5.0 %"] and list(labels.x) == list(bars.x)
    assert list(labels.y) == pytest.approx([45.0, 5.0, 9.0])  # the whiskers' tops
    assert list(bars.marker.pattern.shape) == ["", "/", ""]
    assert "hatched: the interval contains 0" in fig.layout.title.text
    assert "+2.0 % (no measurable difference), 95 % interval" in bars.hovertext[1]
    assert "per repeat +25.0, +30.0, +35.0 %" in bars.hovertext[0]
    assert "rests on 1 repeat, 2 cycles (widened), stopped" in bars.hovertext[2]
    assert list(bars.marker.opacity) == [1.0, 1.0, 0.4]  # the stopped row drawn paler
    assert "95 % interval" in fig.layout.title.text


def test_stall_figure_stacks_the_save_stall_and_the_wait_for_the_earlier_save() -> None:
    results = RESULTS.assign(save_stall_s=[math.nan, 0.5, 0.005], wait_s=[math.nan, 0.0, 0.015])
    fig = stall_figure(results)
    names = [trace.name for trace in fig.data]
    assert names[:3] == ["save stall", "wait for the earlier save", "stall (p95)"]
    save, wait, total = fig.data[:3]
    assert list(save.y) == [0.5, 0.005] and list(wait.y) == [0.0, 0.015]
    assert list(total.y) == [0.5, 0.02]  # the stall is the two together
    assert fig.layout.barmode == "stack"


def test_interval_figure_marks_advised_interval() -> None:
    advice = advise(RESULTS, job_mtbf_hours=24.0 / 64, gpus=512)
    fig = interval_figure(advice)
    traces = traces_by_name(fig)
    first, second = advice.to_dict("records")
    names = [
        f"{r['strategy']}: every {r['interval_s']:.0f} s, {r['waste_pct']:.2f}% lost" for r in (first, second)
    ]
    assert list(traces) == [names[0], "torch-save advised", names[1], "nbckpt-async advised"]
    # issue 29: the advised values in the legend, none as text beside markers that may overlap
    assert not any("text" in (trace.mode or "") for trace in fig.data)
    marker = traces["torch-save advised"]
    assert list(marker.x) == [advice["interval_s"].iloc[0]]
    assert list(marker.y) == [advice["waste_pct"].iloc[0]]
    curve = traces[names[0]]
    # Daly's interval sits at (not exactly on, it is higher order) the minimum of the curve
    assert len(curve.x) == 120 and min(curve.y) >= 0.99 * marker.y[0]
    assert fig.layout.xaxis.type == "log"


def test_scaling_figure_draws_what_was_measured_beside_the_floor_of_each_run() -> None:
    data = ROOT / "tests" / "data"
    table = scaling_table(read_jobs([data / "bench_job_2ranks.json", data / "bench_job_1rank.json"]))
    fig = scaling_figure(table)
    assert fig.layout.title.text == "Measured on 1, 2 ranks (no projection beyond)"
    floor = next(trace for trace in fig.data if trace.name == "concurrent raw-write floor")
    runs = table.drop_duplicates("ranks").sort_values("ranks")
    assert list(floor.x) == [1, 2] and list(floor.y) == runs["concurrent_floor_gbs"].tolist()
    for name, rows in table.groupby("strategy"):
        rate, stall, overhead = [trace for trace in fig.data if trace.name == name]
        assert list(rate.x) == [1, 2] and list(rate.y) == rows["aggregate_write_gbs"].tolist()
        assert list(stall.y) == rows["stall_median_s"].tolist()
        assert list(overhead.y) == rows["overhead_pct"].tolist()


def test_scaling_figure_draws_the_floor_beside_training_where_it_was_measured() -> None:
    data = ROOT / "tests" / "data"
    runs = []
    for path, gbs in ((data / "bench_job_1rank.json", 0.25), (data / "bench_job_2ranks.json", 0.5)):
        document = json.loads(path.read_text())
        document["job"]["floors"]["beside_training"] = {"write_gbs": gbs, "checkpoints": []}
        runs.append(Comparison.from_dict(document))
    fig = scaling_figure(scaling_table(runs))
    names = [trace.name for trace in fig.data]
    beside = fig.data[names.index("concurrent raw-write floor beside training")]
    assert list(beside.x) == [1, 2] and list(beside.y) == [0.25, 0.5] and beside.line.dash == "dot"
    assert fig.data[names.index("concurrent raw-write floor")].line.dash == "dash"  # beside the idle one
    unmeasured = scaling_figure(
        scaling_table(read_jobs([data / "bench_job_1rank.json", data / "bench_job_2ranks.json"]))
    )
    assert "concurrent raw-write floor beside training" not in [trace.name for trace in unmeasured.data]


def test_probe_figure() -> None:
    probe = pd.DataFrame({"streams": [4, 1, 2, 8], "write_gbs": [1.8, 1.0, 1.6, 1.7]})
    fig = probe_figure(probe)
    assert [trace.name for trace in fig.data] == ["write"]
    assert list(fig.data[0].x) == [1, 2, 4, 8] and list(fig.data[0].y) == [1.0, 1.6, 1.8, 1.7]
    with_read = probe_figure(probe.assign(read_gbs=[3.0, 2.0, 2.5, 3.1]))
    assert [trace.name for trace in with_read.data] == ["write", "read"]


BUILDERS: list[tuple[Callable[..., go.Figure], Callable[[], pd.DataFrame]]] = [
    (timeline_figure, sync_and_async_timeline),
    (throughput_figure, sync_and_async_timeline),
    (stall_figure, lambda: RESULTS),
    (
        overhead_figure,
        lambda: pd.DataFrame({"strategy": ["a"], "overhead_pct": [1.0], "overhead_ci_pct": [[0.5, 1.5]]}),
    ),
    (interval_figure, lambda: advise(RESULTS, job_mtbf_hours=24.0)),
    (probe_figure, lambda: pd.DataFrame({"streams": [1, 2], "write_gbs": [1.0, 1.5]})),
]


@pytest.mark.parametrize(("builder", "data"), BUILDERS, ids=[b.__name__ for b, _ in BUILDERS])
def test_every_builder_returns_a_widget_on_request(
    builder: Callable[..., go.Figure], data: Callable[[], pd.DataFrame]
) -> None:
    static = builder(data())
    live = builder(data(), widget=True)
    assert type(static) is go.Figure
    assert isinstance(live, go.FigureWidget)
    assert "(rendering ?? model).on" in live._esm  # a re-run cell leaves no listeners behind
    assert len(live.data) == len(static.data) > 0


@pytest.mark.parametrize(("builder", "_data"), BUILDERS, ids=[b.__name__ for b, _ in BUILDERS])
def test_every_builder_names_missing_columns(
    builder: Callable[..., go.Figure], _data: Callable[[], pd.DataFrame]
) -> None:
    with pytest.raises(ConfigError, match="needs columns"):
        builder(pd.DataFrame({"unrelated": [1]}))


@pytest.mark.parametrize(("builder", "_data"), BUILDERS, ids=[b.__name__ for b, _ in BUILDERS])
def test_every_builder_given_a_comparison_says_what_it_needs(
    builder: Callable[..., go.Figure], _data: Callable[[], pd.DataFrame]
) -> None:
    """A Comparison where its table is wanted: one line (timeline_figure raised AttributeError)."""
    comparison = Comparison.from_json(ROOT / "tests" / "data" / "bench_job_1rank.json")
    with pytest.raises(ConfigError, match=r"needs a pandas DataFrame, got Comparison \(its \.timeline\?\)"):
        builder(comparison)


def test_strategy_colours_are_stable() -> None:
    assert strategy_colour("torch-save") != strategy_colour("nbckpt-async")
    assert strategy_colour("my-own") == strategy_colour("my-own")


def test_colours_follow_the_strategy_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """No table of names: a strategy's colour is its place in the registry, and the built-in
    strategies keep the colours they have always had."""
    from nbckpt.bench._internal import STRATEGIES

    builtin = {
        "none": "#7f7f7f",
        "torch-save": "#d62728",
        "dcp-sync": "#ff7f0e",
        "dcp-async": "#bcbd22",
        "dcp-async-stager": "#e377c2",
        "nbckpt-sync": "#9467bd",
        "nbckpt-async": "#2ca02c",
        "nbckpt-async-overlap": "#1f77b4",
    }
    assert {name: strategy_colour(name) for name in builtin} == builtin
    monkeypatch.setitem(STRATEGIES, "mine", STRATEGIES["nbckpt-async"])
    assert strategy_colour("mine") not in builtin.values()


def test_plotly_internals_the_widgets_use_are_those_of_the_installed_plotly() -> None:
    """The live figure and the lab's reach four private plotly names, in _plotly_compat alone:
    a plotly release that renames one fails here, naming it and plotly's version."""
    from nbckpt.notebook._plotly_compat import missing, set_config, widget_state

    assert not missing(), f"{missing()}: update nbckpt/notebook/_plotly_compat.py"
    figure = go.FigureWidget(go.Figure(go.Bar(x=[1], y=[2]), layout={"height": 300}))
    set_config(figure, responsive=True)
    layout, data = widget_state(figure)
    assert figure._config == {"responsive": True}
    assert layout["height"] == 300 and (data[0]["type"], data[0]["y"]) == ("bar", [2])
