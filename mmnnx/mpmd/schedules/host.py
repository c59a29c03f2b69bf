"""The host that issues a schedule's programs: the order it launches them in, and a schedule played
with launch times and the waits of a host receiving from another process.

Each process's host launches its ranks' programs one after the other, in one order shared by every
process (:func:`dispatch_order`); no program starts before its launch. A value from another process
is received right before its reader's launch, the receiving host waiting for it (``run/runner.py``),
while the sender offers it once it has launched its producer (``run/early_sends.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mmnnx.mpmd.schedules.ir import Action, Schedule, Timed, _dependencies, _key, play, run_program

_UNIT = {"F": 1, "B": 2, "I": 1, "W": 1}


def dispatch_order(schedule: Schedule) -> list[tuple[Action, Action | None]]:
    """The schedule's actions in the order the runner launches them: by start time when every action
    takes unit time (a backward two), ties by rank; an overlapped pair as one entry
    ``(first, second)`` (no action dispatched between its two starts feeds or reads it), else
    ``(action, None)``.

    Example:
        >>> from mmnnx.mpmd.schedules import dispatch_order, one_f_one_b
        >>> [str(first) for first, _ in dispatch_order(one_f_one_b(2, 2))]
        ['F0.0', 'F0.1', 'F1.0', 'B1.0', 'B0.0', 'F1.1', 'B1.1', 'B0.1']
    """
    timed = sorted(play(schedule, lambda a: _UNIT[a.kind]), key=lambda t: (t.start, t.rank))
    second_of = dict(pair for rank in range(schedule.num_ranks) for pair in schedule.pairs_of(rank))
    seconds = set(second_of.values())
    return [(t.action, second_of.get(t.action)) for t in timed if t.action not in seconds]


def play_issued(
    schedule: Schedule,
    duration: Callable[[Action], float],
    pair_duration: Callable[[Action, Action], float | None],
    transfer: Callable[[Action], float],
    launch_cost: float,
    processes: Sequence[int],
) -> list[Timed]:
    """:func:`~mmnnx.mpmd.schedules.ir.play` with hosts (see the module docstring): rank ``r``'s
    programs are launched by process ``processes[r]``'s host in :func:`dispatch_order`, each
    launch taking ``launch_cost``. Raises ValueError when the order runs an action before one
    it reads."""
    rank_of = {a: r for r, row in enumerate(schedule.actions) for a in row}
    present = set(map(_key, rank_of))
    finish: dict[Action, float] = {}
    free = [0] * schedule.num_ranks
    host = dict.fromkeys(processes, 0)
    timed: list[Timed] = []
    for first, second in dispatch_order(schedule):
        actions = [first] if second is None else [first, second]
        rank = rank_of[first]
        me = processes[rank]
        arrivals = []
        for need in (n for a in actions for n in _dependencies(a, schedule.num_stages, present)):
            if need not in finish:
                raise ValueError(f"schedule {schedule.name!r}: {first} runs before {need}")
            if rank_of[need] == rank:
                arrivals.append(finish[need])
                continue
            leaves = max(finish[need], host[me])
            arrived = leaves + transfer(need)
            if processes[rank_of[need]] != me:  # the receiving host waits for it
                host[me] = max(host[me], arrived)
            arrivals.append(arrived)
        host[me] += launch_cost
        start = max([free[rank], host[me], *arrivals])
        timed += run_program(rank, actions, start, duration, pair_duration)
        for action in actions:
            finish[action] = timed[-1].end
        free[rank] = timed[-1].end
    return sorted(timed, key=lambda t: (t.start, t.rank))
