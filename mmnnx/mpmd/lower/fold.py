"""Folding: each task's small programs of the step's start made by one program.

Each :class:`~.program.Zeros` (running sums) and :class:`~.program.PackWeights` action is a
program of its own, for a few microseconds of work. The ``fold`` pass joins a task's Zeros
actions into its PackWeights action, or its first Zeros action. (Folding them into the stage
programs would give the first microbatch a program of its own; sums made earlier do not raise
the peak memory, which comes at the first backward.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mmnnx.mpmd.lower.program import Action, PackWeights, StepProgram, Zeros
from mmnnx.sharding import Task


def fold(program: StepProgram) -> StepProgram:
    """``program`` with each task's Zeros actions folded into its PackWeights action, or into
    its first Zeros action where it has none.

    Example:
        >>> import numpy as np
        >>> from mmnnx.sharding import Task, TaskMesh
        >>> t = Task("t", mesh=TaskMesh(devices=[0]))
        >>> z = [Zeros(t, (s,), ((2,),), (np.dtype("float32"),), (None,)) for s in (1, 2)]
        >>> program = StepProgram((t,), tuple(z), (), (), (None,) * 3, {})
        >>> [str(a) for a in fold(program).actions]
        ['zeros s1, s2']
    """
    zeros: dict[Task, list[Zeros]] = {}
    packs: dict[Task, PackWeights] = {}
    for action in program.actions:
        if isinstance(action, Zeros):
            zeros.setdefault(action.task, []).append(action)
        elif isinstance(action, PackWeights):
            packs[action.task] = action
    if all(len(z) < 2 and z[0].task not in packs for z in zeros.values()):
        return program
    actions: list[Action] = []
    for action in program.actions:
        if isinstance(action, Zeros):
            group = zeros[action.task]
            if action is group[0] and action.task not in packs:
                actions.append(_joined(group))
        elif isinstance(action, PackWeights) and action.task in zeros:
            actions.append(dataclasses.replace(action, zeros=_joined(zeros[action.task])))
        else:
            actions.append(action)
    return program.replace(actions=tuple(actions))


def _joined(group: Sequence[Zeros]) -> Zeros:
    """One Zeros action making the sums of all of ``group`` (one task's)."""
    return Zeros(
        task=group[0].task,
        slots=tuple(s for z in group for s in z.slots),
        shapes=tuple(s for z in group for s in z.shapes),
        dtypes=tuple(d for z in group for d in z.dtypes),
        shardings=tuple(s for z in group for s in z.shardings),
    )
