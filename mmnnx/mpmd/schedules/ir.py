"""The schedule records (:class:`Action`, :class:`Schedule`), their validation, CSV, :func:`custom`
tables, and :func:`play`, which runs a schedule's ranks in order under given durations."""

from __future__ import annotations

import csv
import dataclasses
import io
import numbers
import re
from collections.abc import Callable, Container, Sequence
from typing import NamedTuple

KINDS = ("F", "B", "I", "W")
"""Action kinds: forward, full backward, input-gradient half, weight-gradient half."""

TRANSFER = "T"
"""The kind of a timed transfer in a step's timeline: a value crossing from one rank's devices
to another's, not an action of the schedule."""

_ACTION_RE = re.compile(r"^([FBIW])(\d+)\.(\d+)$")


@dataclasses.dataclass(frozen=True)
class Action:
    """One pass of one stage over one microbatch; ``str`` gives the short form ``F0.3`` (kind,
    stage, microbatch), which :meth:`parse` reads back.

    Example:
        >>> from mmnnx.mpmd.schedules import Action
        >>> str(Action("F", 0, 3)), Action.parse("W2.0")
        ('F0.3', Action(kind='W', stage=2, microbatch=0))
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

    ``stage_to_rank[s]`` is the rank owning stage ``s`` (an interleaved schedule puts several stages
    on a rank) and ``actions[r]`` the actions of rank ``r`` in order; sequences are stored as
    tuples. ``overlapped[r]`` lists the positions ``p`` where actions ``p`` and ``p + 1`` of rank
    ``r`` form an overlapped pair: two actions of different microbatches run as one compiled program
    (DualPipe). ``str(schedule)`` draws the unit-time timeline; :meth:`to_csv` and :meth:`from_csv`
    store it.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe
        >>> print(gpipe(2, 2))
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
            timed = play(self, lambda action: 1)
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
        """The schedule as CSV text: a header ``rank,0,1,...``, then one row per rank of its actions
        in order (an overlapped pair as one cell ``F0.2+B3.0``), padded with empty cells.
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
        """Read a schedule written by :meth:`to_csv` (ranks ``0, 1, ...`` in order; empty cells and
        blank lines ignored) and check it with :func:`validate`.

        Example:
            >>> from mmnnx.mpmd.schedules import Schedule
            >>> Schedule.from_csv("rank,0,1\\n0,F0.0,B0.0\\n").num_stages
            1
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


class Timed(NamedTuple):
    """One action as :func:`play` ran it: on which rank, and when it started and ended."""

    rank: int
    action: Action
    start: float
    end: float


def _dependencies(action: Action, num_stages: int, present: Container[tuple]) -> list[Action]:
    """The actions among ``present`` whose results ``action`` consumes."""
    return [Action(*need) for need in _needs(*_key(action), num_stages, present)]


def _key(action: Action) -> tuple[str, int, int]:
    """``action`` as a plain tuple ``(kind, stage, microbatch)``, hashed faster."""
    return action.kind, action.stage, action.microbatch


def _needs(
    kind: str, stage: int, microbatch: int, num_stages: int, present: Container[tuple]
) -> list[tuple]:
    """:func:`_dependencies` as keys."""
    if kind == "F":
        return [("F", stage - 1, microbatch)] if stage > 0 else []
    if kind == "W":
        return [("I", stage, microbatch)]
    needs = [("F", stage, microbatch)]
    if stage < num_stages - 1:
        full = ("B", stage + 1, microbatch)
        needs.append(full if full in present else ("I", stage + 1, microbatch))
    return needs


def play(
    schedule: Schedule,
    duration: Callable[[Action], float],
    pair_duration: Callable[[Action, Action], float | None] = lambda first, second: None,
    transfer: Callable[[Action], float] = lambda producer: 0,
) -> list[Timed]:
    """Run every rank's actions strictly in order, each as soon as its rank's previous action
    and its inputs are done (an overlapped pair: both actions' inputs, results handed on when
    both end); a result read on another rank arrives ``transfer(producer)`` after its producer
    ended. Raises ValueError naming the blocked actions when no rank can make progress.
    """
    # The actions by number, each one's dependencies found once
    rows = schedule.actions
    rank_of = {a: r for r, row in enumerate(rows) for a in row}
    actions_by_number, owner, missing = list(rank_of), list(rank_of.values()), len(rank_of)
    keys = list(map(_key, actions_by_number))
    number = dict(zip(keys, range(missing), strict=True))
    needs_of = [
        [number.get(need, missing) for need in _needs(*k, schedule.num_stages, number)]
        for k in keys
    ]
    done: list[float | None] = [None] * (missing + 1)  # the last: actions not in the schedule
    numbered = [[number[_key(a)] for a in row] for row in rows]
    free: list[float] = [0] * schedule.num_ranks
    pcs = [0] * schedule.num_ranks
    timed: list[Timed] = []
    remaining = sum(map(len, rows))
    pair_starts = [set(row) for row in schedule.overlapped]
    while remaining:
        progressed = False
        for rank, row in enumerate(numbered):
            while (pc := pcs[rank]) < len(row):
                width = 2 if pc in pair_starts[rank] else 1
                ids = row[pc : pc + width]
                needs = needs_of[ids[0]] if width == 1 else needs_of[ids[0]] + needs_of[ids[1]]
                if any(done[k] is None for k in needs):
                    break
                start = free[rank]
                for k in needs:
                    arrival = done[k] + (transfer(actions_by_number[k]) if owner[k] != rank else 0)
                    start = max(start, arrival)
                actions = rows[rank][pc : pc + width]
                timed += run_program(rank, actions, start, duration, pair_duration)
                end = timed[-1].end
                for k in ids:
                    done[k] = end
                free[rank] = end
                pcs[rank] += width
                remaining -= width
                progressed = True
        if not progressed:
            finish = {a: done[i] for i, a in enumerate(actions_by_number) if done[i] is not None}
            raise ValueError(_deadlock_message(schedule, pcs, finish, number))
    return sorted(timed, key=lambda t: (t.start, t.rank))


def run_program(
    rank: int,
    actions: Sequence[Action],
    start: float,
    duration: Callable[[Action], float],
    pair_duration: Callable[[Action, Action], float | None],
) -> list[Timed]:
    """One program (an action, or an overlapped pair) run on ``rank`` from ``start``."""
    durations = [duration(action) for action in actions]
    whole = pair_duration(*actions) if len(actions) == 2 else None
    if whole is not None:
        total = sum(durations)
        durations = [whole * d / total for d in durations] if total else [whole / 2] * 2
    timed = []
    for action, took in zip(actions, durations, strict=True):
        timed.append(Timed(rank=rank, action=action, start=start, end=start + took))
        start += took
    return timed


def _deadlock_message(
    schedule: Schedule, pcs: list[int], finish: dict[Action, float], present: Container[tuple]
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
    check_counts(schedule.num_stages, schedule.num_microbatches, schedule.num_ranks)
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
    keys = set(map(_key, seen))
    for stage in range(num_stages):
        for microbatch in range(schedule.num_microbatches):
            has = {kind: (kind, stage, microbatch) in keys for kind in KINDS}
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
    """Each overlapped pair: adjacent actions of different microbatches, in no other pair."""
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

    Every (stage, microbatch) needs one F and either one B or one I and one W, on the rank owning
    the stage. Each rank runs its actions in order, an action waiting for its inputs: F(s, m) for
    F(s-1, m); B or I(s, m) for F(s, m) and B or I(s+1, m); W(s, m) for I(s, m). A deadlock's
    ValueError names the first blocked action of the lowest blocked rank and what it waits for. An
    overlapped pair must be two adjacent actions of different microbatches, in no other pair.

    Example:
        >>> from mmnnx.mpmd.schedules import Action, Schedule, validate
        >>> broken = Schedule("broken", 1, 1, 1, (0,), [[Action("B", 0, 0), Action("F", 0, 0)]])
        >>> validate(broken)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: schedule 'broken' deadlocks: rank 0 action B0.0 waits for F0.0 ...
    """
    _check_structure(schedule)
    play(schedule, lambda action: 1)
    return schedule


def validated(
    name: str, num_microbatches: int, stage_to_rank: Sequence[int], rows: Sequence, overlapped=()
) -> Schedule:
    """The validated schedule of ``rows`` (one per rank), stage ``s`` on ``stage_to_rank[s]``."""
    stage_to_rank = tuple(stage_to_rank)
    return validate(
        Schedule(
            name=name,
            num_stages=len(stage_to_rank),
            num_microbatches=num_microbatches,
            num_ranks=len(rows),
            stage_to_rank=stage_to_rank,
            actions=rows,
            overlapped=overlapped,
        )
    )


def check_counts(num_stages: int, num_microbatches: int, num_ranks: int = 1) -> None:
    """Raises a ValueError unless the counts are positive ints (bools refused)."""
    counts = {"num_stages": num_stages, "num_microbatches": num_microbatches}
    for field, value in {**counts, "num_ranks": num_ranks}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")


def check_action_key(schedule: Schedule, key: object, name: str) -> None:
    """Raises a ValueError unless ``key`` of the mapping ``name`` names actions of ``schedule``: a
    kind (``"F"``) or a ``(kind, stage)`` pair with the stage in range."""
    kind, stage = key if isinstance(key, tuple) and len(key) == 2 else (key, None)
    if kind not in KINDS or not (
        stage is None or (isinstance(stage, numbers.Integral) and 0 <= stage < schedule.num_stages)
    ):
        raise ValueError(
            f"{name} key {key!r} names no action of a schedule of "
            f"{schedule.num_stages} stages: keys are a kind ({', '.join(KINDS)}) or "
            f"(kind, stage) with 0 <= stage < {schedule.num_stages}"
        )


def custom(
    table: Sequence[Sequence[Action | str | tuple[str, int, int]]],
    num_stages: int | None = None,
    num_microbatches: int | None = None,
    name: str = "custom",
) -> Schedule:
    """Build and validate a schedule from one list of actions per rank.

    Actions may be :class:`Action` objects, short strings (``"F0.1"``) or
    ``(kind, stage, microbatch)`` tuples; an overlapped pair is one entry ``"F0.2+B3.0"``. A stage
    is owned by the rank whose row holds its actions; the counts default to one more than the
    largest index used.

    Example:
        >>> from mmnnx.mpmd.schedules import custom
        >>> schedule = custom([["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "B1.0", "F1.1", "B1.1"]])
        >>> schedule.num_stages, schedule.num_microbatches, schedule.stage_to_rank
        (2, 2, (0, 1))
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
    check_counts(num_stages, num_microbatches)
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
    stage_to_rank = [owners[stage][0] for stage in range(num_stages)]
    return validated(name, num_microbatches, stage_to_rank, rows, overlapped)
