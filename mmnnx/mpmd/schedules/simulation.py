"""Simulating a schedule's timing (fixed or measured costs per action, overlapped pairs as one
program), and the costs, pair costs and bubble a step's timed events measured."""

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

    ``makespan`` is the time the last action ends; ``bubble_fraction`` the idle share of all
    rank-time, ``1 - busy / (num_ranks * makespan)``; ``peak_in_flight[s]`` the largest number
    of microbatches whose activations stage ``s`` holds at once (from its F until its B, or
    until its W when the backward is split); ``rank_idle[r]`` the time rank ``r`` waits between
    its first action's start and its last action's end (the zero-bubble paper's bubble: a rank's
    own span, which steps without a global synchronisation overlap); ``events`` every action
    with its start and end, sorted by start time then rank.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe, simulate
        >>> result = simulate(gpipe(2, 4))
        >>> result.makespan, result.bubble_fraction, result.peak_in_flight, result.rank_idle
        (15, 0.2, (4, 4), (3, 0))
        >>> result.events[0]
        Event(rank=0, kind='F', stage=0, microbatch=0, start=0, end=1)
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

    Each rank runs its actions in order; an action starts at the later of the time its rank is
    free and the time its inputs (see :func:`validate`) have ended. Every action of a kind costs
    the same on every stage: F costs ``forward_cost`` and B ``backward_cost``; a split
    backward costs ``backward_cost`` in all, W taking ``weight_cost`` and I the rest, with
    ``weight_cost=None`` meaning half each. Costs are per stage, so an interleaved schedule
    whose ranks hold ``v`` stages each models the same per-rank work as a plain one when its
    costs are divided by ``v``. Ints or ``fractions.Fraction`` costs give exact results.

    ``action_costs`` maps ``(kind, stage)``, or a kind alone for every stage, to a cost (a
    ``(kind, stage)`` entry wins over its kind's) and replaces the three per-kind costs: feed
    it the durations a step's ``timeline()`` measured (:func:`measured_costs`) to predict that
    step's time under this or another schedule (``benchmarks/pipeline.py`` compares the two).

    ``pair_costs`` maps an overlapped pair, its two actions' ``(kind, stage)`` in the order it
    runs them, to the duration of the pair as a whole: a pair run as one program may take less
    than its two actions apart (``fuse_pairs=True``; :func:`measured_pair_costs` measures
    them). Its two actions share it in proportion to their own costs. Pairs it does not name
    take the sum of their actions' costs.

    ``transfer_costs`` maps ``(kind, stage)``, or a kind alone, to the time the result of that
    action takes to reach an action on another rank that reads it: ``("F", s)`` stage ``s``'s
    activations on their way to stage ``s + 1``, ``("B", s)`` or ``("I", s)`` its input
    gradient on its way to stage ``s - 1``. The reader starts no earlier than its producer's
    end plus that time; a result read on the rank that made it costs nothing, and actions not
    named send for free. :func:`transfer_costs` makes them from a :class:`Link` per pair of
    ranks and the bytes each action sends.

    ``launch_cost``: the seconds a host takes to launch one program (an action, or an
    overlapped pair run as one). Each process's host launches its ranks' programs one after
    the other in the order the runner does (:func:`dispatch_order`), and an action starts no
    earlier than its launch. ``processes[r]``: the process whose host launches rank ``r``'s
    programs (default: one process for all). A value crossing processes leaves when its
    producer has ended and the receiving host has reached its reader in that order (the sender
    offers it on launching its producer), and the receiving host waits for it before it
    launches anything else, as the runner does; within a process the copy is issued right
    before the reader's launch. With neither, every action may start as soon as its rank and
    inputs are ready.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b, simulate, zero_bubble_h1
        >>> simulate(one_f_one_b(4, 8)).makespan
        33
        >>> simulate(zero_bubble_h1(4, 8)).makespan
        27.0
        >>> simulate(one_f_one_b(4, 8), action_costs={"F": 1, "B": 2, ("B", 3): 4}).makespan
        49
        >>> simulate(one_f_one_b(2, 2), transfer_costs={"F": 0.5, "B": 0.5}).makespan
        10.0
        >>> simulate(one_f_one_b(2, 2), launch_cost=0.5).makespan  # rank 0 waits for F0.0's launch
        9.5
    """
    pair_duration = _pair_duration(schedule, pair_costs)
    transfer = _transfer(schedule, transfer_costs)
    run = _player(schedule, launch_cost, processes)
    if action_costs is not None:
        validate(schedule)
        costs = _costs_per_action(schedule, action_costs)
        timed = run(schedule, lambda a: costs[(a.kind, a.stage)], pair_duration, transfer)
        return _result(schedule, timed)
    if weight_cost is None:
        weight_cost = backward_cost / 2
    if not forward_cost > 0 or not backward_cost > 0:
        raise ValueError(
            f"forward_cost and backward_cost must be positive, got {forward_cost} and "
            f"{backward_cost}"
        )
    if not 0 <= weight_cost <= backward_cost:
        raise ValueError(f"weight_cost must be in [0, backward_cost], got {weight_cost}")
    validate(schedule)
    costs = {
        "F": forward_cost,
        "B": backward_cost,
        "I": backward_cost - weight_cost,
        "W": weight_cost,
    }
    return _result(schedule, run(schedule, lambda a: costs[a.kind], pair_duration, transfer))


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
    """The ``average`` duration of each ``(kind, stage)`` among timed events (a step's
    ``timeline()`` or ``overlapped_timeline()``), as :func:`simulate`'s ``action_costs`` takes
    them.

    ``average``: ``"median"`` (default) suits ``timeline()``, where each action runs alone and a
    slow one is noise; ``"mean"`` suits ``overlapped_timeline()``, where durations vary because
    tasks slow each other down: a step's time adds them up, so their mean is what counts.

    The two actions of an overlapped pair run as one program, so a timeline times them together
    (events with ``fused=True`` share one span): each takes its duration measured apart where
    the events have some, else half the pair's span.

    A split backward's half with nothing to compute runs no program, so it has no events: the
    first stage's input gradient (nothing before it reads one), or the weight gradient of a
    stage without parameters. A stage timed for one of ``I`` and ``W`` but not the other gets
    0 for the other, so a zero-bubble schedule's costs are complete for :func:`simulate`.

    Transfers (events of kind ``"T"``: a value crossing between ranks, timed apart from the
    action reading it) are left out; :func:`measured_transfer_costs` averages them.

    Example:
        >>> from mmnnx.mpmd.schedules import Event, measured_costs
        >>> events = [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "F", 0, 1, 1.0, 4.0),
        ...           Event(0, "F", 0, 2, 4.0, 6.0)]
        >>> measured_costs(events)
        {('F', 0): 2.0}
        >>> measured_costs(events, average="mean")
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
    """The ``average`` span of each overlapped pair run as one program among timed events (a
    step's ``timeline()`` or ``overlapped_timeline()``: a fused pair's two events share one
    span, ``fused=True``), keyed by its two actions' ``(kind, stage)`` in the order it runs
    them, as :func:`simulate`'s ``pair_costs`` takes them. With :func:`measured_costs` for the
    actions, a prediction then costs a pair what it took, not what its halves take apart.

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
    """The idle share of the ranks' time over a step's span, from its timed events: the
    measured counterpart of :attr:`SimulationResult.bubble_fraction`.

    Each rank's busy time is the union of its events' spans (the two actions of a fused pair
    share one span; a task's virtual stages share its devices): events are grouped by
    ``rank`` (a step's timeline gives the task whose devices ran the action; a simulation's
    events, the rank number), else by ``task``; transfers (kind ``"T"``) are not busy time.
    The span runs from the earliest start to the latest end of the actions. On an
    ``overlapped_timeline()`` this is the bubble as the step ran; on a ``timeline()``, where
    actions run one at a time, it is not a bubble at all.

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
    """The ``average`` duration of the transfers among a step's timed events (kind ``"T"``),
    keyed by the ``(kind, stage)`` of the action whose result each carried (``carries``,
    ``stage``), as :func:`simulate`'s ``transfer_costs`` takes them.

    A transfer's span runs from when its value could leave (its producer had ended and the
    host had issued the copy or begun the receive) to when it arrived. With several
    processes a received value may also have waited for the sending host, which
    :func:`simulate` models apart (``processes``): a link measured on its own
    (``mm.schedules.measure_transfers``) is the cleaner cost there.

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
