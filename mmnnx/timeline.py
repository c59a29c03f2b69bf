"""Draw pipeline timelines: one row per rank or task, one coloured box per action.

:func:`plot_timeline` draws the familiar pipeline diagram with matplotlib: time runs left to
right, rank 0 (or the first task) is the top row, every action is a box spanning
``[start, end)`` coloured by its kind (``F`` forward, ``B`` backward, ``I`` input gradient,
``W`` weight gradient) and labelled with its microbatch, and idle time (the bubble) is the empty
space between boxes. It accepts a :class:`~mmnnx.mpmd.schedules.Schedule` (simulated with the
default costs), a :class:`~mmnnx.mpmd.schedules.SimulationResult`, or any sequence of
event-like objects, for example the events the engine measured. A measured transfer (kind
``T``: a value crossing to a rank's devices) is a thin bar right under the row of the rank it
arrives at. :func:`timeline_rows` returns the normalized rows the plot draws.

Only matplotlib's object-oriented API is used: nothing is registered with ``pyplot``, so no
figure needs closing, and the backend is left alone (saving works headless).

Example:
    >>> from mmnnx.mpmd.schedules import zero_bubble_h1
    >>> from mmnnx.timeline import plot_timeline
    >>> fig = plot_timeline(zero_bubble_h1(2, 3))
    >>> [label.get_text() for label in fig.axes[0].get_yticklabels()]
    ['rank 0', 'rank 1']
"""

from __future__ import annotations

import functools
import io
import math
import numbers
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from mmnnx.mpmd.schedules import TRANSFER, Schedule, SimulationResult, simulate

if TYPE_CHECKING:  # matplotlib is imported with the first plot: it is slow to import
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@functools.cache
def _timeline_figure() -> type:
    """A matplotlib Figure that Jupyter shows as a PNG without pyplot or ``%matplotlib``."""
    from matplotlib.figure import Figure  # noqa: PLC0415

    class TimelineFigure(Figure):
        def _repr_png_(self) -> bytes:
            buffer = io.BytesIO()
            self.savefig(buffer, format="png", dpi=100)
            return buffer.getvalue()

    return TimelineFigure


__all__ = [
    "KIND_COLORS",
    "KIND_NAMES",
    "TRANSFER_COLOR",
    "TimelineEvent",
    "UNITS",
    "plot_timeline",
    "timeline_rows",
]

KIND_COLORS: dict[str, str] = {
    "F": "#7eb0d5",
    "B": "#fdb462",
    "I": "#fb8072",
    "W": "#8dd3a7",
}
"""Fill colour of each action kind; other kinds get grey shades."""

KIND_NAMES: dict[str, str] = {
    "F": "F  forward",
    "B": "B  backward",
    "I": "I  input grad",
    "W": "W  weight grad",
    TRANSFER: "T  transfer in",
}
"""Legend text of each action kind (and of a transfer's bar); other kinds are shown by their
own name."""

TRANSFER_COLOR = "#6a3d9a"
"""Fill colour of a transfer's bar."""
_TRANSFER_BAR = (0.48, 0.12)  # a transfer bar's centre below its row's centre, and its height

UNITS: dict[str, float] = {"s": 1.0, "ms": 1e3, "us": 1e6}
"""Time units :func:`plot_timeline` can show seconds in, with their factor from seconds."""

_OTHER_COLORS = ("#bdbdbd", "#9e9e9e", "#d9d9d9", "#757575")
_EDGE = "#333333"
_FONT_SIZES = (8.0, 6.5)
_CHAR_WIDTH = 0.62  # average glyph width as a fraction of the font size (DejaVu Sans digits)
_SIDE_MARGINS_IN = 2.0  # figure width beside the time axis: row labels and the legend


class TimelineEvent(NamedTuple):
    """One action in a timeline row, normalized from whatever :func:`timeline_rows` was given.

    ``row`` is the row name (``"rank 0"`` for rank-based events, the task name for task-based
    ones); ``start`` and ``end`` are floats in the input's own time unit.

    Example:
        >>> from mmnnx.timeline import TimelineEvent
        >>> TimelineEvent("rank 0", "F", 0, 3, 0.0, 1.0).microbatch
        3
    """

    row: str
    kind: str
    stage: Any
    microbatch: Any
    start: float
    end: float


def timeline_rows(
    events_or_schedule: Schedule | SimulationResult | Iterable[Any],
    *,
    rows: Sequence[Any] | None = None,
) -> dict[str, list[TimelineEvent]]:
    """The events to draw, grouped by row name, rows in display order (top row first).

    Accepts a :class:`~mmnnx.mpmd.schedules.Schedule` (simulated with the default costs of
    :func:`~mmnnx.mpmd.schedules.simulate`), a
    :class:`~mmnnx.mpmd.schedules.SimulationResult`, or an iterable of event-like objects with
    attributes ``kind``, ``stage``, ``microbatch``, ``start``, ``end`` and either ``task`` (a
    name string, or an object with a ``.name``) or ``rank`` (an int); ``task`` wins when both
    are set, except over a ``rank`` that is a task name: a step's timeline events name the task
    whose devices ran them there, so a virtual stage's actions (task ``"t0:1"``) share the row
    of its task (``"t0"``), the devices that ran them one at a time. Rank rows are named
    ``"rank <r>"`` and come first, in rank order; task rows follow in the order their first
    event appears in the input. ``rows`` (names, rank ints or task objects) puts those rows
    first, in that order, and keeps them even when they have no event.
    Within a row, events are sorted by start time, then end time.

    Raises TypeError for an unsupported input or an event missing an attribute, and ValueError
    for no events, a non-finite time, or an event that ends before it starts.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b
        >>> from mmnnx.timeline import timeline_rows
        >>> rows = timeline_rows(one_f_one_b(2, 2))
        >>> list(rows)
        ['rank 0', 'rank 1']
        >>> rows["rank 1"][0]
        TimelineEvent(row='rank 1', kind='F', stage=1, microbatch=0, start=1.0, end=2.0)
    """
    events, _ = _normalize(events_or_schedule)
    return _group(events, rows)


def plot_timeline(
    events_or_schedule: Schedule | SimulationResult | Iterable[Any],
    path: str | pathlib.Path | None = None,
    *,
    title: str | None = None,
    ax: Axes | None = None,
    rows: Sequence[Any] | None = None,
    unit: str = "auto",
) -> Figure:
    """Draw a pipeline timeline and return its matplotlib Figure (saved to ``path`` if given).

    The input is anything :func:`timeline_rows` accepts, and ``rows`` orders the rows the same
    way. Each action is one ``Rectangle`` drawn by ``Axes.barh`` (so ``len(ax.patches)`` is the
    number of actions), coloured by kind (:data:`KIND_COLORS`, legend right of the plot) and
    labelled with its microbatch, or ``s<stage>:<microbatch>`` when some row holds several
    stages (interleaved schedules); a label is left out when its box is too narrow to hold it.
    Each rectangle's gid is ``<kind><stage>.<microbatch>@<row>``. Times are drawn relative to
    the earliest start. The actions of an overlapped pair that ran as one program (measured
    events with ``fused=True``, which share one span) are drawn side by side, each in an equal
    part of that span.

    ``unit`` says how to show times: ``"plain"`` draws them as given, with the axis labelled
    ``time``; ``"s"``, ``"ms"`` or ``"us"`` takes them as seconds and shows them in that unit
    (axis ``time (ms)`` etc.); ``"auto"`` (the default) is ``"plain"`` for schedules,
    simulation results and rank-based events, and for task-based (measured) events, whose times
    are seconds, ``"ms"`` when they span less than 10 seconds and ``"s"`` otherwise.

    ``title`` defaults to the schedule's name and size, ``"simulated timeline"`` with the
    makespan and bubble for a simulation result, ``"measured timeline"`` for task-based events
    and ``"timeline"`` for rank-based ones. With ``ax`` the timeline is drawn into those axes
    and their figure is returned; otherwise a new Figure is sized to the timeline. With
    ``path`` (parent folders are created) the figure is saved as PNG, or in the format the
    path's suffix names when matplotlib knows it (e.g. ``.svg``, ``.pdf``). The Figure
    displays by itself in Jupyter.

    A transfer (an event of kind ``"T"``, as a step's timelines give them: a value crossing
    from one rank's devices to another's) is drawn as a thin bar (:data:`TRANSFER_COLOR`) in
    the gap right under the row of the rank it arrives at, spanning from when it could leave to
    when it arrived; its gid is ``T<stage>.<microbatch>@<row>`` (the stage that made it).

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b
        >>> from mmnnx.timeline import plot_timeline
        >>> fig = plot_timeline(one_f_one_b(2, 4))
        >>> len(fig.axes[0].get_yticks())
        2
        >>> len(fig.axes[0].patches)  # one box per action: 2 ranks x 4 microbatches x (F, B)
        16
        >>> fig.axes[0].get_xlabel()
        'time'
    """
    events, kind_of_input = _normalize(events_or_schedule)
    grouped = _group(events, rows)
    is_measured = kind_of_input == "tasks"
    origin = min(event.start for event in events)
    span = max(event.end for event in events) - origin
    scale, xlabel = _resolve_unit(unit, is_measured=is_measured, span=span)

    if title is None:
        title = _default_title(events_or_schedule, kind_of_input)
    names = list(grouped)
    actions = [event for event in events if event.kind != TRANSFER]
    multi_stage = any(
        len({event.stage for event in row if event.kind != TRANSFER}) > 1
        for row in grouped.values()
    )
    if ax is None:
        axes_width_in = _axes_width(actions, multi_stage, span)
        figsize = (axes_width_in + _SIDE_MARGINS_IN, 1.3 + 0.45 * len(names))
        fig = _timeline_figure()(figsize=figsize, layout="constrained")
        ax = fig.add_subplot()
    else:
        fig = _root_figure(ax)
        axes_width_in = ax.get_position().width * fig.get_figwidth()
    inches_per_unit = axes_width_in / (span * scale) if span > 0 else 0.0

    for kind, color in _kind_colors(actions).items():
        placed, bars = _bars(ax, grouped, kind, origin, scale, 0.0, height=0.8,
                             color=color, edgecolor=_EDGE, linewidth=0.6,
                             label=KIND_NAMES.get(kind, kind))  # fmt: skip
        for rect, (y, event) in zip(bars.patches, placed, strict=True):
            rect.set_clip_on(False)  # the edges of the first and last boxes lie on the axes' ends
            rect.set_gid(f"{event.kind}{event.stage}.{event.microbatch}@{event.row}")
            label = _label(event, multi_stage)
            size = _fitting_font_size(label, rect.get_width() * inches_per_unit)
            if size is not None:
                ax.text(
                    rect.get_x() + rect.get_width() / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="black",
                    clip_on=True,
                )

    below = _draw_transfers(ax, grouped, origin, scale)
    ax.set_yticks(range(len(names)), labels=names)
    ax.set_ylim(len(names) - 0.5 + below, -0.5)  # first row on top
    ax.set_xlim(0, span * scale if span > 0 else 1)
    ax.set_xlabel(xlabel)
    ax.set_title(title, loc="left")
    ax.set_axisbelow(True)
    ax.grid(axis="x", color="#e0e0e0", linewidth=0.6)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        frameon=False,
        fontsize=8,
        handlelength=1.2,
        borderaxespad=0.0,
    )

    if path is not None:
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        suffix = target.suffix[1:].lower()
        supported = fig.canvas.get_supported_filetypes()
        fig.savefig(target, format=suffix if suffix in supported else "png", dpi=150)
    return fig


def _bars(ax: Axes, grouped: dict[str, list[TimelineEvent]], kind: str, origin: float,
          scale: float, offset: float, **style: Any) -> tuple[list, Any]:  # fmt: skip
    """Draws the events of ``kind``, ``offset`` below their rows' centres: ``(row, event)`` each,
    and the bars (none when there is nothing to draw)."""
    placed = [(y, e) for y, name in enumerate(grouped) for e in grouped[name] if e.kind == kind]
    if not placed:
        return placed, None
    bars = ax.barh(
        [y + offset for y, _ in placed],
        [(event.end - event.start) * scale for _, event in placed],
        left=[(event.start - origin) * scale for _, event in placed],
        **style,
    )
    return placed, bars


def _draw_transfers(
    ax: Axes, grouped: dict[str, list[TimelineEvent]], origin: float, scale: float
) -> float:
    """Draws the transfers under their rows; returns how far below the last row they reach."""
    offset, height = _TRANSFER_BAR
    placed, bars = _bars(ax, grouped, TRANSFER, origin, scale, offset, height=height,
                         color=TRANSFER_COLOR, linewidth=0, label=KIND_NAMES[TRANSFER])  # fmt: skip
    if not placed:
        return 0.0
    for rect, (_, event) in zip(bars.patches, placed, strict=True):
        rect.set_gid(f"{TRANSFER}{event.stage}.{event.microbatch}@{event.row}")
    return offset + height / 2 - 0.5 + 0.02


def _normalize(source: Any) -> tuple[list[TimelineEvent], str]:
    """The events of ``source`` as TimelineEvents, and what kind of input it was."""
    if isinstance(source, Schedule | SimulationResult):
        simulated = simulate(source) if isinstance(source, Schedule) else source
        kind = "schedule" if isinstance(source, Schedule) else "simulation"
        return [_event(index, event) for index, event in enumerate(simulated.events)], kind
    if (
        source is None
        or isinstance(source, str | bytes | Mapping)
        or not isinstance(source, Iterable)
    ):
        raise TypeError(
            f"plot_timeline needs a Schedule, a SimulationResult or a sequence of events "
            f"(objects with kind, stage, microbatch, start, end and rank or task), "
            f"got {type(source).__name__}"
        )
    items = list(source)
    if not items:
        raise ValueError("no events to draw: the event sequence is empty")
    events = [_event(index, item) for index, item in enumerate(items)]
    pairs: dict[tuple, list[int]] = {}
    for index, (item, event) in enumerate(zip(items, events, strict=True)):
        if getattr(item, "fused", False):
            pairs.setdefault((event.row, event.start, event.end), []).append(index)
    for members in pairs.values():  # one program's span, shared out side by side
        for k, index in enumerate(members):
            e = events[index]
            width = (e.end - e.start) / len(members)
            events[index] = e._replace(start=e.start + k * width, end=e.start + (k + 1) * width)
    has_tasks = any(getattr(item, "task", None) is not None for item in items)
    return events, "tasks" if has_tasks else "ranks"


def _event(index: int, item: Any) -> TimelineEvent:
    missing = [
        name for name in ("kind", "stage", "microbatch", "start", "end") if not hasattr(item, name)
    ]
    task = getattr(item, "task", None)
    rank = getattr(item, "rank", None)
    if task is None and rank is None:
        missing.append("rank or task")
    if missing:
        raise TypeError(
            f"event {index} ({item!r}) has no {', '.join(missing)}: events need kind, stage, "
            f"microbatch, start, end and either rank (int) or task (name or object with .name)"
        )
    # a step's events name both: the row is the task whose devices ran the action
    key = rank if task is None or (isinstance(rank, str) and rank) else task
    row = _row_name(key, f"event {index} ({item!r})")
    times = []
    for field in ("start", "end"):
        raw = getattr(item, field)
        try:
            if isinstance(raw, str | bytes | bool):
                raise TypeError
            value = float(raw)
        except (TypeError, ValueError):
            raise TypeError(
                f"event {index} ({item!r}) has a non-numeric {field}: {raw!r}"
            ) from None
        if not math.isfinite(value):
            raise ValueError(f"event {index} ({item!r}) has a non-finite {field}: {value}")
        times.append(value)
    start, end = times
    if end < start:
        raise ValueError(
            f"event {index} ({item!r}) ends before it starts: end {end} < start {start}"
        )
    return TimelineEvent(
        row=row,
        kind=str(item.kind),
        stage=item.stage,
        microbatch=item.microbatch,
        start=start,
        end=end,
    )


def _row_name(key: Any, where: str) -> str:
    """The row name of a rank int, a task name, or a task object with a ``.name``."""
    if isinstance(key, str):
        return key
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return f"rank {int(key)}"
    name = getattr(key, "name", None)
    if isinstance(name, str):
        return name
    raise TypeError(
        f"{where}: a row must be a rank (int), a task name (str) or an object with a str .name, "
        f"got {key!r}"
    )


def _rank_number(name: str) -> int | None:
    prefix, _, number = name.partition(" ")
    return int(number) if prefix == "rank" and number.isdigit() else None


def _group(
    events: list[TimelineEvent], rows: Sequence[Any] | None
) -> dict[str, list[TimelineEvent]]:
    grouped: dict[str, list[TimelineEvent]] = {}
    if rows is not None:
        if isinstance(rows, str) or not isinstance(rows, Iterable):
            raise TypeError(f"rows must be a sequence of row names, ranks or tasks, got {rows!r}")
        for key in rows:
            grouped.setdefault(_row_name(key, "rows"), [])
    by_row: dict[str, list[TimelineEvent]] = {}
    for event in events:
        by_row.setdefault(event.row, []).append(event)
    ranks = sorted((n for n in by_row if _rank_number(n) is not None), key=_rank_number)
    others = [n for n in by_row if _rank_number(n) is None]
    for name in [*ranks, *others]:
        grouped.setdefault(name, [])
    for name, row in by_row.items():
        grouped[name] = sorted(row, key=lambda event: (event.start, event.end))
    return grouped


def _resolve_unit(unit: str, *, is_measured: bool, span: float) -> tuple[float, str]:
    if unit == "auto":
        unit = ("ms" if span < 10 else "s") if is_measured else "plain"
    if unit == "plain":
        return 1.0, "time"
    if unit in UNITS:
        return UNITS[unit], f"time ({unit})"
    valid = ", ".join(repr(u) for u in ("auto", "plain", *UNITS))
    raise ValueError(f"unknown unit {unit!r}; valid units: {valid}")


def _default_title(source: Any, kind_of_input: str) -> str:
    if isinstance(source, Schedule):
        title = f"{source.name}: {source.num_stages} stages, {source.num_microbatches} microbatches"
        if source.num_ranks != source.num_stages:
            title += f" on {source.num_ranks} ranks"
        return title
    if isinstance(source, SimulationResult):
        return (
            f"simulated timeline: makespan {float(source.makespan):g}, "
            f"bubble {float(source.bubble_fraction):.0%}"
        )
    return "measured timeline" if kind_of_input == "tasks" else "timeline"


def _axes_width(events: list[TimelineEvent], multi_stage: bool, span: float) -> float:
    """Inches of time axis giving every action at least 0.25 inch and room for its label."""
    needed = 5.0
    for event in events:
        duration = event.end - event.start
        if duration > 0:
            label_width = _text_width(_label(event, multi_stage), _FONT_SIZES[0])
            needed = max(needed, max(0.25, label_width) * span / duration)
    return min(needed, 28.0)


def _root_figure(ax: Axes) -> Figure:
    from matplotlib.figure import Figure  # noqa: PLC0415

    figure = ax.figure
    root = getattr(figure, "figure", None)
    return root if isinstance(root, Figure) else figure


def _kind_colors(events: list[TimelineEvent]) -> dict[str, str]:
    """The colour of each kind of ``events``: known kinds first, then the others (greys), sorted."""
    present = {event.kind for event in events}
    others = sorted(present - set(KIND_COLORS))
    known = {kind: color for kind, color in KIND_COLORS.items() if kind in present}
    return known | {kind: _OTHER_COLORS[i % len(_OTHER_COLORS)] for i, kind in enumerate(others)}


def _label(event: TimelineEvent, multi_stage: bool) -> str:
    microbatch = "" if event.microbatch is None else str(event.microbatch)
    if multi_stage and event.stage is not None:
        return f"s{event.stage}:{microbatch}" if microbatch else f"s{event.stage}"
    return microbatch


def _fitting_font_size(label: str, width_in: float) -> float | None:
    """The largest of the label font sizes whose text fits ``width_in`` inches, else None."""
    fits = (size for size in _FONT_SIZES if _text_width(label, size) <= width_in)
    return next(fits, None) if label else None


def _text_width(label: str, size: float) -> float:
    """About how many inches ``label`` takes at font ``size``, with a little padding."""
    return len(label) * size * _CHAR_WIDTH / 72 + 0.06
