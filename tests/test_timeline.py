"""Tests for mmnnx.timeline: pipeline timeline plots of schedules and measured events."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from mmnnx.mpmd.schedules import Event, get, gpipe, one_f_one_b, simulate
from mmnnx.timeline import KIND_COLORS, TimelineEvent, plot_timeline, timeline_rows

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SCHEDULES = {
    "gpipe": lambda: get("gpipe", 4, 8),
    "1f1b": lambda: get("1f1b", 4, 8),
    "interleaved-1f1b": lambda: get("interleaved-1f1b", 8, 8, virtual_stages=2),
    "zero-bubble-h1": lambda: get("zero-bubble-h1", 4, 8),
    "zero-bubble-h2": lambda: get("zero-bubble-h2", 4, 8),
    "zero-bubble-v": lambda: get("zero-bubble-v", 8, 8, virtual_stages=2),
    "interleaved-zero-bubble": lambda: get("interleaved-zero-bubble", 8, 8, virtual_stages=2),
    "dualpipev": lambda: get("dualpipev", 8, 8, virtual_stages=2),
}


@dataclasses.dataclass
class Measured:
    """An event shaped like the engine's measurements: a task name and times in seconds."""

    task: object
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class TaskObject:
    name: str


def _boxes(fig: Figure) -> list[Rectangle]:
    (ax,) = fig.axes
    return [patch for patch in ax.patches if isinstance(patch, Rectangle)]


def _labels(fig: Figure) -> list[str]:
    return [text.get_text() for text in fig.axes[0].texts]


def _measured_events() -> list[Measured]:
    """Two tasks, 2 microbatches, absolute perf_counter-like times spanning 40 ms."""
    t0 = 5000.0
    return [
        Measured("decoder", "F", 1, 0, t0 + 0.010, t0 + 0.015),  # listed first, starts later
        Measured("embed", "F", 0, 0, t0 + 0.000, t0 + 0.005),
        Measured("embed", "F", 0, 1, t0 + 0.005, t0 + 0.010),
        Measured("decoder", "F", 1, 1, t0 + 0.015, t0 + 0.020),
        Measured("decoder", "B", 1, 0, t0 + 0.020, t0 + 0.030),
        Measured("embed", "B", 0, 0, t0 + 0.030, t0 + 0.040),
        Measured("decoder", "B", 1, 1, t0 + 0.025, t0 + 0.028),
        Measured("embed", "B", 0, 1, t0 + 0.035, t0 + 0.036),
    ]


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_png_is_written(tmp_path, name):
    path = tmp_path / "nested" / "dir" / f"{name}.png"
    fig = plot_timeline(SCHEDULES[name](), path)
    assert isinstance(fig, Figure)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 1024


def test_png_path_may_be_a_string_and_suffixless(tmp_path):
    target = tmp_path / "plot"
    plot_timeline(one_f_one_b(2, 2), str(target))
    assert target.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_one_box_per_action_and_one_row_per_rank(name):
    schedule = SCHEDULES[name]()
    fig = plot_timeline(schedule)
    ax = fig.axes[0]
    assert len(_boxes(fig)) == sum(len(row) for row in schedule.actions)
    assert len(ax.get_yticks()) == schedule.num_ranks
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        f"rank {r}" for r in range(schedule.num_ranks)
    ]
    # Legend handles are separate artists: they do not add to the axes' patches.
    assert ax.get_legend() is not None
    assert len(ax.patches) == len(_boxes(fig))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_boxes_match_the_simulation(name):
    schedule = SCHEDULES[name]()
    events = simulate(schedule).events
    fig = plot_timeline(schedule)
    expected = {
        f"{e.kind}{e.stage}.{e.microbatch}@rank {e.rank}": (e.rank, e.start, e.end - e.start)
        for e in events
    }
    drawn = {
        box.get_gid(): (round(box.get_y() + box.get_height() / 2), box.get_x(), box.get_width())
        for box in _boxes(fig)
    }
    assert drawn.keys() == expected.keys()
    for gid, (row, left, width) in expected.items():
        assert drawn[gid] == (row, pytest.approx(left), pytest.approx(width)), gid
    assert fig.axes[0].get_xlim() == pytest.approx((0, simulate(schedule).makespan))


def test_colours_follow_kinds_and_legend_names_them():
    fig = plot_timeline(get("zero-bubble-h1", 2, 3))
    for box in _boxes(fig):
        kind = box.get_gid()[0]
        assert box.get_facecolor()[:3] == pytest.approx(_rgb(KIND_COLORS[kind]))
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [text.split()[0] for text in legend] == ["F", "I", "W"]
    assert len(set(KIND_COLORS.values())) == 4


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))


def test_labels_are_microbatch_numbers():
    fig = plot_timeline(one_f_one_b(4, 8))
    labels = _labels(fig)
    assert len(labels) == 2 * 4 * 8
    assert sorted(set(labels), key=int) == [str(m) for m in range(8)]


def test_interleaved_labels_name_the_stage():
    schedule = get("interleaved-1f1b", 4, 4, virtual_stages=2)
    labels = _labels(plot_timeline(schedule))
    expected = sorted(f"s{a.stage}:{a.microbatch}" for row in schedule.actions for a in row)
    assert sorted(labels) == expected


def test_title_defaults():
    assert plot_timeline(gpipe(2, 3)).axes[0].get_title(loc="left") == (
        "gpipe: 2 stages, 3 microbatches"
    )
    interleaved = get("interleaved-1f1b", 4, 4, virtual_stages=2)
    assert plot_timeline(interleaved).axes[0].get_title(loc="left") == (
        "interleaved-1f1b: 4 stages, 4 microbatches on 2 ranks"
    )
    assert plot_timeline(_measured_events()).axes[0].get_title(loc="left") == "measured timeline"
    custom = plot_timeline(gpipe(2, 2), title="my run")
    assert custom.axes[0].get_title(loc="left") == "my run"


def test_simulation_result_input():
    result = simulate(one_f_one_b(3, 6), forward_cost=Fraction(1, 2), backward_cost=1)
    fig = plot_timeline(result)
    ax = fig.axes[0]
    assert len(_boxes(fig)) == len(result.events) == 36
    assert ax.get_xlim() == pytest.approx((0, float(result.makespan)))
    assert ax.get_xlabel() == "time"
    assert ax.get_title(loc="left").startswith("simulated timeline")
    rows = timeline_rows(result)
    assert list(rows) == ["rank 0", "rank 1", "rank 2"]
    assert all(isinstance(e.start, float) for row in rows.values() for e in row)


def test_measured_events_rows_follow_first_appearance_and_use_ms():
    events = _measured_events()
    rows = timeline_rows(events)
    assert list(rows) == ["decoder", "embed"]
    for name, row in rows.items():
        assert [e.start for e in row] == sorted(e.start for e in row)
        assert {e.row for e in row} == {name}
    fig = plot_timeline(events)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["decoder", "embed"]
    assert ax.get_xlabel() == "time (ms)"
    assert ax.get_xlim() == pytest.approx((0, 40))
    boxes = {box.get_gid(): box for box in _boxes(fig)}
    assert len(boxes) == len(events)
    first = boxes["F0.0@embed"]
    assert (first.get_x(), first.get_width()) == pytest.approx((0, 5))
    assert round(first.get_y() + first.get_height() / 2) == 1  # second row
    assert sorted(_labels(fig)) == ["0", "0", "0", "0", "1", "1", "1", "1"]


def test_a_fused_pair_is_drawn_side_by_side_in_its_shared_span():
    from mmnnx.mpmd.run.timing import Event as TimedEvent

    events = [
        TimedEvent("t0", "F", 0, 0, 0.000, 0.002, rank="t0"),
        TimedEvent("t0", "F", 3, 1, 0.002, 0.006, fused=True, rank="t0"),
        TimedEvent("t0:1", "B", 3, 0, 0.002, 0.006, fused=True, rank="t0"),
    ]
    boxes = {box.get_gid(): box for box in _boxes(plot_timeline(events))}
    pair = [boxes["F3.1@t0"], boxes["B3.0@t0"]]
    assert [(b.get_x(), b.get_width()) for b in pair] == [
        pytest.approx((2.0, 2.0)),
        pytest.approx((4.0, 2.0)),
    ]
    assert len(_labels(plot_timeline(events))) == 3  # each half holds its own label


def test_measured_events_with_task_objects_and_explicit_rows():
    events = [
        Measured(TaskObject("s0"), "F", 0, 0, 0.0, 1.0),
        Measured(TaskObject("s1"), "F", 1, 0, 1.0, 2.0),
        Measured(TaskObject("s1"), "B", 1, 0, 2.0, 4.0),
        Measured(TaskObject("s0"), "B", 0, 0, 4.0, 6.0),
    ]
    assert list(timeline_rows(events)) == ["s0", "s1"]
    rows = timeline_rows(events, rows=["s1", TaskObject("s0"), "idle"])
    assert list(rows) == ["s1", "s0", "idle"]
    assert rows["idle"] == []
    fig = plot_timeline(events, rows=["s1"])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["s1", "s0"]


def test_rank_rows_sort_by_number_and_events_by_time():
    events = [
        Event(10, "F", 1, 0, 3, 4),
        Event(2, "B", 0, 0, 5, 7),
        Event(2, "F", 0, 0, 0, 1),
    ]
    rows = timeline_rows(events)
    assert list(rows) == ["rank 2", "rank 10"]
    assert [e.kind for e in rows["rank 2"]] == ["F", "B"]
    assert rows["rank 10"] == [TimelineEvent("rank 10", "F", 1, 0, 3.0, 4.0)]
    fig = plot_timeline(events)
    assert fig.axes[0].get_title(loc="left") == "timeline"
    assert fig.axes[0].get_xlabel() == "time"


def test_units():
    events = _measured_events()
    assert plot_timeline(events, unit="s").axes[0].get_xlim() == pytest.approx((0, 0.04))
    assert plot_timeline(events, unit="us").axes[0].get_xlabel() == "time (us)"
    plain = plot_timeline(events, unit="plain").axes[0]
    assert (plain.get_xlabel(), plain.get_xlim()) == ("time", pytest.approx((0, 0.04)))
    long = [Measured("t", "F", 0, 0, 0.0, 6.0), Measured("t", "B", 0, 0, 6.0, 20.0)]
    assert plot_timeline(long).axes[0].get_xlabel() == "time (s)"
    ms = plot_timeline(one_f_one_b(2, 2), unit="ms").axes[0]
    assert (ms.get_xlabel(), ms.get_xlim()) == ("time (ms)", pytest.approx((0, 9000)))
    with pytest.raises(ValueError, match="unknown unit 'minutes'"):
        plot_timeline(events, unit="minutes")


def test_draws_into_given_axes():
    fig = Figure()
    left, right = fig.subplots(1, 2)
    returned = plot_timeline(gpipe(2, 2), ax=right)
    assert returned is fig
    assert len(right.patches) == 8
    assert len(left.patches) == 0


@pytest.mark.parametrize(
    "bad", [42, None, "F0.0", {"rank": 0}, one_f_one_b], ids=lambda v: type(v).__name__
)
def test_unsupported_input_raises_type_error(bad):
    with pytest.raises(TypeError, match="needs a Schedule, a SimulationResult or a sequence"):
        plot_timeline(bad)


def test_event_missing_attributes_raises_type_error():
    with pytest.raises(TypeError, match=r"event 1 .* has no rank or task"):
        timeline_rows([Event(0, "F", 0, 0, 0, 1), Measured(None, "F", 0, 0, 0, 1)])
    with pytest.raises(TypeError, match=r"event 0 \(\(1, 2\)\) has no kind, stage"):
        plot_timeline([(1, 2)])
    with pytest.raises(TypeError, match="non-numeric start"):
        plot_timeline([Measured("t", "F", 0, 0, "0", 1.0)])


def test_empty_and_backwards_events_raise_value_error():
    with pytest.raises(ValueError, match="empty"):
        plot_timeline([])
    with pytest.raises(ValueError, match="empty"):
        timeline_rows(iter(()))
    backwards = Measured("embed", "B", 0, 3, 2.0, 1.5)
    with pytest.raises(ValueError, match=r"event 1 \(Measured\(task='embed'.*ends before it"):
        plot_timeline([Measured("embed", "F", 0, 3, 0.0, 1.0), backwards])
    with pytest.raises(ValueError, match="non-finite end"):
        plot_timeline([Measured("embed", "F", 0, 3, 0.0, float("nan"))])


def test_figure_renders_as_png_for_jupyter():
    from mmnnx.mpmd.schedules import one_f_one_b

    png = plot_timeline(one_f_one_b(2, 4))._repr_png_()
    assert png.startswith(b"\x89PNG")


def test_the_first_and_last_boxes_are_drawn_whole():
    """The boxes touching the axes' ends keep their outlines (the last one was cut off)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plot_timeline(one_f_one_b(2, 4))
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    height = pixels.shape[0]
    boxes = _boxes(fig)
    ends = [
        min(boxes, key=lambda b: b.get_x()),
        max(boxes, key=lambda b: b.get_x() + b.get_width()),
    ]
    for box, side in zip(ends, ("x0", "x1"), strict=True):
        extent = box.get_window_extent()
        x = int(round(getattr(extent, side)))
        rows = slice(height - int(extent.y1) + 3, height - int(extent.y0) - 3)
        outline = pixels[rows, x - 1 : x + 2]
        dark = outline.sum(axis=-1) < 350  # the outline (#333333), not a fill or the background
        assert dark.any(axis=1).all(), side
