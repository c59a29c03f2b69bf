"""Colouring: which task runs each op.

An op that reads state placed on task T runs on T. Every other op goes where the fewest bytes move:
a local search over the op graph. It starts from the consumers' tasks (an update joins the state it
writes), then the producers' for what is left, and then moves single ops while that lowers the bytes
crossing tasks on their operands and results (the home task of updated state counts as a consumer).
"""

from __future__ import annotations

from collections.abc import Sequence

from mmnnx.mpmd.errors import PlacementConflictError
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.sharding import Task

_MAX_SWEEPS = 16


def colour(
    graph: Graph,
    input_tasks: Sequence[Task | None],
    input_names: Sequence[str],
    output_homes: Sequence[Task | None],
    tasks: Sequence[Task],
    regions: dict[str, Task] | None = None,
) -> list[Task]:
    """Returns the task of every op in ``graph.ops`` (same order).

    ``regions`` maps the task names of ``mm.task`` regions to their tasks; ops traced inside a
    region (forward or backward) run on its task.
    """
    regions = regions or {}
    placed = {v: t for v, t in zip(graph.inputs, input_tasks, strict=True) if t is not None}
    names = dict(zip(graph.inputs, input_names, strict=True))
    producer = graph.producers()
    consumers = graph.consumers()
    sinks: dict[int, list[Task]] = {}
    for atom, home in zip(graph.outputs, output_homes, strict=True):
        if isinstance(atom, int) and home is not None:
            sinks.setdefault(atom, []).append(home)

    fixed: dict[int, Task] = {}
    for op in graph.ops:
        reads = {}
        for a in op.ins:
            if isinstance(a, int) and a in placed:
                reads.setdefault(placed[a], a)
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

    def cost(op: Op, task: Task) -> int:
        total = 0
        for a in op.ins:
            if isinstance(a, int):
                src = where(a)
                if src is not None and src != task:
                    total += graph.nbytes[a]
        for v in op.outs:
            dests = {assigned[c.index] for c in consumers.get(v, ())}
            dests.update(sinks.get(v, ()))
            total += graph.nbytes[v] * sum(1 for d in dests if d is not None and d != task)
        return total

    # Start from the consumers (updates join the state they write), then from the producers.
    for op in reversed(graph.ops):
        if assigned[op.index] is None:
            weight: dict[Task, int] = {}
            for v in op.outs:
                dests = {assigned[c.index] for c in consumers.get(v, ())}
                dests.update(sinks.get(v, ()))
                for t in dests - {None}:
                    weight[t] = weight.get(t, 0) + graph.nbytes[v] + 1
            if weight:
                assigned[op.index] = max(weight, key=weight.get)
    for op in graph.ops:
        if assigned[op.index] is None:
            weight = {}
            for a in op.ins:
                if isinstance(a, int) and (t := where(a)) is not None:
                    weight[t] = weight.get(t, 0) + graph.nbytes[a] + 1
            if weight:
                assigned[op.index] = max(weight, key=weight.get)

    free = [op for op in graph.ops if op.index not in fixed]
    for _ in range(_MAX_SWEEPS):
        changed = False
        for op in [*reversed(free), *free]:
            current = assigned[op.index]
            best, best_cost = current, cost(op, current) if current is not None else None
            for task in tasks:
                c = cost(op, task)
                if best_cost is None or c < best_cost:
                    best, best_cost = task, c
            if best is not current and (current is None or best_cost < cost(op, current)):
                assigned[op.index] = best
                changed = True
        if not changed:
            break
    return [t if t is not None else tasks[0] for t in assigned]
