"""The check that several processes meet in one order: :func:`check_same_order`.

Processes wait for each other at a :class:`Route` and at a :class:`Run` on a task spanning
them; meeting at such actions in different orders, they would wait forever. ``localize`` cuts
every share from one global order, so this holds by construction; the check makes a pass that
breaks it fail at planning, naming the two actions, instead of hanging at run time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from mmnnx.errors import MPMDError
from mmnnx.mpmd.lower.localize import processes_of
from mmnnx.mpmd.lower.program import Action, Route, Run, StepProgram
from mmnnx.sharding import Task


def _meeting(
    action: Action, procs: Callable[[Task], frozenset[int]]
) -> tuple[tuple, frozenset[int]] | None:
    """The identity of an action where several processes meet, and those processes; ``None`` for an
    action one process runs alone."""
    if isinstance(action, Route) and action.source is not None:
        return ("route", action.from_slot, action.slot), procs(action.source) | procs(action.target)
    if isinstance(action, Run) and len(procs(action.task)) > 1:
        return ("run", action.fragment.name, action.microbatch), procs(action.task)
    return None


def check_same_order(
    shares: Sequence[StepProgram], processes: Callable[[Task], frozenset[int]] = processes_of
) -> None:
    """Raises :class:`~mmnnx.errors.MPMDError` unless every two processes' shares meet at the
    actions they share in the same order, naming the first two they meet at in different orders.

    Example:
        >>> check_same_order([])  # no process: nothing to check
    """
    procs = functools.cache(processes)
    met: list[dict[int, list[tuple[tuple, Action]]]] = []
    for share in shares:
        with_peer: dict[int, list[tuple[tuple, Action]]] = {}
        for action in share.actions:
            found = _meeting(action, procs)
            if found is not None:
                key, who = found
                for peer in who - {share.process}:
                    with_peer.setdefault(peer, []).append((key, action))
        met.append(with_peer)
    for p, with_peer in enumerate(met):
        for q, mine in with_peer.items():
            if q <= p or q >= len(met):
                continue
            theirs = met[q].get(p, [])
            position = {key: i for i, (key, _) in enumerate(theirs)}
            missing = [a for key, a in mine if key not in position]
            missing += [b for key, b in theirs if key not in {k for k, _ in mine}]
            if missing:
                raise MPMDError(
                    f"mm.jit: processes {p} and {q} would wait for each other: only one of them "
                    f"runs `{missing[0]}`, which needs both"
                )
            for (key_a, a), (key_b, b) in zip(mine, mine[1:], strict=False):
                if position[key_a] > position[key_b]:
                    raise MPMDError(
                        f"mm.jit: processes {p} and {q} would wait for each other: process {p} "
                        f"meets process {q} at `{a}` before `{b}`, process {q} at `{b}` before "
                        f"`{a}`. Every process must run the actions it shares with another in "
                        "one order (a pass reordered them)"
                    )
