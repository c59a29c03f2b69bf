"""The ``localize`` pass: one process's share of a step whose tasks belong to several processes.

Each process keeps the actions of tasks holding its devices, in the same global order. A
:class:`Send`/:class:`Recv` pair spanning processes becomes a :class:`Route`; a step output held
elsewhere is marked (the runner hands back a placeholder); a layout only the compiler knows is
published by its task's first process (:class:`PublishLayout`) and read by the others
(:class:`AwaitLayout`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from mmnnx.mpmd.lower.program import (
    Action,
    AwaitLayout,
    Constant,
    ConstantOutput,
    Output,
    PackWeights,
    PublishLayout,
    Recv,
    Release,
    Route,
    Run,
    Send,
    StepProgram,
    Zeros,
)
from mmnnx.sharding import Task


def processes_of(task: Task) -> frozenset[int]:
    """The processes whose devices ``task`` runs on.

    Example:
        >>> from mmnnx.sharding import Task, TaskMesh
        >>> processes_of(Task("t", mesh=TaskMesh(devices=[0, 1])))
        frozenset({0})
    """
    return frozenset(d.process_index for d in task.jax_mesh.devices.flat)


def localize(
    program: StepProgram,
    process: int,
    num_processes: int,
    processes: Callable[[Task], frozenset[int]] = processes_of,
) -> StepProgram:
    """The pass: the share of ``program`` that ``process`` (of ``num_processes``) runs.

    ``processes``: the processes of a task's devices (by default read off the devices)."""
    procs = functools.cache(processes)
    layouts = program.shardings
    held = {slot for slot, _ in program.inputs}
    published: set[int] = set()
    awaited: set[int] = set()
    actions: list[Action] = []

    def share_layout(slot: int, task: Task, readers: frozenset[int]) -> None:
        """``readers`` need the layout of ``slot`` (made on ``task``), where only compiling tells
        it."""
        if layouts[slot] is not None:
            return
        makers = procs(task)
        if process == min(makers) and readers - makers and slot not in published:
            published.add(slot)
            actions.append(PublishLayout(slot=slot, task=task))
        if process in readers - makers and slot not in awaited:
            awaited.add(slot)
            actions.append(AwaitLayout(slot=slot, task=task))

    pending: Send | None = None
    sent: set[int] = set()
    for action in program.actions:
        if isinstance(action, Send):
            pending = action
            continue
        if isinstance(action, Recv):
            send, pending = pending, None
            routed = _route(action, send, process, procs)
            if routed is None:
                continue
            if isinstance(routed, Route):
                if routed.sends:
                    sent.add(routed.from_slot)
                if action.source is not None:
                    share_layout(action.from_slot, action.source, procs(action.target))
            if isinstance(routed, Recv) and send is not None:
                actions.append(send)
            actions.append(routed)
            if isinstance(routed, Recv) or routed.receives:
                held.add(action.slot)
        elif isinstance(action, Release):
            continue  # add_releases runs on the local program
        elif process in procs(action.task):
            actions.append(action)
            if isinstance(action, Run):
                held.update(action.results)
            elif isinstance(action, Zeros | PackWeights):
                held.update(action.made)
            elif isinstance(action, Constant):
                held.add(action.slot)
    everyone = frozenset(range(num_processes))
    outputs: list[Output | ConstantOutput] = []
    for output in program.outputs:
        if isinstance(output, Output):
            if output.task is not None:
                share_layout(output.slot, output.task, everyone)
            output = dataclasses.replace(output, here=output.slot in held)
        outputs.append(output)
    actions = [_without_sent_donations(a, sent) if isinstance(a, Run) else a for a in actions]
    return program.replace(actions=tuple(actions), outputs=tuple(outputs), process=process)


def _route(
    recv: Recv, send: Send | None, me: int, procs: Callable[[Task], frozenset[int]]
) -> Recv | Route | None:
    """What ``me`` does for ``recv`` (and its ``send``): nothing, the Recv, or its end of a
    Route."""
    target = procs(recv.target)
    source = frozenset() if recv.source is None else procs(recv.source)
    if me not in source | target:
        return None
    if (recv.source is None and target == {me}) or source == target == {me}:
        return recv
    return Route(
        value=recv.value,
        from_slot=recv.from_slot,
        slot=recv.slot,
        source=recv.source,
        target=recv.target,
        sharding=recv.sharding,
        sends=me in source,
        receives=me in target,
        microbatch=recv.microbatch,
    )


def _without_sent_donations(run: Run, sent: set[int]) -> Run:
    """``run`` not donating values routed to another process (the peer must get them)."""
    donate = tuple(i for i in run.donate if run.ins[i] not in sent)
    return run if donate == run.donate else dataclasses.replace(run, donate=donate)
