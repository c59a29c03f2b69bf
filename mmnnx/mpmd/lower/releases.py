"""The ``add_releases`` pass: a :class:`Release` after each value's last reader, run last, on
the program as it will run (packed, localized).
"""

from __future__ import annotations

from collections.abc import Sequence

from mmnnx.mpmd.lower.program import (
    Action,
    Constant,
    Output,
    PackWeights,
    Recv,
    Release,
    Route,
    Run,
    StepProgram,
    Zeros,
)
from mmnnx.sharding import Task


def reads_writes(action: Action) -> tuple[Sequence[int], Sequence[int]]:
    """The slots ``action`` reads and writes when it runs.

    Example:
        >>> from mmnnx.sharding import Task, TaskMesh
        >>> reads_writes(Constant(3, Task("t", mesh=TaskMesh(devices=[0])), 0))
        ((), (3,))
    """
    if isinstance(action, Run):
        return action.args, action.results
    if isinstance(action, Recv):
        return (action.from_slot,), (action.slot,)
    if isinstance(action, Route):
        reads = (action.from_slot,) if action.sends or action.source is None else ()
        return reads, (action.slot,) if action.receives else ()
    if isinstance(action, Constant):
        return (), (action.slot,)
    if isinstance(action, Zeros | PackWeights):
        return action.members, action.made
    return (), ()


def add_releases(program: StepProgram) -> StepProgram:
    """``program`` with a :class:`Release` after each value's last reader (the step's inputs and
    outputs kept; a value never read dropped at once; nothing between an overlapped pair's runs)."""
    keep = {o.slot for o in program.outputs if isinstance(o, Output) and o.slot is not None}
    keep.update(slot for slot, _ in program.inputs)
    actions = [a for a in program.actions if not isinstance(a, Release)]
    last: dict[int, int] = {}
    task_of: dict[int, Task | None] = {}
    for i, action in enumerate(actions):
        at = i + 1 if isinstance(action, Run) and action.fused else i
        reads, writes = reads_writes(action)
        writer = action.target if isinstance(action, Recv | Route) else action.task
        for s in writes:
            last.setdefault(s, at)
            task_of.setdefault(s, writer)
        for s in reads:
            last[s] = max(last.get(s, at), at)
    after: dict[int, dict[Task | None, list[int]]] = {}
    for s, i in sorted(last.items()):
        if s not in keep:
            after.setdefault(i, {}).setdefault(task_of.get(s), []).append(s)
    out: list[Action] = []
    for i, action in enumerate(actions):
        out.append(action)
        for task, slots in after.get(i, {}).items():
            out.append(Release(task=task, slots=tuple(slots)))
    return program.replace(actions=tuple(out))
