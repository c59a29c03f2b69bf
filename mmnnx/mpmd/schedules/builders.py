"""The schedules built by formula: GPipe, 1F1B, interleaved 1F1B, interleaved GPipe and ZB-H1
(the list-scheduled zero-bubble ones are in ``zero_bubble.py``)."""

from __future__ import annotations

import dataclasses

from mmnnx.mpmd.schedules.ir import Action, Schedule, check_counts, validated


def check_interleaved(num_ranks: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raises a ValueError unless the counts are positive ints and ``virtual_stages >= 1``."""
    check_counts(1, num_microbatches, num_ranks)
    if not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool):
        raise ValueError(f"virtual_stages must be an int, got {virtual_stages!r}")
    if virtual_stages < 1:
        raise ValueError(f"virtual_stages must be >= 1, got {virtual_stages}")


def need_enough_microbatches(name: str, num_microbatches: int, depth: int, what: str) -> None:
    """Raises a ValueError (naming schedule ``name``) unless ``num_microbatches >= depth``."""
    if num_microbatches < depth:
        raise ValueError(
            f"{name} needs at least as many microbatches as {what} ({depth}), got "
            f"{num_microbatches}: use {depth} microbatches or more, or the 'gpipe' schedule"
        )


def need_whole_groups(name: str, num_microbatches: int, num_ranks: int) -> None:
    """Raises a ValueError unless ``num_ranks`` divides ``num_microbatches``."""
    if num_microbatches % num_ranks:
        raise ValueError(
            f"{name} sends microbatches through in groups of num_ranks={num_ranks}: "
            f"num_microbatches must be a multiple of {num_ranks}, got {num_microbatches}"
        )


def _looped_stages(rank: int, num_ranks: int, virtual_stages: int) -> list[int]:
    """The stages rank ``rank`` holds when ``virtual_stages`` loops go round the ranks."""
    return [rank + k * num_ranks for k in range(virtual_stages)]


def _looped(num_ranks: int, virtual_stages: int) -> list[int]:
    """The rank of each stage when ``virtual_stages`` loops go round ``num_ranks`` ranks."""
    return [stage % num_ranks for stage in range(num_ranks * virtual_stages)]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all its forwards, then all its backwards (microbatch order).

    Rank ``r`` runs stage ``r``; every stage holds all M microbatches' activations at once.

    Example:
        >>> from mmnnx.mpmd.schedules import gpipe
        >>> " ".join(map(str, gpipe(3, 2).actions_of(2)))
        'F2.0 F2.1 B2.0 B2.1'
    """
    check_counts(num_stages, num_microbatches)
    rows = [
        [Action("F", stage, m) for m in range(num_microbatches)]
        + [Action("B", stage, m) for m in range(num_microbatches)]
        for stage in range(num_stages)
    ]
    return validated("gpipe", num_microbatches, range(num_stages), rows)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Classic 1F1B (PipeDream-Flush): rank ``r`` runs stage ``r``, ``S - r - 1`` warm-up forwards,
    then one forward / one backward, then the remaining backwards; stage ``r`` holds at most
    ``S - r`` microbatches. Needs ``M >= S``.

    Example:
        >>> from mmnnx.mpmd.schedules import one_f_one_b
        >>> " ".join(map(str, one_f_one_b(3, 4).actions_of(0)))
        'F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3'
    """
    check_counts(num_stages, num_microbatches)
    need_enough_microbatches("1f1b", num_microbatches, num_stages, "stages")
    rows = [
        _warm_then_alternate(
            [Action("F", stage, m) for m in range(num_microbatches)],
            [Action("B", stage, m) for m in range(num_microbatches)],
            num_stages - stage - 1,
        )
        for stage in range(num_stages)
    ]
    return validated("1f1b", num_microbatches, range(num_stages), rows)


def _warm_then_alternate(forwards: list, backwards: list, warmup: int) -> list:
    """``warmup`` forwards (at most all), one forward / one backward, the remaining backwards."""
    warmup = min(warmup, len(forwards))
    steady = [a for pair in zip(forwards[warmup:], backwards, strict=False) for a in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup :]


def interleaved_1f1b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Megatron-style interleaved 1F1B: rank ``r`` holds the ``virtual_stages`` stages ``r``,
    ``r + R``, ``r + 2R``, ... of ``S = R * virtual_stages``.

    Microbatches go through in groups of ``R``: forwards group by group, stages increasing, and
    backwards in the same group order, stages decreasing. Rank ``r`` runs
    ``2(R - r - 1) + (virtual_stages - 1)R`` warm-up forwards, then one forward / one backward, then
    the remaining backwards; ``virtual_stages=1`` is :func:`one_f_one_b`. Needs ``M`` a multiple of
    ``R``. Compare with a plain schedule by dividing per-stage costs by ``virtual_stages`` in
    :func:`simulate`.

    Example:
        >>> from mmnnx.mpmd.schedules import interleaved_1f1b
        >>> schedule = interleaved_1f1b(num_ranks=2, num_microbatches=2, virtual_stages=2)
        >>> " ".join(map(str, schedule.actions_of(1)))
        'F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 B1.0 B1.1'
    """
    check_interleaved(num_ranks, num_microbatches, virtual_stages)
    if virtual_stages == 1:
        plain = one_f_one_b(num_ranks, num_microbatches)
        return dataclasses.replace(plain, name="interleaved-1f1b")
    need_enough_microbatches(
        "interleaved-1f1b", num_microbatches, num_ranks, "ranks (pipeline depth)"
    )
    need_whole_groups("interleaved-1f1b", num_microbatches, num_ranks)
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
        warmup = 2 * (num_ranks - rank - 1) + (virtual_stages - 1) * num_ranks
        rows.append(_warm_then_alternate(forwards, backwards, warmup))
    return validated("interleaved-1f1b", num_microbatches, _looped(num_ranks, virtual_stages), rows)


def interleaved_gpipe(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved GPipe (PyTorch's "looped BFS"): rank ``r`` holds stages ``r``, ``r + R``, ... and
    runs all microbatches' forwards of each stage in turn, then the backwards stage by stage in
    reverse. With unit costs the bubble is ``(R - 1) / (v * M + R - 1)``, GPipe's divided by about
    ``v``; each stage holds all ``M`` microbatches' activations.

    Example:
        >>> from mmnnx.mpmd.schedules import interleaved_gpipe
        >>> schedule = interleaved_gpipe(num_ranks=2, num_microbatches=2, virtual_stages=2)
        >>> " ".join(map(str, schedule.actions_of(1)))
        'F1.0 F1.1 F3.0 F3.1 B3.0 B3.1 B1.0 B1.1'
    """
    check_interleaved(num_ranks, num_microbatches, virtual_stages)
    microbatches = range(num_microbatches)
    rows = []
    for rank in range(num_ranks):
        stages = _looped_stages(rank, num_ranks, virtual_stages)
        rows.append(
            [Action("F", stage, m) for stage in stages for m in microbatches]
            + [Action("B", stage, m) for stage in reversed(stages) for m in microbatches]
        )
    return validated(
        "interleaved-gpipe", num_microbatches, _looped(num_ranks, virtual_stages), rows
    )


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 from "Zero Bubble Pipeline Parallelism" (Qi et al., 2023): the backward split into I
    (input gradient, on the critical path) and W (weight gradient, which nothing waits for).

    Rank ``r`` runs stage ``r`` in the 1F1B pattern with I in place of B and ``W(m)`` right after
    ``I(m + r)``, the deferred weight passes filling the cool-down's bubbles. Every stage holds at
    most ``S`` microbatches, and the bubble shrinks from 1F1B's ``(S-1)(F + B)`` to
    ``(S-1)(F + I - W)``. Needs ``M >= S``.

    Example:
        >>> from mmnnx.mpmd.schedules import zero_bubble_h1
        >>> " ".join(map(str, zero_bubble_h1(2, 3).actions_of(1)))
        'F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 W1.2'
    """
    check_counts(num_stages, num_microbatches)
    need_enough_microbatches("zero-bubble-h1", num_microbatches, num_stages, "stages")
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
    return validated("zero-bubble-h1", num_microbatches, range(num_stages), rows)
