"""Pipeline schedules as pure data: build them, check that they run, and simulate their timing.

A schedule says, for every rank (a group of devices that runs one or more model stages), the
order in which that rank runs its actions. An action is one pass of one stage over one
microbatch: ``F`` (forward), ``B`` (full backward), or the two halves of a split backward used
by zero-bubble schedules, ``I`` (gradient with respect to the stage's input, which the previous
stage waits for) and ``W`` (gradient with respect to the stage's weights, which nobody waits
for). Two adjacent actions of one rank may form an *overlapped pair* (DualPipe's
forward-and-backward chunk): the runtime runs the pair as one program. A separate runtime
executes the table; this module only builds, checks, prints, stores
(CSV) and simulates it, and imports nothing beyond the standard library.

Example:
    >>> from mmnnx.mpmd.schedules import get, simulate
    >>> schedule = get("1f1b", num_stages=2, num_microbatches=3)
    >>> print(schedule)
    1f1b: 2 stages, 3 microbatches, 2 ranks (unit-time steps; blank = idle)
    rank 0 | F0.0 F0.1      B0.0 F0.2 B0.1      B0.2
    rank 1 |      F1.0 B1.0 F1.1 B1.1 F1.2 B1.2
    >>> simulate(schedule).makespan
    12
"""

from __future__ import annotations

import csv
import dataclasses
import inspect
import io
import numbers
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

KINDS = ("F", "B", "I", "W")
"""Action kinds: forward, full backward, input-gradient half, weight-gradient half."""

_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one stage over one microbatch; ``str`` gives the short form ``F0.3``.

    The short form is the kind letter, the stage index, a dot and the microbatch index, so
    ``F0.3`` is the forward of stage 0 on microbatch 3 and ``W2.0`` the weight-gradient pass of
    stage 2 on microbatch 0. :meth:`parse` reads it back.

    Example:
        >>> from mmnnx.mpmd.schedules import Action
        >>> str(Action("F", 0, 3))
        'F0.3'
        >>> Action.parse("W2.0")
        Action(kind='W', stage=2, microbatch=0)
    """

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"action kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"action {field} must be a non-negative int, got {value!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the short form ``<kind><stage>.<microbatch>``, e.g. ``"B1.0"``.

        Example:
            >>> from mmnnx.mpmd.schedules import Action
            >>> Action.parse(" I3.12 ")
            Action(kind='I', stage=3, microbatch=12)
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(
                f"cannot read action {text!r}: expected <kind><stage>.<microbatch> with kind one "
                f"of {', '.join(KINDS)}, e.g. 'F0.3'"
            )
        return cls(match[1], int(match[2]), int(match[3]))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: for every rank, the ordered actions that rank runs.

    ``num_stages`` is the number of model stages (S), ``num_microbatches`` the number of
    microbatches (M) and ``num_ranks`` the number of ranks executing them; in an interleaved
    schedule each rank holds several stages. ``stage_to_rank[s]`` is the rank that owns stage
    ``s`` and ``actions[r]`` the actions of rank ``r`` in the order it runs them. Sequences
    given for these two fields are stored as tuples. Builders such as :func:`one_f_one_b` and
    :func:`custom` return schedules already checked by :func:`validate`.

    ``overlapped[r]`` lists the positions ``p`` in ``actions[r]`` where actions ``p`` and
    ``p + 1`` form an overlapped pair: two independent actions (of different microbatches) that
    start together and run as one compiled program, so that one's transfers and compute can
    overlap the other's (DualPipe). Empty for every rank unless a builder pairs actions.

    ``str(schedule)`` draws the unit-time timeline (every action takes one step; see
    :func:`simulate`) with one row per rank, and :meth:`to_csv` / :meth:`from_csv` store it.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe
        >>> schedule = gpipe(2, 2)
        >>> schedule.stage_to_rank
        (0, 1)
        >>> [str(a) for a in schedule.actions_of(1)]
        ['F1.0', 'F1.1', 'B1.0', 'B1.1']
        >>> print(schedule)
        gpipe: 2 stages, 2 microbatches, 2 ranks (unit-time steps; blank = idle)
        rank 0 | F0.0 F0.1           B0.0 B0.1
        rank 1 |      F1.0 F1.1 B1.0 B1.1
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_ranks: int
    stage_to_rank: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    overlapped: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        object.__setattr__(self, "actions", tuple(tuple(row) for row in self.actions))
        pairs = tuple(tuple(row) for row in self.overlapped)
        if not any(pairs):
            pairs = tuple(() for _ in self.actions)
        object.__setattr__(self, "overlapped", pairs)

    def pairs_of(self, rank: int) -> tuple[tuple[Action, Action], ...]:
        """The overlapped pairs of ``rank`` (see ``overlapped``), in the order it runs them.

        Example:
            >>> from mmnnx.mpmd.schedules import dualpipe_v
            >>> [f"{a}+{b}" for a, b in dualpipe_v(2, 4, fuse_pairs=True).pairs_of(0)][:2]
            ['F0.3+B3.1', 'F3.2+B0.0']
        """
        row = self.actions_of(rank)
        return tuple((row[p], row[p + 1]) for p in self.overlapped[rank])

    def actions_of(self, rank: int) -> tuple[Action, ...]:
        """The actions of ``rank``, in the order it runs them.

        Example:
            >>> from mmnnx.mpmd.schedules import one_f_one_b
            >>> " ".join(map(str, one_f_one_b(2, 2).actions_of(0)))
            'F0.0 F0.1 B0.0 B0.1'
        """
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in 0..{self.num_ranks - 1}, got {rank}")
        return self.actions[rank]

    @property
    def split_stages(self) -> frozenset[int]:
        """The stages whose backward pass this schedule splits into I and W actions.

        Example:
            >>> from mmnnx.mpmd.schedules import one_f_one_b, zero_bubble_h1
            >>> sorted(zero_bubble_h1(2, 2).split_stages), sorted(one_f_one_b(2, 2).split_stages)
            ([0, 1], [])
        """
        return frozenset(a.stage for row in self.actions for a in row if a.kind in "IW")

    @property
    def splits_backward(self) -> bool:
        """Whether any stage's backward pass runs as separate I and W actions (zero-bubble).

        Example:
            >>> from mmnnx.mpmd.schedules import zero_bubble_h1
            >>> zero_bubble_h1(2, 2).splits_backward
            True
        """
        return bool(self.split_stages)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages owned by ``rank``, in increasing order.

        Example:
            >>> from mmnnx.mpmd.schedules import interleaved_1f1b
            >>> interleaved_1f1b(num_ranks=2, num_microbatches=2, virtual_stages=2).stages_of(1)
            (1, 3)
        """
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in 0..{self.num_ranks - 1}, got {rank}")
        return tuple(s for s, owner in enumerate(self.stage_to_rank) if owner == rank)

    def __str__(self) -> str:
        header = (
            f"{self.name}: {self.num_stages} stages, {self.num_microbatches} microbatches, "
            f"{self.num_ranks} ranks"
        )
        try:
            timed = _execute(self, lambda action: 1)
            placed = [(event.rank, event.action, event.start) for event in timed]
            header += " (unit-time steps; blank = idle)"
        except ValueError:
            placed = [(r, a, i) for r, row in enumerate(self.actions) for i, a in enumerate(row)]
            header += " (cannot run as ordered; columns are positions, not times)"
        width = max((len(str(a)) for _, a, _ in placed), default=1)
        columns = max((t for _, _, t in placed), default=-1) + 1
        grid = [[" " * width] * columns for _ in range(self.num_ranks)]
        for rank, action, step in placed:
            grid[rank][step] = str(action).ljust(width)
        label_width = len(f"rank {self.num_ranks - 1}")
        rows = [
            f"rank {r}".ljust(label_width) + " | " + " ".join(cells) for r, cells in enumerate(grid)
        ]
        return "\n".join([header, *(row.rstrip() for row in rows)])

    def to_csv(self) -> str:
        """The schedule as CSV text: a header row, then one row per rank.

        The header is ``rank,0,1,...,n-1``; the row of rank ``r`` is ``r`` followed by its
        actions in order, written as ``<kind><stage>.<microbatch>`` (``F0.1`` is the forward of
        stage 0 on microbatch 1), an overlapped pair as one cell ``F0.2+B3.0``, with empty cells
        padding rows shorter than the longest. Stage ownership and the counts are implied by the
        actions, so
        ``Schedule.from_csv(s.to_csv(), name=s.name) == s`` for every valid schedule.

        Example:
            >>> from mmnnx.mpmd.schedules import gpipe
            >>> print(gpipe(2, 2).to_csv(), end="")
            rank,0,1,2,3
            0,F0.0,F0.1,B0.0,B0.1
            1,F1.0,F1.1,B1.0,B1.1
        """
        rows = [self._cells(rank) for rank in range(len(self.actions))]
        length = max((len(row) for row in rows), default=0)
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(["rank", *range(length)])
        for rank, cells in enumerate(rows):
            writer.writerow([rank, *cells, *[""] * (length - len(cells))])
        return buffer.getvalue()

    def _cells(self, rank: int) -> list[str]:
        """Rank ``rank``'s actions as CSV cells, an overlapped pair as one ``A+B`` cell."""
        row, starts = self.actions[rank], set(self.overlapped[rank])
        cells: list[str] = []
        position = 0
        while position < len(row):
            if position in starts and position + 1 < len(row):
                cells.append(f"{row[position]}+{row[position + 1]}")
                position += 2
            else:
                cells.append(str(row[position]))
                position += 1
        return cells

    @classmethod
    def from_csv(cls, text: str, name: str = "custom") -> Schedule:
        """Read a schedule written by :meth:`to_csv` (and check it with :func:`validate`).

        Rows must list ranks ``0, 1, ...`` in order; empty cells and blank lines are ignored.

        Example:
            >>> from mmnnx.mpmd.schedules import Schedule
            >>> schedule = Schedule.from_csv("rank,0,1\\n0,F0.0,B0.0\\n")
            >>> schedule.num_stages, schedule.num_microbatches, schedule.num_ranks
            (1, 1, 1)
        """
        rows = [row for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)]
        if not rows or rows[0][0].strip() != "rank":
            raise ValueError("schedule CSV must start with a header row whose first cell is 'rank'")
        table = []
        for expected, row in enumerate(rows[1:]):
            if row[0].strip() != str(expected):
                raise ValueError(
                    f"schedule CSV row {expected + 2} should be rank {expected}, "
                    f"got {row[0].strip()!r}: list ranks 0, 1, ... in order"
                )
            table.append([cell for cell in row[1:] if cell.strip()])
        return custom(table, name=name)


def from_csv(text: str, name: str = "custom") -> Schedule:
    """Read a schedule from CSV text; the same as :meth:`Schedule.from_csv`.

    Example:
        >>> from mmnnx.mpmd.schedules import from_csv, zero_bubble_h1
        >>> schedule = zero_bubble_h1(2, 2)
        >>> from_csv(schedule.to_csv(), name=schedule.name) == schedule
        True
    """
    return Schedule.from_csv(text, name=name)


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


class _Timed(NamedTuple):
    rank: int
    action: Action
    start: float
    end: float


def _dependencies(action: Action, num_stages: int, present: set[Action]) -> list[Action]:
    """The actions whose results ``action`` consumes (its rank's earlier actions aside)."""
    kind, stage, microbatch = action.kind, action.stage, action.microbatch
    if kind == "F":
        return [Action("F", stage - 1, microbatch)] if stage > 0 else []
    if kind == "W":
        return [Action("I", stage, microbatch)]
    needs = [Action("F", stage, microbatch)]
    if stage < num_stages - 1:
        full = Action("B", stage + 1, microbatch)
        needs.append(full if full in present else Action("I", stage + 1, microbatch))
    return needs


def _execute(
    schedule: Schedule,
    duration: Callable[[Action], float],
    pair_duration: Callable[[Action, Action], float | None] = lambda first, second: None,
) -> list[_Timed]:
    """Run every rank's actions strictly in order, each as soon as its inputs are done.

    Start times do not depend on the order in which ranks are visited: an action starts when
    its rank's previous action and all of its dependencies have ended. An overlapped pair
    starts when both actions' inputs are ready, runs one action after the other, and hands on
    its results when both have ended (one program); ``pair_duration`` may give the pair's own
    duration (``None``: the sum of its actions'), which its two actions then share in
    proportion to their own. Raises ValueError naming the blocked actions when no rank can
    make progress.
    """
    present = {action for row in schedule.actions for action in row}
    finish: dict[Action, float] = {}
    free: list[float] = [0] * schedule.num_ranks
    pcs = [0] * schedule.num_ranks
    timed: list[_Timed] = []
    remaining = sum(len(row) for row in schedule.actions)
    pair_starts = [set(row) for row in schedule.overlapped]
    while remaining:
        progressed = False
        for rank, row in enumerate(schedule.actions):
            while pcs[rank] < len(row):
                width = 2 if pcs[rank] in pair_starts[rank] else 1
                actions = row[pcs[rank] : pcs[rank] + width]
                needs = [
                    need
                    for action in actions
                    for need in _dependencies(action, schedule.num_stages, present)
                ]
                if any(need not in finish for need in needs):
                    break
                start = max([free[rank], *(finish[need] for need in needs)])
                durations = [duration(action) for action in actions]
                whole = pair_duration(*actions) if width == 2 else None
                if whole is not None:
                    total = sum(durations)
                    durations = [whole * d / total for d in durations] if total else [whole / 2] * 2
                for action, took in zip(actions, durations, strict=True):
                    end = start + took
                    timed.append(_Timed(rank, action, start, end))
                    start = end
                for action in actions:
                    finish[action] = end
                free[rank] = end
                pcs[rank] += width
                remaining -= width
                progressed = True
        if not progressed:
            raise ValueError(_deadlock_message(schedule, pcs, finish, present))
    return sorted(timed, key=lambda t: (t.start, t.rank))


def _deadlock_message(
    schedule: Schedule, pcs: list[int], finish: dict[Action, float], present: set[Action]
) -> str:
    position = {a: (r, i) for r, row in enumerate(schedule.actions) for i, a in enumerate(row)}
    blocked = [r for r, row in enumerate(schedule.actions) if pcs[r] < len(row)]

    def waiting(rank: int) -> tuple[Action, Action]:
        pc, row = pcs[rank], schedule.actions[rank]
        width = 2 if pc in schedule.overlapped[rank] else 1
        for action in row[pc : pc + width]:
            needs = _dependencies(action, schedule.num_stages, present)
            missing = [need for need in needs if need not in finish]
            if missing:
                return action, missing[0]
        raise AssertionError("a blocked rank waits for nothing")

    waits = {rank: waiting(rank) for rank in blocked}
    rank = blocked[0]
    action, need = waits[rank]
    if need not in position:
        where, why = f"stage {need.stage}", "which is not in the schedule"
    else:
        owner, index = position[need]
        where = f"stage {need.stage}, rank {owner}"
        if owner == rank:
            why = (
                f"which rank {rank} runs only later (position {index}, after position {pcs[rank]})"
            )
        else:
            other, other_need = waits[owner]
            why = (
                f"which never runs before it: rank {owner} is stuck at {other}, "
                f"waiting for {other_need}"
            )
    stuck = ", ".join(f"rank {r} at {a} (needs {n})" for r, (a, n) in waits.items())
    return (
        f"schedule {schedule.name!r} deadlocks: rank {rank} action {action} waits for {need} "
        f"({where}), {why}. Blocked: {stuck}. Reorder the actions so that every action's "
        f"inputs run before it."
    )


def _check_structure(schedule: Schedule) -> None:
    """Counts, ownership, and exactly one F and one B (or one I and one W) per stage/microbatch."""
    for field in ("num_stages", "num_microbatches", "num_ranks"):
        value = getattr(schedule, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")
    num_stages, num_ranks = schedule.num_stages, schedule.num_ranks
    if len(schedule.stage_to_rank) != num_stages:
        raise ValueError(
            f"stage_to_rank has {len(schedule.stage_to_rank)} entries for {num_stages} stages"
        )
    for stage, owner in enumerate(schedule.stage_to_rank):
        if not isinstance(owner, int) or not 0 <= owner < num_ranks:
            raise ValueError(
                f"stage {stage} is mapped to rank {owner!r}, not in 0..{num_ranks - 1}"
            )
    if len(schedule.actions) != num_ranks:
        raise ValueError(f"actions has {len(schedule.actions)} rows for {num_ranks} ranks")
    seen: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(schedule.actions):
        for index, action in enumerate(row):
            if not isinstance(action, Action):
                raise ValueError(f"rank {rank} position {index} is {action!r}, not an Action")
            if action.stage >= num_stages:
                raise ValueError(
                    f"action {action} on rank {rank} names stage {action.stage}, "
                    f"but the schedule has stages 0..{num_stages - 1}"
                )
            if action.microbatch >= schedule.num_microbatches:
                raise ValueError(
                    f"action {action} on rank {rank} names microbatch {action.microbatch}, "
                    f"but the schedule has microbatches 0..{schedule.num_microbatches - 1}"
                )
            owner = schedule.stage_to_rank[action.stage]
            if owner != rank:
                raise ValueError(
                    f"action {action} is on rank {rank}, but stage {action.stage} belongs to "
                    f"rank {owner}"
                )
            if action in seen:
                first = seen[action]
                raise ValueError(
                    f"duplicate action {action}: rank {rank} runs it at positions {first[1]} "
                    f"and {index}"
                )
            seen[action] = (rank, index)
    _check_pairs(schedule)
    for stage in range(num_stages):
        for microbatch in range(schedule.num_microbatches):
            has = {kind: Action(kind, stage, microbatch) in seen for kind in KINDS}
            tag = f"{stage}.{microbatch}"
            if not has["F"]:
                raise ValueError(f"missing action F{tag}: every stage/microbatch needs one F")
            if has["B"] and (has["I"] or has["W"]):
                raise ValueError(
                    f"B{tag} and a split backward (I{tag}/W{tag}) are both present: "
                    f"use either B or I and W"
                )
            if not any(has[kind] for kind in "BIW"):
                raise ValueError(f"missing action B{tag} (or I{tag} and W{tag}): no backward")
            if has["I"] != has["W"]:
                missing, present = ("W", "I") if has["I"] else ("I", "W")
                raise ValueError(
                    f"missing action {missing}{tag}: {present}{tag} is present, and a split "
                    f"backward needs both I and W"
                )


def _check_pairs(schedule: Schedule) -> None:
    """Each overlapped pair: two adjacent actions of one rank, of different microbatches (so
    neither needs the other), in no other pair."""
    if len(schedule.overlapped) != schedule.num_ranks:
        raise ValueError(
            f"overlapped has {len(schedule.overlapped)} rows for {schedule.num_ranks} ranks"
        )
    for rank, (row, starts) in enumerate(zip(schedule.actions, schedule.overlapped, strict=True)):
        previous = None
        for p in starts:
            if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < len(row) - 1:
                raise ValueError(
                    f"overlapped pair at position {p!r} on rank {rank}: a pair starts at a "
                    f"position in 0..{len(row) - 2} (its second action is the next one)"
                )
            if previous is not None and p < previous:
                raise ValueError(
                    f"overlapped pairs on rank {rank} are listed at positions {previous} then "
                    f"{p}: list them in increasing order"
                )
            if previous is not None and p <= previous + 1:
                raise ValueError(
                    f"overlapped pairs at positions {previous} and {p} on rank {rank} share "
                    f"action {row[p]}: an action belongs to at most one pair"
                )
            first, second = row[p], row[p + 1]
            if first.microbatch == second.microbatch:
                raise ValueError(
                    f"overlapped pair {first}+{second} on rank {rank} has one microbatch: the "
                    "two actions of a pair run as one program, so they must be independent "
                    "(pair actions of different microbatches)"
                )
            previous = p


def validate(schedule: Schedule) -> Schedule:
    """Check that ``schedule`` is complete and runs without deadlock; return it unchanged.

    Every (stage, microbatch) must have exactly one F and either one B or one I and one W, all
    on the rank owning the stage. Then each rank runs its actions strictly in order, and an
    action waits for its inputs: F(s, m) for F(s-1, m); B or I(s, m) for F(s, m) and for B or
    I(s+1, m); W(s, m) for I(s, m). If no rank can progress, the ValueError names the first
    blocked action of the lowest blocked rank and what it waits for. An overlapped pair must be
    two adjacent actions of different microbatches, in no other pair.

    Example:
        >>> from mmnnx.mpmd.schedules import Action, Schedule, validate
        >>> broken = Schedule("broken", 1, 1, 1, (0,), [[Action("B", 0, 0), Action("F", 0, 0)]])
        >>> validate(broken)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: schedule 'broken' deadlocks: rank 0 action B0.0 waits for F0.0 ...
    """
    _check_structure(schedule)
    _execute(schedule, lambda action: 1)
    return schedule


def _peak_in_flight(schedule: Schedule) -> tuple[int, ...]:
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for row in schedule.actions:
        for action in row:
            if action.kind == "F":
                held[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], held[action.stage])
            elif action.kind in "BW":
                held[action.stage] -= 1
    return tuple(peak)


def simulate(
    schedule: Schedule,
    forward_cost: float = 1,
    backward_cost: float = 2,
    weight_cost: float | None = None,
    *,
    action_costs: Mapping[str | tuple[str, int], float] | None = None,
    pair_costs: Mapping[tuple[tuple[str, int], tuple[str, int]], float] | None = None,
) -> SimulationResult:
    """Simulate ``schedule`` with fixed per-action costs and zero communication time.

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

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b, simulate, zero_bubble_h1
        >>> simulate(one_f_one_b(4, 8)).makespan
        33
        >>> simulate(zero_bubble_h1(4, 8)).makespan
        27.0
        >>> simulate(one_f_one_b(4, 8), action_costs={"F": 1, "B": 2, ("B", 3): 4}).makespan
        49
    """
    pair_duration = _pair_duration(schedule, pair_costs)
    if action_costs is not None:
        validate(schedule)
        costs = _costs_per_action(schedule, action_costs)
        timed = _execute(schedule, lambda a: costs[(a.kind, a.stage)], pair_duration)
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
    return _result(schedule, _execute(schedule, lambda a: costs[a.kind], pair_duration))


def _pair_duration(
    schedule: Schedule, pair_costs: Mapping[Any, float] | None
) -> Callable[[Action, Action], float | None]:
    """``pair_costs`` (see :func:`simulate`) checked, as ``_execute``'s ``pair_duration``."""
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
        Event(t.rank, t.action.kind, t.action.stage, t.action.microbatch, t.start, t.end)
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
        peak_in_flight=_peak_in_flight(schedule),
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
    """The rank a timed event ran on: its ``rank`` (a step's timeline: the task whose devices
    ran it; a simulation: the rank number), else its ``task``."""
    rank = getattr(event, "rank", None)
    return rank if rank not in (None, "") else event.task


def _costs_per_action(
    schedule: Schedule, action_costs: Mapping[str | tuple[str, int], float]
) -> dict[tuple[str, int], float]:
    """``action_costs`` resolved to one cost per ``(kind, stage)`` that ``schedule`` runs."""
    for key, value in action_costs.items():
        kind, stage = key if isinstance(key, tuple) else (key, None)
        if kind not in KINDS or not (
            stage is None
            or (isinstance(stage, numbers.Integral) and 0 <= stage < schedule.num_stages)
        ):
            raise ValueError(
                f"action_costs key {key!r} names no action of a schedule of "
                f"{schedule.num_stages} stages: keys are a kind ({', '.join(KINDS)}) or "
                f"(kind, stage) with 0 <= stage < {schedule.num_stages}"
            )
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
        >>> from mmnnx.mpmd.timing import Event
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
    events, the rank number), else by ``task``. The span runs from the earliest start to the
    latest end. On an ``overlapped_timeline()`` this is the bubble as the step ran; on a
    ``timeline()``, where actions run one at a time, it is not a bubble at all.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe, measured_bubble, simulate
        >>> result = simulate(gpipe(2, 4))
        >>> measured_bubble(result.events) == result.bubble_fraction
        True
    """
    spans: dict[Any, list[tuple[float, float]]] = {}
    for e in events:
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


def _check_counts(num_stages: int, num_microbatches: int) -> None:
    for field, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")


def _check_interleaved(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    _check_counts(num_ranks, num_microbatches)
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool):
        raise ValueError(f"virtual_stages must be an int, got {virtual_stages!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def _need_enough_microbatches(name: str, num_microbatches: int, depth: int, what: str) -> None:
    if num_microbatches < depth:
        raise ValueError(
            f"{name} needs at least as many microbatches as {what} ({depth}), got "
            f"{num_microbatches}: use num_microbatches >= {depth}, or the 'gpipe' schedule"
        )


def _need_whole_groups(name: str, num_microbatches: int, num_ranks: int) -> None:
    if num_microbatches % num_ranks:
        raise ValueError(
            f"{name} sends microbatches through in groups of num_ranks={num_ranks}: "
            f"num_microbatches must be a multiple of {num_ranks}, got {num_microbatches}"
        )


def _looped_stages(rank: int, num_ranks: int, virtual_stages: int) -> list[int]:
    """The stages rank ``rank`` holds when ``virtual_stages`` loops go round the ranks."""
    return [rank + k * num_ranks for k in range(virtual_stages)]


def _looped(
    name: str, num_ranks: int, num_microbatches: int, virtual_stages: int, rows: list
) -> Schedule:
    """A validated schedule whose stage ``s`` runs on rank ``s % num_ranks``."""
    num_stages = num_ranks * virtual_stages
    stage_to_rank = tuple(stage % num_ranks for stage in range(num_stages))
    return validate(Schedule(name, num_stages, num_microbatches, num_ranks, stage_to_rank, rows))


def _plain(name: str, num_stages: int, num_microbatches: int, rows: list[list[Action]]) -> Schedule:
    """A validated schedule where rank ``r`` runs exactly stage ``r``."""
    return validate(
        Schedule(name, num_stages, num_microbatches, num_stages, tuple(range(num_stages)), rows)
    )


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards (microbatch order).

    Rank ``r`` runs stage ``r``; every stage holds all M microbatches' activations at once.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe
        >>> " ".join(map(str, gpipe(3, 2).actions_of(2)))
        'F2.0 F2.1 B2.0 B2.1'
    """
    _check_counts(num_stages, num_microbatches)
    rows = [
        [Action("F", stage, m) for m in range(num_microbatches)]
        + [Action("B", stage, m) for m in range(num_microbatches)]
        for stage in range(num_stages)
    ]
    return _plain("gpipe", num_stages, num_microbatches, rows)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Classic 1F1B (PipeDream-Flush): warm-up forwards, then one forward / one backward.

    Rank ``r`` runs stage ``r``: ``S - r - 1`` warm-up forwards, then alternates one forward
    and one backward until the forwards run out, then the remaining backwards (cool-down), so
    stage ``r`` holds at most ``S - r`` microbatches' activations. Needs ``M >= S``.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b
        >>> " ".join(map(str, one_f_one_b(3, 4).actions_of(0)))
        'F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3'
    """
    _check_counts(num_stages, num_microbatches)
    _need_enough_microbatches("1f1b", num_microbatches, num_stages, "stages")
    rows = []
    for stage in range(num_stages):
        warmup = num_stages - stage - 1
        row = [Action("F", stage, m) for m in range(warmup)]
        for m in range(warmup, num_microbatches):
            row += [Action("F", stage, m), Action("B", stage, m - warmup)]
        row += [Action("B", stage, m) for m in range(num_microbatches - warmup, num_microbatches)]
        rows.append(row)
    return _plain("1f1b", num_stages, num_microbatches, rows)


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron-style interleaved 1F1B: each rank holds ``virtual_stages`` non-adjacent stages.

    There are ``S = num_ranks * virtual_stages`` stages; rank ``r`` holds stages ``r``,
    ``r + num_ranks``, ``r + 2 * num_ranks``, ... Microbatches go through in groups of
    ``num_ranks``: a rank's forwards run group by group, within a group its stages in
    increasing order, and within a stage the group's microbatches in order; its backwards run
    in the same group order with its stages in decreasing order. Rank ``r`` runs
    ``2 * (num_ranks - r - 1) + (virtual_stages - 1) * num_ranks`` warm-up forwards (all of them
    if fewer), then alternates one forward / one backward, then the remaining backwards. With
    ``virtual_stages=1`` this is exactly :func:`one_f_one_b`. ``num_microbatches`` must be a
    multiple of ``num_ranks``. To compare timings with a plain schedule of the same model, pass
    per-stage costs divided by ``virtual_stages`` to :func:`simulate`.

    Example:
        >>> from mmnnx.mpmd.schedules import interleaved_1f1b
        >>> schedule = interleaved_1f1b(num_ranks=2, num_microbatches=2, virtual_stages=2)
        >>> " ".join(map(str, schedule.actions_of(1)))
        'F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1'
    """
    _check_interleaved(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages == 1:
        plain = one_f_one_b(num_ranks, num_microbatches)
        return dataclasses.replace(plain, name="interleaved-1f1b")
    _need_enough_microbatches(
        "interleaved-1f1b", num_microbatches, num_ranks, "ranks (pipeline depth)"
    )
    _need_whole_groups("interleaved-1f1b", num_microbatches, num_ranks)
    groups = range(num_microbatches // num_ranks)
    rows = []
    for rank in range(num_ranks):
        stages = _looped_stages(rank, num_ranks, virtual_stages)
        forwards = [
            Action("F", stage, g * num_ranks + j)
            for g in groups
            for stage in stages
            for j in range(num_ranks)
        ]
        backwards = [
            Action("B", stage, g * num_ranks + j)
            for g in groups
            for stage in reversed(stages)
            for j in range(num_ranks)
        ]
        total = len(forwards)
        warmup = min(2 * (num_ranks - rank - 1) + (virtual_stages - 1) * num_ranks, total)
        row = forwards[:warmup]
        for i in range(total - warmup):
            row += [forwards[warmup + i], backwards[i]]
        row += backwards[total - warmup :]
        rows.append(row)
    return _looped("interleaved-1f1b", num_ranks, num_microbatches, virtual_stages, rows)


def interleaved_gpipe(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved GPipe (PyTorch's "looped BFS"): each rank holds ``virtual_stages``
    non-adjacent stages (rank ``r``: ``r``, ``r + num_ranks``, ...) and runs them breadth-first:
    all microbatches' forwards of its first stage, then of its next, ..., then the backwards
    stage by stage in reverse.

    With unit costs per stage (a rank's work split over ``v`` stages) the bubble is
    ``(R - 1) / (v * M + R - 1)`` of the run, GPipe's divided by about ``v``, for ``M >= R``;
    like GPipe, each stage holds all ``M`` microbatches' activations until its backwards.

    Example:
        >>> from mmnnx.mpmd.schedules import interleaved_gpipe
        >>> schedule = interleaved_gpipe(num_ranks=2, num_microbatches=2, virtual_stages=2)
        >>> " ".join(map(str, schedule.actions_of(1)))
        'F1.0 F1.1 F3.0 F3.1 B3.0 B3.1 B1.0 B1.1'
    """
    _check_interleaved(num_ranks, num_microbatches, virtual_stages)
    microbatches = range(num_microbatches)
    rows = []
    for rank in range(num_ranks):
        stages = _looped_stages(rank, num_ranks, virtual_stages)
        rows.append(
            [Action("F", stage, m) for stage in stages for m in microbatches]
            + [Action("B", stage, m) for stage in reversed(stages) for m in microbatches]
        )
    return _looped("interleaved-gpipe", num_ranks, num_microbatches, virtual_stages, rows)


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 from "Zero Bubble Pipeline Parallelism" (Qi et al., 2023).

    The backward is split into I (input gradient, on the critical path) and W (weight
    gradient, which nothing waits for). Rank ``r`` runs stage ``r`` in the 1F1B pattern with
    I in place of B (``S - r - 1`` warm-up forwards, then F and I alternating), and runs
    ``W(m)`` right after ``I(m + r)``: the ``r`` deferred weight passes fill the bubbles of
    the cool-down and are flushed at the end. Every stage therefore holds at most ``S``
    microbatches (counting until W), the peak of 1F1B's first stage, while the bubble shrinks
    from 1F1B's ``(S-1) * (F + B)`` to ``(S-1) * (F + I - W)``. Needs ``M >= S``.

    Example:
        >>> from mmnnx.mpmd.schedules import zero_bubble_h1
        >>> " ".join(map(str, zero_bubble_h1(2, 3).actions_of(1)))
        'F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2'
    """
    _check_counts(num_stages, num_microbatches)
    _need_enough_microbatches("zero-bubble-h1", num_microbatches, num_stages, "stages")
    rows = []
    for stage in range(num_stages):
        warmup = num_stages - stage - 1
        row = [Action("F", stage, m) for m in range(warmup)]
        weights = 0
        for m in range(num_microbatches):
            if warmup + m < num_microbatches:
                row.append(Action("F", stage, warmup + m))
            row.append(Action("I", stage, m))
            if m - weights >= stage:
                row.append(Action("W", stage, weights))
                weights += 1
        row += [Action("W", stage, m) for m in range(weights, num_microbatches)]
        rows.append(row)
    return _plain("zero-bubble-h1", num_stages, num_microbatches, rows)


def custom(
    table: Sequence[Sequence[Action | str | tuple[str, int, int]]],
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    name: str = "custom",
) -> Schedule:
    """Build and validate a schedule from one list of actions per rank.

    Actions may be :class:`Action` objects, short strings such as ``"F0.1"``, or
    ``(kind, stage, microbatch)`` tuples; an overlapped pair (see :class:`Schedule`) is one
    entry ``"F0.2+B3.0"``. Each stage is owned by the rank whose row holds its actions;
    ``num_stages`` and ``num_microbatches`` default to one more than the largest index used.

    Example:
        >>> from mmnnx.mpmd.schedules import custom
        >>> schedule = custom([["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "B1.0", "F1.1", "B1.1"]])
        >>> schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
        (2, 2, (0, 1))
        >>> custom([["F0.0", "F0.1+B0.0", "B0.1"]]).overlapped
        ((1,),)
        >>> custom([["F0.0", "I0.0"]])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: missing action W0.0: I0.0 is present, ...
    """
    if not table:
        raise ValueError("a schedule table needs at least one rank (row)")
    rows: list[list[Action]] = []
    overlapped: list[list[int]] = []
    for rank, entries in enumerate(table):
        if isinstance(entries, str):
            raise ValueError(f"row {rank} of the table is a string; give a list of actions")
        row: list[Action] = []
        pairs: list[int] = []
        for entry in entries:
            if isinstance(entry, Action):
                row.append(entry)
            elif isinstance(entry, str) and "+" in entry:
                parts = entry.split("+")
                if len(parts) != 2:
                    raise ValueError(
                        f"cannot read {entry!r} on rank {rank}: an overlapped pair is two "
                        "actions joined by '+', e.g. 'F0.2+B3.0'"
                    )
                pairs.append(len(row))
                row += [Action.parse(part) for part in parts]
            elif isinstance(entry, str):
                row.append(Action.parse(entry))
            else:
                row.append(Action(*entry))
        rows.append(row)
        overlapped.append(pairs)
    actions = [action for row in rows for action in row]
    if not actions:
        raise ValueError("a schedule table needs at least one action")
    if num_stages is None:
        num_stages = max(action.stage for action in actions) + 1
    if num_microbatches is None:
        num_microbatches = max(action.microbatch for action in actions) + 1
    _check_counts(num_stages, num_microbatches)
    owners: dict[int, tuple[int, Action]] = {}
    for rank, row in enumerate(rows):
        for action in row:
            first = owners.setdefault(action.stage, (rank, action))
            if first[0] != rank:
                raise ValueError(
                    f"stage {action.stage} appears on rank {first[0]} ({first[1]}) and on rank "
                    f"{rank} ({action}): each stage must run on one rank"
                )
    for stage in range(num_stages):
        if stage not in owners:
            raise ValueError(f"missing action F{stage}.0: stage {stage} has no actions on any rank")
    stage_to_rank = tuple(owners[stage][0] for stage in range(num_stages))
    return validate(
        Schedule(name, num_stages, num_microbatches, len(rows), stage_to_rank, rows, overlapped)
    )


class CostsNotUsed(ValueError):
    """Raised by :func:`get` when ``costs`` are given for a schedule whose order ignores them.

    Example:
        >>> from mmnnx.mpmd.schedules import CostsNotUsed, get
        >>> try:
        ...     get("1f1b", 2, 2, costs={"F": 1, "I": 1, "W": 1})
        ... except CostsNotUsed as e:
        ...     print(e)
        schedule '1f1b' is built the same whatever the passes cost; pass no costs
    """


def _check_takes_costs(name: str, build: Callable[..., Schedule]) -> None:
    if "costs" not in inspect.signature(build).parameters:
        raise CostsNotUsed(
            f"schedule {name!r} is built the same whatever the passes cost; pass no costs"
        )


def _costs_kwargs(name: str, build: Callable[..., Schedule], costs: Any) -> dict[str, Any]:
    """``costs`` as keyword arguments for ``build``: none without costs; raises
    :class:`CostsNotUsed` when ``build`` takes none."""
    if costs is None:
        return {}
    _check_takes_costs(name, build)
    return {"costs": costs}


Builder = Callable[[int, int, int], Schedule]
"""A schedule builder: ``builder(num_stages, num_microbatches, virtual_stages) -> Schedule``."""

_REGISTRY: dict[str, Builder] = {}


def register(name: str, builder: Builder, *, replace: bool = False) -> None:
    """Make ``builder`` available as the schedule ``name`` everywhere a name is accepted.

    ``builder(num_stages, num_microbatches, virtual_stages)`` returns the :class:`Schedule`;
    ``num_stages`` counts model stages, ``virtual_stages`` how many of them each rank holds.
    :func:`get`, ``mm.microbatch(schedule=name)``, ``mmnnx train --schedule`` and
    ``multimesh_compat`` all read this one registry. Registering a taken name raises unless
    ``replace=True``.

    Example:
        >>> from mmnnx.mpmd import schedules
        >>> def forwards_first(num_stages, num_microbatches, virtual_stages):
        ...     rows = [[f"F{s}.{m}" for m in range(num_microbatches)]
        ...             + [f"B{s}.{m}" for m in reversed(range(num_microbatches))]
        ...             for s in range(num_stages)]
        ...     return schedules.custom(rows, name="forwards-first")
        >>> schedules.register("forwards-first", forwards_first)
        >>> schedules.get("forwards-first", 2, 2).actions_of(0)[2]
        Action(kind='B', stage=0, microbatch=1)
        >>> schedules.unregister("forwards-first")
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a schedule name must be a non-empty str, got {name!r}")
    if not callable(builder):
        raise TypeError(f"the builder of schedule {name!r} is not callable: {builder!r}")
    if name in _REGISTRY and not replace:
        raise ValueError(
            f"schedule {name!r} is already registered; pass replace=True to replace it"
        )
    _REGISTRY[name] = builder


def unregister(name: str) -> None:
    """Remove the schedule ``name`` from the registry (see :func:`register`).

    Example:
        >>> from mmnnx.mpmd import schedules
        >>> schedules.unregister("no-such-schedule")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule 'no-such-schedule'; valid names: 'gpipe', ...
    """
    _check_name(name)
    del _REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered schedule names, in registration order.

    Example:
        >>> from mmnnx.mpmd.schedules import names
        >>> names()  # doctest: +NORMALIZE_WHITESPACE
        ('gpipe', '1f1b', 'interleaved-1f1b', 'interleaved-gpipe', 'zero-bubble-h1',
         'zero-bubble-h2', 'zero-bubble-v', 'interleaved-zero-bubble', 'dualpipev')
    """
    return tuple(_REGISTRY)


def _check_name(name: str) -> None:
    if name not in _REGISTRY:
        valid = ", ".join(repr(n) for n in _REGISTRY)
        raise ValueError(f"unknown schedule {name!r}; valid names: {valid}")


def get(
    name: str,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    costs: Mapping[Any, float] | None = None,
) -> Schedule:
    """Build the registered schedule called ``name`` (see :func:`names`).

    ``costs`` (durations by kind, ``{"F": 2, "I": 1, "W": 1}``, or by ``(kind, stage)``) asks a
    schedule that orders its passes by their durations (``zero-bubble-h2``, ``zero-bubble-v``,
    ``interleaved-zero-bubble``) to order them for these; another schedule raises a ValueError.

    ``num_stages`` always counts model stages. For ``"interleaved-1f1b"`` each rank holds
    ``virtual_stages`` of them, so there are ``num_stages / virtual_stages`` ranks; the other
    built-in schedules use one rank per stage and ``virtual_stages=1``.

    Example:
        >>> from mmnnx.mpmd.schedules import get
        >>> schedule = get("interleaved-1f1b", num_stages=8, num_microbatches=8, virtual_stages=2)
        >>> schedule.num_ranks, schedule.stages_of(0)
        (4, (0, 4))
        >>> get("pipedream", 4, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule 'pipedream'; valid names: 'gpipe', '1f1b', ...
    """
    _check_name(name)
    if (
        not isinstance(virtual_stages, int)
        or isinstance(virtual_stages, bool)
        or virtual_stages < 1
    ):
        raise ValueError(f"virtual_stages must be an int >= 1, got {virtual_stages!r}")
    builder = _REGISTRY[name]
    if costs is None:
        schedule = builder(num_stages, num_microbatches, virtual_stages)
    else:
        _check_takes_costs(name, builder)
        schedule = builder(num_stages, num_microbatches, virtual_stages, costs=costs)
    if not isinstance(schedule, Schedule):
        raise TypeError(f"the builder of schedule {name!r} returned {schedule!r}, not a Schedule")
    validate(schedule)
    if (schedule.num_stages, schedule.num_microbatches) != (num_stages, num_microbatches):
        raise ValueError(
            f"the builder of schedule {name!r} was asked for {num_stages} stages and "
            f"{num_microbatches} microbatches but built {schedule.num_stages} and "
            f"{schedule.num_microbatches}"
        )
    return schedule


_SEVERAL_STAGES_PER_RANK: set[str] = set()


def _several_stages_per_rank() -> list[str]:
    """The registered built-in schedules that take ``virtual_stages > 1``."""
    return [name for name in _REGISTRY if name in _SEVERAL_STAGES_PER_RANK]


def _one_stage_per_rank(name: str, build: Callable[..., Schedule]) -> Builder:
    def builder(
        num_stages: int, num_microbatches: int, virtual_stages: int, costs: Any = None
    ) -> Schedule:
        if virtual_stages != 1:
            raise ValueError(
                f"virtual_stages={virtual_stages} applies only to schedules that run several "
                f"stages per rank ({', '.join(repr(n) for n in _several_stages_per_rank())}); "
                f"{name!r} runs one stage per rank"
            )
        return build(num_stages, num_microbatches, **_costs_kwargs(name, build, costs))

    return builder


def _interleaved(name: str, build: Callable[..., Schedule]) -> Builder:
    _SEVERAL_STAGES_PER_RANK.add(name)

    def builder(
        num_stages: int, num_microbatches: int, virtual_stages: int, costs: Any = None
    ) -> Schedule:
        _check_counts(num_stages, num_microbatches)
        if virtual_stages == 1:
            raise ValueError(
                f"{name} with virtual_stages=1 would run one stage per rank, the plain "
                "schedule it interleaves: pass virtual_stages >= 2 (and give each task that "
                "many stages, e.g. mm.stage_rules(..., virtual_stages=2)), or name a "
                "one-stage-per-rank schedule"
            )
        if num_stages % virtual_stages:
            raise ValueError(
                f"virtual_stages={virtual_stages} does not divide num_stages={num_stages}: "
                f"{name} puts virtual_stages stages on each of num_stages / virtual_stages ranks"
            )
        kwargs = _costs_kwargs(name, build, costs)
        return build(num_stages // virtual_stages, num_microbatches, virtual_stages, **kwargs)

    return builder


register("gpipe", _one_stage_per_rank("gpipe", gpipe))
register("1f1b", _one_stage_per_rank("1f1b", one_f_one_b))
register("interleaved-1f1b", _interleaved("interleaved-1f1b", interleaved_1f1b))
register("interleaved-gpipe", _interleaved("interleaved-gpipe", interleaved_gpipe))
register("zero-bubble-h1", _one_stage_per_rank("zero-bubble-h1", zero_bubble_h1))

from mmnnx.mpmd.zero_bubble import (  # noqa: E402, F401  (built on the above; re-exported)
    dualpipe_v,
    interleaved_zero_bubble,
    v_stages,
    zero_bubble_h2,
    zero_bubble_v,
)


def _v_shaped(name: str, build: Callable[..., Schedule]) -> Builder:
    _SEVERAL_STAGES_PER_RANK.add(name)

    def builder(
        num_stages: int, num_microbatches: int, virtual_stages: int, costs: Any = None
    ) -> Schedule:
        _check_counts(num_stages, num_microbatches)
        if virtual_stages != 2 or num_stages % 2:
            raise ValueError(
                f"{name} places two stages per rank in a V: it needs virtual_stages=2 and an "
                f"even number of stages, got virtual_stages={virtual_stages} and "
                f"{num_stages} stages"
            )
        return build(num_stages // 2, num_microbatches, **_costs_kwargs(name, build, costs))

    return builder


register("zero-bubble-h2", _one_stage_per_rank("zero-bubble-h2", zero_bubble_h2))
register("zero-bubble-v", _v_shaped("zero-bubble-v", zero_bubble_v))
register(
    "interleaved-zero-bubble",
    _interleaved("interleaved-zero-bubble", interleaved_zero_bubble),
)
register("dualpipev", _v_shaped("dualpipev", dualpipe_v))


from mmnnx.errors import NoCandidateError  # noqa: E402, F401  (tune raises it)


def tune(step: Any, *args: Any, **kwargs: Any) -> Any:
    """Measures a pipelined ``mm.jit`` step once and returns the fastest schedule and
    microbatch count that fit a memory budget, with a table of every candidate
    (:func:`mmnnx.mpmd.tuning.tune`, which runs the step; this module itself only holds data).

    Example:
        >>> # best = mm.schedules.tune(train_step, model, opt, batch, memory_budget="2GiB").best
    """
    from mmnnx.mpmd.tuning import tune as run_and_simulate  # noqa: PLC0415

    return run_and_simulate(step, *args, **kwargs)
