"""The zero-bubble schedules beyond ZB-H1 (ZB-H2, ZB-V, interleaved zero bubble), the list scheduler
that builds them, and DualPipeV.

As in the zero-bubble paper (Qi et al., arXiv 2401.10241), a list scheduler plays the pipeline in
unit time, and at each step every free rank runs, among the passes whose inputs are ready, an ``I``
first (the previous stage waits for it), else an ``F`` while the rank holds fewer microbatches than
its memory limit (counting from a stage's ``F`` to its ``W``), else the oldest deferred ``W``. The
limit tells the schedules apart: ZB-H2 lets every rank hold ``2S - 1`` microbatches; ZB-V and
interleaved zero bubble keep the memory of 1F1B and interleaved 1F1B. DualPipeV is built by its own
phases (:func:`dualpipe_v`).

Example:
    >>> from mmnnx.mpmd.schedules import simulate, zero_bubble_v
    >>> simulate(zero_bubble_v(num_ranks=2, num_microbatches=4), 1, 2).makespan
    25.0
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence

from mmnnx.mpmd.schedules.builders import (
    check_interleaved,
    interleaved_1f1b,
    need_enough_microbatches,
    need_whole_groups,
)
from mmnnx.mpmd.schedules.ir import Action, Schedule, check_counts, validated
from mmnnx.mpmd.schedules.simulation import _held_peaks, simulate

Costs = Mapping[str | tuple[str, int], float]
"""Durations of the passes: by kind (``{"F": 2, "I": 1, "W": 1}``) or by ``(kind, stage)``."""


POLICIES = ("zero-bubble", "critical-path")
"""How :func:`list_schedule` picks among the passes a free rank could start: ``"zero-bubble"``
(I, then F memory allowing, then the oldest W) or ``"critical-path"`` (the most work after it)."""


def list_schedule(
    name: str,
    stage_to_rank: Sequence[int],
    num_microbatches: int,
    limits: Sequence[int],
    costs: Costs | None = None,
    policy: str = "zero-bubble",
) -> Schedule:
    """Builds a split-backward schedule by playing it out (see the module docstring); ``limits[r]``:
    the most microbatches rank ``r`` may hold at once; ``costs``: the passes' durations (default:
    one unit each)."""
    stage_to_rank = tuple(stage_to_rank)
    num_stages, num_ranks, m_count = len(stage_to_rank), len(limits), num_microbatches
    if any(limit < 1 for limit in limits):
        raise ValueError(f"{name}: every rank must be allowed at least one microbatch: {limits}")
    if policy not in POLICIES:
        raise ValueError(f"{name}: unknown policy {policy!r}; choose one of {POLICIES}")
    cost = _durations(name, costs)
    critical = _critical_paths(num_stages, cost) if policy == "critical-path" else None
    stages_of = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(num_ranks)]
    f_end: list[list[float]] = [[] for _ in range(num_stages)]
    i_end: list[list[float]] = [[] for _ in range(num_stages)]
    # per rank, deferred W passes ready from ``end``: (microbatch, -stage, end), oldest first
    weights: list[list[tuple[int, int, float]]] = [[] for _ in range(num_ranks)]
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    held = [0] * num_ranks
    free_at = [0.0] * num_ranks
    turn = list(range(num_ranks))  # among ranks free at once, who decides first
    left = [3 * len(stages) * m_count for stages in stages_of]
    ends: list[float] = []  # end times not yet passed, a heap
    stalled: set[int] = set()  # ranks that found nothing to run since the last pass started
    while any(left):
        rank = min((r for r in range(num_ranks) if left[r]), key=lambda r: (free_at[r], turn[r]))
        now = free_at[rank]
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        action = _pick(stages_of[rank], f_end, i_end, weights[rank], now,
                       held[rank] < limits[rank], m_count, critical)  # fmt: skip
        if action is None and not ends:
            stalled.add(rank)
            live = {r for r in range(num_ranks) if left[r]}
            if stalled >= live:  # every rank waits on another's memory: one forward over the limit
                rank, action = next(
                    ((r, a) for r in sorted(live)
                     if (a := _pick(stages_of[r], f_end, i_end, weights[r], free_at[r], True,
                                    m_count, critical)) is not None),
                    (rank, None),
                )  # fmt: skip
                if action is None:
                    raise ValueError(f"{name}: the list scheduler is stuck with limits {limits}")
                now = free_at[rank]
        if action is None:
            later = [free_at[r] for r in range(num_ranks) if left[r] and r != rank]
            # wait for the next pass to end, or for the other ranks free now to decide first
            free_at[rank] = ends[0] if ends else min(later)
            turn[rank] = max(turn) + 1
            continue
        stalled.clear()
        stage, m = action.stage, action.microbatch
        end = now + cost(action.kind, stage)
        if action.kind == "F":
            f_end[stage].append(end)
            held[rank] += 1
        elif action.kind == "I":
            i_end[stage].append(end)
            bisect.insort(weights[rank], (m, -stage, end))
        else:
            weights[rank].remove(next(w for w in weights[rank] if w[:2] == (m, -stage)))
            held[rank] -= 1
        rows[rank].append(action)
        free_at[rank] = end
        heapq.heappush(ends, end)
        left[rank] -= 1
    return validated(name, num_microbatches, stage_to_rank, rows)


GRIDS = (0.05, 0.1, 0.2)
"""The grids (fractions of the mean cost) :func:`built_for` also rounds the costs to: the greedy
list scheduler's choices flip on differences far below what a timing resolves."""


def built_for(
    name: str,
    stage_to_rank: Sequence[int],
    num_microbatches: int,
    limits: Sequence[int],
    costs: Costs | None = None,
) -> Schedule:
    """The fastest under ``costs`` (the first on a tie) of the :func:`list_schedule` each policy
    builds for ``costs``, for them rounded to each of :data:`GRIDS`, and for equal durations."""
    if costs is None:
        return list_schedule(name, stage_to_rank, num_microbatches, limits)
    cost = _durations(name, costs)
    built = [
        list_schedule(name, stage_to_rank, num_microbatches, limits, view, policy)
        for view in [costs, *(_rounded(costs, grid) for grid in GRIDS)]
        for policy in POLICIES
    ]
    built.append(list_schedule(name, stage_to_rank, num_microbatches, limits))

    def makespan(schedule: Schedule) -> float:
        durations = {(a.kind, a.stage): cost(a.kind, a.stage) for r in schedule.actions for a in r}
        return simulate(schedule, action_costs=durations).makespan

    return min(built, key=makespan)


def _rounded(costs: Costs, grid: float) -> dict:
    """``costs`` rounded to multiples of ``grid`` times their mean (never to nothing)."""
    step = grid * sum(costs.values()) / len(costs)
    return {key: step * round(value / step) or value for key, value in costs.items()}


def _durations(name: str, costs: Costs | None) -> Callable[[str, int], float]:
    if costs is None:
        return lambda kind, stage: 1
    for key, value in costs.items():
        if not value > 0:
            raise ValueError(f"{name}: the cost of {key!r} must be positive, got {value!r}")

    def cost(kind: str, stage: int) -> float:
        if (kind, stage) in costs:
            return costs[(kind, stage)]
        if kind in costs:
            return costs[kind]
        raise ValueError(f"{name}: costs give no duration for {kind} passes of stage {stage}")

    return cost


def _critical_paths(num_stages: int, cost: Callable[[str, int], float]) -> dict[tuple, float]:
    """Per ``(kind, stage)``: its duration plus the longest chain of passes waiting on it."""
    after: dict[tuple, float] = {("W", s): cost("W", s) for s in range(num_stages)}
    for s in range(num_stages):
        below = after["I", s - 1] if s > 0 else 0.0
        after["I", s] = cost("I", s) + max(after["W", s], below)
    for s in reversed(range(num_stages)):
        onward = after["F", s + 1] if s + 1 < num_stages else after["I", s]
        after["F", s] = cost("F", s) + onward
    return after


def _pick(
    stages: list[int],
    f_end: list[list[float]],
    i_end: list[list[float]],
    weights: list[tuple[int, int, float]],
    now: float,
    may_forward: bool,
    num_microbatches: int,
    critical: dict[tuple, float] | None = None,
) -> Action | None:
    """The ready pass to run: I, then F (memory allowing), then W; or the most critical."""
    last = len(f_end) - 1

    def first_ready(kind: str) -> Action | None:
        ready = []
        if kind == "I":
            for s in stages:
                m = len(i_end[s])
                inputs_done = s == last or (m < len(i_end[s + 1]) and i_end[s + 1][m] <= now)
                if m < len(f_end[s]) and f_end[s][m] <= now and inputs_done:
                    ready.append((m, -s))
        elif kind == "F" and may_forward:
            for s in stages:
                m = len(f_end[s])
                if m < num_microbatches and (
                    s == 0 or (m < len(f_end[s - 1]) and f_end[s - 1][m] <= now)
                ):
                    ready.append((m, -s))
        elif kind == "W":
            ready = [(m, minus_stage) for m, minus_stage, end in weights if end <= now]
        if not ready:
            return None
        m, s = min(ready)
        return Action(kind, -s, m)

    if critical is None:
        return next((a for kind in ("I", "F", "W") if (a := first_ready(kind)) is not None), None)
    ready = [a for kind in ("I", "F", "W") if (a := first_ready(kind)) is not None]
    return max(ready, key=lambda a: critical[a.kind, a.stage]) if ready else None  # ties: I, F, W


def zero_bubble_h2(num_stages: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """ZB-H2 from "Zero Bubble Pipeline Parallelism": ZB-H1 with more warm-up forwards.

    Rank ``r`` runs stage ``r`` and may hold ``2S - 1`` microbatches (ZB-H1: ``S``), so its forwards
    fill the wait for the first input gradient and the deferred weight passes fill the end: rank 0
    waits ``(S - 1)(F + I - 2W)`` (for ``M >= 2S - 1`` and ``2W <= F + I``), against ZB-H1's
    ``(S - 1)(F + I - W)`` (``SimulationResult.rank_idle``). ``costs`` (durations by kind or
    ``(kind, stage)``, e.g. measured with ``timeline()``) orders the passes for those durations
    instead of equal ones. Needs ``M >= S``.

    Example:
        >>> from mmnnx.mpmd.schedules import simulate, zero_bubble_h2
        >>> result = simulate(zero_bubble_h2(4, 8), 1, 2)
        >>> result.rank_idle, result.peak_in_flight
        ((0.0, 0.0, 0.0, 0.0), (7, 7, 7, 7))
    """
    check_counts(num_stages, num_microbatches)
    need_enough_microbatches("zero-bubble-h2", num_microbatches, num_stages, "stages")
    limits = [2 * num_stages - 1] * num_stages
    return built_for("zero-bubble-h2", range(num_stages), num_microbatches, limits, costs)


def v_stages(rank: int, num_ranks: int) -> tuple[int, int]:
    """The two stages rank ``rank`` holds in a V: ``rank`` going down, ``2R - 1 - rank`` back up.

    Example:
        >>> from mmnnx.mpmd.schedules.zero_bubble import v_stages
        >>> [v_stages(r, 4) for r in range(4)]
        [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    return rank, 2 * num_ranks - 1 - rank


def _v_stage_to_rank(num_ranks: int) -> list[int]:
    """The rank of each of the ``2R`` stages of a V (see :func:`v_stages`)."""
    return [min(s, 2 * num_ranks - 1 - s) for s in range(2 * num_ranks)]


def zero_bubble_v(num_ranks: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """ZB-V from "Zero Bubble Pipeline Parallelism": ``2R`` stages on ``R`` ranks in a V, rank ``r``
    holding stages ``r`` and ``2R - 1 - r`` (the first and last share rank 0).

    Each rank may hold ``2R`` stage-microbatches, 1F1B's memory. With ``F = I = W = 1`` per stage
    the step takes ``6M + R - 1`` units, against ZB-H1's ``6M + 2(R - 1)``. Place the model with
    ``mm.stage_rules(model, tasks, virtual_stages=2, order="v")``. ``costs``: as for
    :func:`zero_bubble_h2`. Needs ``M >= R``.

    Example:
        >>> from mmnnx.mpmd.schedules import zero_bubble_v
        >>> " ".join(map(str, zero_bubble_v(2, 2).actions_of(1)))
        'F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 I2.1 I1.1 W2.0 W1.0 W2.1 W1.1'
    """
    check_counts(1, num_microbatches, num_ranks)
    need_enough_microbatches("zero-bubble-v", num_microbatches, num_ranks, "ranks")
    stage_to_rank = _v_stage_to_rank(num_ranks)
    limits = [2 * num_ranks] * num_ranks
    return built_for("zero-bubble-v", stage_to_rank, num_microbatches, limits, costs)


def interleaved_zero_bubble(
    num_ranks: int, num_microbatches: int, virtual_stages: int, costs: Costs | None = None
) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B's placement and memory with split backwards, input
    gradients first and the weight passes filling the gaps. ``costs``: as for
    :func:`zero_bubble_h2`. Needs ``M`` a multiple of ``R``.

    Example:
        >>> from mmnnx.mpmd.schedules import interleaved_1f1b, interleaved_zero_bubble, simulate
        >>> zb = simulate(interleaved_zero_bubble(4, 8, 2), 0.5, 1)
        >>> zb.makespan < simulate(interleaved_1f1b(4, 8, 2), 0.5, 1).makespan
        True
    """
    check_interleaved(num_ranks, num_microbatches, virtual_stages)
    need_enough_microbatches(
        "interleaved-zero-bubble", num_microbatches, num_ranks, "ranks (pipeline depth)"
    )
    need_whole_groups("interleaved-zero-bubble", num_microbatches, num_ranks)
    num_stages = num_ranks * virtual_stages
    stage_to_rank = [s % num_ranks for s in range(num_stages)]
    limits = list(_held_peaks(interleaved_1f1b(num_ranks, num_microbatches, virtual_stages), True))
    return built_for("interleaved-zero-bubble", stage_to_rank, num_microbatches, limits, costs)


def dualpipe_v(num_ranks: int, num_microbatches: int, fuse_pairs: bool = False) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe cut in half): the V placement of :func:`zero_bubble_v` run in
    the eight phases of DeepSeek's reference ``dualpipev.py`` (:func:`_dualpipe_v_row`).

    Its main phase runs overlapped pairs, a forward beside a backward of the other chunk. By default
    the runtime dispatches a pair back to back as two programs, so one's transfers run under the
    other's compute; with ``fuse_pairs=True`` they are the schedule's ``overlapped`` pairs, each one
    compiled program (``benchmarks/pipeline.py`` compares the two). Needs ``M >= 2R``.

    Example:
        >>> from mmnnx.mpmd.schedules import dualpipe_v
        >>> " ".join(map(str, dualpipe_v(2, 4).actions_of(1)))  # doctest: +NORMALIZE_WHITESPACE
        'F1.0 F2.0 F1.1 F2.1 F1.2 B2.0 F2.2 B1.0 F1.3 B2.1 F2.3 B1.1 B2.2 B1.2 I2.3 I1.3 W2.3
         W1.3'
    """
    check_counts(1, num_microbatches, num_ranks)
    if num_microbatches < 2 * num_ranks:
        raise ValueError(
            f"dualpipev needs at least twice as many microbatches as ranks ({2 * num_ranks}), "
            f"got {num_microbatches}: use {2 * num_ranks} microbatches or more"
        )
    rows, pairs = zip(
        *(_dualpipe_v_row(rank, num_ranks, num_microbatches) for rank in range(num_ranks)),
        strict=True,
    )
    stage_to_rank = _v_stage_to_rank(num_ranks)
    return validated(
        "dualpipev", num_microbatches, stage_to_rank, rows, pairs if fuse_pairs else ()
    )


def _dualpipe_v_row(
    rank: int, num_ranks: int, num_microbatches: int
) -> tuple[list[Action], list[int]]:
    stages = v_stages(rank, num_ranks)
    next_forward, next_backward = [0, 0], [0, 0]
    weights: list[Action] = []  # deferred W passes, oldest first
    row: list[Action] = []
    pairs: list[int] = []  # positions of overlapped pairs' forwards

    def forward(chunk: int) -> None:
        row.append(Action("F", stages[chunk], next_forward[chunk]))
        next_forward[chunk] += 1

    def backward(chunk: int, split: bool = False) -> None:
        m = next_backward[chunk]
        next_backward[chunk] += 1
        if split:
            row.append(Action("I", stages[chunk], m))
            weights.append(Action("W", stages[chunk], m))
        else:
            row.append(Action("B", stages[chunk], m))

    def weight() -> None:
        row.append(weights.pop(0))

    r, R, M = rank, num_ranks, num_microbatches
    for _ in range(2 * (R - r - 1)):  # 1: chunk-0 forwards
        forward(0)
    for _ in range(r + 1):  # 2: chunk-0 and chunk-1 forwards
        forward(0)
        forward(1)
    for _ in range(R - r - 1):  # 3: chunk-1 backward, split, then its W and a chunk-1 forward
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(M - 2 * R + r + 1):  # 4: the main phase, two overlapped pairs
        if i > 0 or r < R - 1:  # the last rank's first pair runs apart (as DeepSeek's does)
            pairs.append(len(row))
        forward(0)
        backward(1)
        pairs.append(len(row))
        forward(1)
        backward(0)
    for _ in range(R - r - 1):  # 5: a chunk-1 backward, then an overlapped pair
        backward(1)
        pairs.append(len(row))
        forward(1)
        backward(0)
    split = False
    for i in range(r + 1):  # 6: both chunks' backwards, split from the middle on
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(R - r - 1):  # 7: a deferred W, then a split chunk-0 backward
        weight()
        backward(0, split=True)
    while weights:  # 8: the remaining weight passes
        weight()
    return row, pairs
