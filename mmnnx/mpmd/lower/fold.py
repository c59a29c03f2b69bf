"""Folding: each task's small programs of the step's start made by one program.

A task's running sums start at zero (:class:`~.program.Zeros`, one action before the first run
adding to each group of them) and its block weights are packed at the step's start
(:class:`~.program.PackWeights`). Each such action is a program of its own to lower, compile
and launch, for a few microseconds of work. The ``fold`` pass gives a task one: its Zeros
actions join its PackWeights action, or, on a task that packs no weights, its first Zeros
action. (Folding them into the stage programs instead would give the first microbatch's
program a variant of its own: a second compile of the stage's kernels.) Sums made earlier in
the step hold no more memory at its peak: that comes at the first backward, after every
warm-up forward, when they are already made.
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
