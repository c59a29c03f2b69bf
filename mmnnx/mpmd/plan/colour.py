"""Colouring: which task runs each op: the task of the placed state it reads or of its ``mm.task``
region, else where the fewest bytes cross tasks (``net_cut.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mmnnx.errors import PlacementConflictError
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.op_kinds import is_view
from mmnnx.mpmd.plan.net_cut import Net, NetCut
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task

_MAX_ROUNDS = 4


@dataclasses.dataclass(frozen=True)
class Colouring:
    """The task of every op of a graph, and ``pinned``, the ops whose task is fixed."""

    op_tasks: tuple[Task, ...]
    pinned: frozenset[int]


def colour(
    graph: Graph,
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    tasks: Sequence[Task],
    regions: dict[str, Task] | None = None,
) -> Colouring:
    """The task of every op, given one record per graph input and output and the regions."""
    regions = regions or {}
    placed = {v: i.task for v, i in zip(graph.inputs, inputs, strict=True) if i.task is not None}
    names = {v: i.name for v, i in zip(graph.inputs, inputs, strict=True)}
    producer = graph.producers()
    sinks: dict[int, list[Task]] = {}
    for atom, output in zip(graph.outputs, outputs, strict=True):
        if isinstance(atom, int) and output.task is not None:
            sinks.setdefault(atom, []).append(output.task)

    origin = state_origins(graph, placed)
    fixed: dict[int, Task] = {}
    for op in graph.ops:
        reads = placed_reads(op, origin, placed)
        if len(reads) > 1:
            (t1, v1), (t2, v2) = list(reads.items())[:2]
            raise PlacementConflictError(
                f"`{op.name}` at {op.source} reads {names[v1]} (placed on task {t1.name!r}) and "
                f"{names[v2]} (placed on task {t2.name!r}) at once; place both on one task, or "
                "compute with a copy of one of them on the other task"
            )
        region = regions.get(op.region) if op.region is not None else None
        if region is not None:
            for t, v in reads.items():
                if t != region:
                    raise PlacementConflictError(
                        f"`{op.name}` at {op.source} runs in mm.task region {region.name!r} but "
                        f"reads {names[v]}, which is placed on task {t.name!r}; place it on "
                        f"{region.name!r} or move the op out of the region"
                    )
            fixed[op.index] = region
        elif reads:
            fixed[op.index] = next(iter(reads))

    assigned: list[Task | None] = [fixed.get(op.index) for op in graph.ops]

    def where(v: int) -> Task | None:
        p = producer.get(v)
        return placed.get(v) if p is None else assigned[p.index]

    # Start: an op joins its heaviest operand's task; on a tie, the operand produced last
    for op in graph.ops:
        if assigned[op.index] is None:
            weight: dict[Task, tuple[int, int]] = {}
            for a in op.ins:
                if isinstance(a, int) and (t := where(a)) is not None:
                    p = producer.get(a)
                    size, recent = weight.get(t, (0, -1))
                    weight[t] = (size + graph.nbytes[a], max(recent, p.index if p else -1))
            if weight:
                assigned[op.index] = max(weight, key=weight.get)

    labels = [t if t is not None else tasks[0] for t in assigned]
    cut = NetCut.of(tasks, _nets(graph, producer, placed, sinks), labels, fixed)
    for _ in range(_MAX_ROUNDS):
        improved = False
        for alpha in range(len(tasks)):
            improved |= cut.expand(alpha)
        if not improved:
            break
    return Colouring(cut.tasks_of_ops(), frozenset(fixed))


def state_origins(graph: Graph, placed: dict[int, Task]) -> dict[int, int]:
    """Each value that is placed state, or a view of it (reshaped, broadcast, transposed, cast:
    still that state), -> the placed input it shows."""
    origin = {v: v for v in placed}
    for op in graph.ops:
        reads = placed_reads(op, origin, placed)
        if is_view(op) and len(reads) == 1 and len(op.outs) == 1:
            origin[op.outs[0]] = next(iter(reads.values()))
    return origin


def placed_reads(op: Op, origin: dict[int, int], placed: dict[int, Task]) -> dict[Task, int]:
    """The tasks whose placed state ``op`` reads (by :func:`state_origins`), each -> the first
    placed input it reads there."""
    reads: dict[Task, int] = {}
    for a in op.ins:
        if isinstance(a, int) and a in origin:
            reads.setdefault(placed[origin[a]], origin[a])
    return reads


def _nets(
    graph: Graph,
    producer: dict[int, Op],
    placed: dict[int, Task],
    sinks: dict[int, list[Task]],
) -> list[Net]:
    """One net per value made by an op or placed on a task."""
    readers: dict[int, dict[int | Task, None]] = {}
    for op in graph.ops:
        for a in op.ins:
            if isinstance(a, int) and (a in producer or a in placed):
                readers.setdefault(a, {})[op.index] = None
    for v, homes in sinks.items():
        if v in producer:
            readers.setdefault(v, {}).update(dict.fromkeys(homes))
    return [
        Net(producer[v].index if v in producer else placed[v], tuple(ends), graph.nbytes[v])
        for v, ends in readers.items()
        if graph.nbytes[v] > 0
    ]
