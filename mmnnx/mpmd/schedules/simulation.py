"""Simulating a schedule's timing, and the costs, pair costs and bubble a step's timed events
measured."""

from __future__ import annotations

import dataclasses
import numbers
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from mmnnx.mpmd.schedules.host import play_issued
from mmnnx.mpmd.schedules.ir import (
    KINDS,
    TRANSFER,
    Action,
    Schedule,
    check_action_key,
    play,
    validate,
)


class Event(NamedTuple):
    """One simulated action: which rank ran it, what it was, and when it started and ended.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b, simulate
        >>> last = simulate(one_f_one_b(2, 2)).events[-1]
        >>> last.rank, last.kind, last.stage, last.microbatch, last.start, last.end
        (0, 'B', 0, 1, 7, 9)
    """

    rank: int
    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What :func:`simulate` measured.

    ``makespan``: when the last action ends; ``bubble_fraction``: the idle share of all rank-time;
    ``peak_in_flight[s]``: the most microbatches whose activations stage ``s`` holds at once (from
    its F until its B or W); ``rank_idle[r]``: the time rank ``r`` waits between its first start and
    its last end (the zero-bubble paper's bubble); ``events``: every action, by start then rank.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe, simulate
        >>> result = simulate(gpipe(2, 4))
        >>> result.makespan, result.bubble_fraction, result.peak_in_flight, result.rank_idle
        (15, 0.2, (4, 4), (3, 0))
    """

    makespan: float
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    events: tuple[Event, ...]
    rank_idle: tuple[float, ...] = ()


def _held_peaks(schedule: Schedule, by_rank: bool = False) -> tuple[int, ...]:
    """The most microbatches each stage (or rank) holds at once, from an F to its B or W."""
    held = [0] * (schedule.num_ranks if by_rank else schedule.num_stages)
    peak = list(held)
    for rank, row in enumerate(schedule.actions):
        for action in row:
            at = rank if by_rank else action.stage
            held[at] += {"F": 1, "B": -1, "I": 0, "W": -1}[action.kind]
            peak[at] = max(peak[at], held[at])
    return tuple(peak)


def simulate(
    schedule: Schedule,
    forward_cost: float = 1,
    backward_cost: float = 2,
    weight_cost: float | None = None,
    *,
    action_costs: Mapping[str | tuple[str, int], float] | None = None,
    pair_costs: Mapping[tuple[tuple[str, int], tuple[str, int]], float] | None = None,
    transfer_costs: Mapping[str | tuple[str, int], float] | None = None,
    launch_cost: float = 0,
    processes: Sequence[int] | None = None,
) -> SimulationResult:
    """Simulate ``schedule`` with fixed per-action costs and, by default, no communication time.

    Each rank runs its actions in order; an action starts once its rank is free and its inputs (see
    :func:`validate`) have ended. F costs ``forward_cost`` and B ``backward_cost`` on every stage; a
    split backward's W takes ``weight_cost`` (``None``: half of ``backward_cost``) and its I the
    rest. Ints or ``fractions.Fraction`` costs give exact results.

    ``action_costs`` maps ``(kind, stage)``, or a kind for every stage, to a cost (the former wins)
    and replaces the per-kind costs: :func:`measured_costs` reads them off a step's ``timeline()``.
    ``pair_costs`` maps an overlapped pair, its two actions' ``(kind, stage)`` in order, to the
    pair's duration, shared in proportion to its actions' costs (:func:`measured_pair_costs`); a
    pair it does not name takes the sum of its actions' costs. ``transfer_costs`` maps
    ``(kind, stage)``, or a kind, to the time that action's result takes to reach a reader on
    another rank (:func:`transfer_costs` makes them from links). ``launch_cost``: the seconds a host
    takes to launch one program, each process's host launching its ranks' programs in
    :func:`dispatch_order`; ``processes[r]``: the process launching rank ``r``'s programs (default:
    one for all); a host receiving from another process waits for the value before it launches
    anything else, as the runner does.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b, simulate
        >>> simulate(one_f_one_b(4, 8)).makespan
        33
        >>> simulate(one_f_one_b(4, 8), action_costs={"F": 1, "B": 2, ("B", 3): 4}).makespan
        49
    """
    pair_duration = _pair_duration(schedule, pair_costs)
    transfer = _transfer(schedule, transfer_costs)
    run = _player(schedule, launch_cost, processes)
    if action_costs is None:
        if weight_cost is None:
            weight_cost = backward_cost / 2
        if not forward_cost > 0 or not backward_cost > 0:
            raise ValueError(
                f"forward_cost and backward_cost must be positive, got {forward_cost} and "
                f"{backward_cost}"
            )
        if not 0 <= weight_cost <= backward_cost:
            raise ValueError(f"weight_cost must be in [0, backward_cost], got {weight_cost}")
        action_costs = {
            "F": forward_cost,
            "B": backward_cost,
            "I": backward_cost - weight_cost,
            "W": weight_cost,
        }
    validate(schedule)
    costs = _costs_per_action(schedule, action_costs)
    timed = run(schedule, lambda a: costs[(a.kind, a.stage)], pair_duration, transfer)
    return _result(schedule, timed)


def _player(
    schedule: Schedule, launch_cost: float, processes: Sequence[int] | None
) -> Callable[..., list]:
    """``play``, or ``play_issued`` with ``launch_cost`` and ``processes`` (checked)."""
    if not (isinstance(launch_cost, numbers.Real) and launch_cost >= 0):
        raise ValueError(
            f"simulate: launch_cost must be a number >= 0 seconds, got {launch_cost!r}"
        )
    if processes is None:
        if not launch_cost:
            return play
        processes = (0,) * schedule.num_ranks
    processes = tuple(processes)
    if len(processes) != schedule.num_ranks or not all(
        isinstance(p, numbers.Integral) and not isinstance(p, bool) and p >= 0 for p in processes
    ):
        raise ValueError(
            f"simulate: processes must give a process number (an int >= 0) for each of the "
            f"{schedule.num_ranks} ranks, got {processes!r}"
        )

    def run(schedule, duration, pair_duration, transfer):
        return play_issued(schedule, duration, pair_duration, transfer, launch_cost, processes)

    return run


def _transfer(
    schedule: Schedule, transfer_costs: Mapping[str | tuple[str, int], float] | None
) -> Callable[[Action], float]:
    """``transfer_costs`` (see :func:`simulate`) checked, as ``play``'s ``transfer``."""
    costs = dict(transfer_costs or {})
    for key, value in costs.items():
        check_action_key(schedule, key, "transfer_costs")
        if not (isinstance(value, numbers.Real) and value >= 0):
            raise ValueError(f"transfer_costs[{key!r}] must be a number >= 0, got {value!r}")
    return lambda a: costs.get((a.kind, a.stage), costs.get(a.kind, 0))


def _pair_duration(
    schedule: Schedule, pair_costs: Mapping[Any, float] | None
) -> Callable[[Action, Action], float | None]:
    """``pair_costs`` (see :func:`simulate`) checked, as ``play``'s ``pair_duration``."""
    costs = dict(pair_costs or {})

    def an_action(part: Any) -> bool:
        return (
            isinstance(part, tuple)
            and len(part) == 2
            and part[0] in KINDS
            and isinstance(part[1], numbers.Integral)
            and 0 <= part[1] < schedule.num_stages
        )

    for key, value in costs.items():
        if not (isinstance(key, tuple) and len(key) == 2 and all(map(an_action, key))):
            raise ValueError(
                f"pair_costs key {key!r} names no overlapped pair of a schedule of "
                f"{schedule.num_stages} stages: keys are two (kind, stage) actions, in the "
                "order the pair runs them, e.g. (('F', 0), ('B', 3))"
            )
        if not (isinstance(value, numbers.Real) and value >= 0):
            raise ValueError(f"pair_costs[{key!r}] must be a number >= 0, got {value!r}")
    return lambda first, second: costs.get(((first.kind, first.stage), (second.kind, second.stage)))


def _result(schedule: Schedule, timed: list) -> SimulationResult:
    makespan = max(t.end for t in timed)
    busy = sum(t.end - t.start for t in timed)
    capacity = schedule.num_ranks * makespan
    events = tuple(
        Event(
            rank=t.rank,
            kind=t.action.kind,
            stage=t.action.stage,
            microbatch=t.action.microbatch,
            start=t.start,
            end=t.end,
        )
        for t in timed
    )
    spans: dict[int, list[float]] = {}
    for t in timed:
        first, last, work = spans.setdefault(t.rank, [t.start, t.end, 0])
        spans[t.rank] = [min(first, t.start), max(last, t.end), work + t.end - t.start]
    idle = tuple(
        spans[r][1] - spans[r][0] - spans[r][2] if r in spans else 0
        for r in range(schedule.num_ranks)
    )
    return SimulationResult(
        makespan=makespan,
        bubble_fraction=(capacity - busy) / capacity,
        peak_in_flight=_held_peaks(schedule),
        events=events,
        rank_idle=idle,
    )


_AVERAGES: dict[str, Callable[[list[float]], float]] = {
    "median": statistics.median,
    "mean": statistics.mean,
}


def _average(caller: str, average: str) -> Callable[[list[float]], float]:
    """The averaging function ``average`` names, or a ValueError naming ``caller``."""
    if average not in _AVERAGES:
        raise ValueError(f"{caller}: average must be one of {sorted(_AVERAGES)}, got {average!r}")
    return _AVERAGES[average]


def _rank_of(event: Any) -> Any:
    """The rank a timed event ran on: its ``rank``, else its ``task``."""
    rank = getattr(event, "rank", None)
    return rank if rank not in (None, "") else event.task


def _costs_per_action(
    schedule: Schedule, action_costs: Mapping[str | tuple[str, int], float]
) -> dict[tuple[str, int], float]:
    """``action_costs`` resolved to one cost per ``(kind, stage)`` that ``schedule`` runs."""
    for key, value in action_costs.items():
        check_action_key(schedule, key, "action_costs")
        if not value >= 0:
            raise ValueError(f"action_costs[{key!r}] must be >= 0, got {value!r}")
    costs, missing = {}, set()
    for row in schedule.actions:
        for a in row:
            key = (a.kind, a.stage)
            if key in action_costs:
                costs[key] = action_costs[key]
            elif a.kind in action_costs:
                costs[key] = action_costs[a.kind]
            else:
                missing.add(key)
    if missing:
        raise ValueError(f"action_costs has no cost for {sorted(missing)}")
    return costs


def measured_costs(events: Iterable[Any], average: str = "median") -> dict[tuple[str, int], float]:
    """The ``average`` (``"median"`` or ``"mean"``) duration of each ``(kind, stage)`` among timed
    events (a step's ``timeline()`` or ``overlapped_timeline()``), as :func:`simulate`'s
    ``action_costs`` takes them.

    The median suits ``timeline()``, where a slow action is noise; the mean suits
    ``overlapped_timeline()``, where tasks slow each other down. An action of a fused pair
    (``fused=True``) takes its duration measured apart where there is one, else half the pair's
    span. A stage timed for one of ``I`` and ``W`` gets 0 for the other (a half with nothing to
    compute runs no program). Transfers (kind ``"T"``) are left out: see
    :func:`measured_transfer_costs`.

    Example:
        >>> from mmnnx.mpmd.schedules import Event, measured_costs
        >>> events = [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "F", 0, 1, 1.0, 4.0),
        ...           Event(0, "F", 0, 2, 4.0, 6.0)]
        >>> measured_costs(events)
        {('F', 0): 2.0}
    """
    of = _average("measured_costs", average)
    apart: dict[tuple[str, int], list[float]] = {}
    paired: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.kind == TRANSFER:
            continue
        into = paired if getattr(e, "fused", False) else apart
        into.setdefault((e.kind, e.stage), []).append(e.end - e.start)
    out = {key: of(values) for key, values in apart.items()}
    for key, spans in paired.items():
        out.setdefault(key, of(spans) / 2)
    for kind, stage in list(out):
        if kind in "IW":
            out.setdefault(("W" if kind == "I" else "I", stage), 0.0)
    return out


def measured_pair_costs(
    events: Iterable[Any], average: str = "median"
) -> dict[tuple[tuple[str, int], tuple[str, int]], float]:
    """The ``average`` span of each overlapped pair run as one program (its two events share one
    span, ``fused=True``) among timed events, keyed by its two actions' ``(kind, stage)`` in order,
    as :func:`simulate`'s ``pair_costs`` takes them.

    Example:
        >>> from mmnnx.mpmd.schedules import measured_pair_costs
        >>> from mmnnx.mpmd.run.timing import Event
        >>> pair = [Event("t0", "F", 0, 2, 1.0, 4.0, fused=True),
        ...         Event("t0", "B", 3, 0, 1.0, 4.0, fused=True),
        ...         Event("t0", "F", 0, 3, 5.0, 10.0)]
        >>> measured_pair_costs(pair)
        {(('F', 0), ('B', 3)): 3.0}
    """
    of = _average("measured_pair_costs", average)
    spans: dict[tuple, list[tuple[str, int]]] = {}
    for e in events:
        if getattr(e, "fused", False):
            spans.setdefault((_rank_of(e), e.start, e.end), []).append((e.kind, e.stage))
    pairs: dict[tuple, list[float]] = {}
    for (_, start, end), actions in spans.items():
        if len(actions) == 2:
            pairs.setdefault(tuple(actions), []).append(end - start)
    return {key: of(values) for key, values in pairs.items()}


def measured_bubble(events: Iterable[Any]) -> float:
    """The idle share of the ranks' time over a step's span, from its timed events: the measured
    :attr:`SimulationResult.bubble_fraction`.

    A rank's busy time is the union of its events' spans, events grouped by ``rank``, else by
    ``task``; transfers (kind ``"T"``) are not busy time. On an ``overlapped_timeline()`` this is
    the bubble as the step ran; on a ``timeline()``, where actions run one at a time, it is none.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe, measured_bubble, simulate
        >>> result = simulate(gpipe(2, 4))
        >>> measured_bubble(result.events) == result.bubble_fraction
        True
    """
    spans: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
        if e.kind != TRANSFER:
            spans.setdefault(_rank_of(e), []).append((e.start, e.end))
    if not spans:
        raise ValueError("measured_bubble: no events (a step with no pipeline has none)")
    first = min(start for row in spans.values() for start, _ in row)
    last = max(end for row in spans.values() for _, end in row)
    if last <= first:
        raise ValueError(f"measured_bubble: the events span no time ({first} to {last})")
    busy = 0
    for row in spans.values():
        reach = None  # the latest end so far: overlapping spans count once
        for start, end in sorted(row):
            lo = start if reach is None else max(start, reach)
            busy += max(0, end - lo)
            reach = end if reach is None else max(reach, end)
    capacity = len(spans) * (last - first)
    return (capacity - busy) / capacity


def measured_transfer_costs(
    events: Iterable[Any], average: str = "median"
) -> dict[tuple[str, int], float]:
    """The ``average`` duration of the transfers (kind ``"T"``) among a step's timed events, keyed
    by the ``(kind, stage)`` of the action whose result each carried, as :func:`simulate`'s
    ``transfer_costs`` takes them. A transfer spans from when its value could leave to when it
    arrived; across processes a link measured on its own (``mm.schedules.measure_transfers``) is the
    cleaner cost.

    Example:
        >>> from mmnnx.mpmd.run.timing import Event
        >>> sent = [Event("s1", "T", 0, m, m, m + 0.5, rank="s1", source="s0", carries="F")
        ...         for m in range(3)]
        >>> measured_transfer_costs(sent)
        {('F', 0): 0.5}
    """
    of = _average("measured_transfer_costs", average)
    spans: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e.kind == TRANSFER:
            spans.setdefault((e.carries, e.stage), []).append(e.end - e.start)
    return {key: of(values) for key, values in spans.items()}
