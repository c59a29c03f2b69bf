"""Which task runs each op of a pipelined region that reads no placed state: the task its latest
operand comes from, depths counted over the ops whose task is fixed, so the stages form a chain."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.plan.cut import after_backward
from mmnnx.mpmd.plan.stage_levels import forward_levels
from mmnnx.sharding import Task


def follow_the_flow(
    graph: Graph, region: list[Op], op_tasks: Sequence[Task], pinned: AbstractSet[int]
) -> list[Task]:
    """``op_tasks``, ops reading no placed state moved onto the stage their data comes from."""
    moved = list(op_tasks)
    updates = after_backward(graph)
    movable = [op for op in region if op.index not in pinned and op.index not in updates]
    forward = [op for op in region if not op.backward and op.index not in updates]
    _forward_flow(graph, forward, movable, moved, pinned)
    _backward_flow(graph, region, movable, moved)
    return moved


def _forward_flow(
    graph: Graph,
    forward: list[Op],
    movable: list[Op],
    op_tasks: list[Task],
    pinned: AbstractSet[int],
) -> None:
    """Moves each movable forward op to its latest operand's task where that is visited later."""
    depths = pinned_depths(graph, forward, op_tasks, pinned)
    start = min(depths.first, key=depths.first.get, default=None)
    for op in movable:
        if op.backward:
            continue
        sources = depths.sources_of(op)
        if not sources:
            if op_tasks[op.index] not in depths.first and start is not None:
                op_tasks[op.index] = start
            continue
        deepest = max(sources.values())
        task = op_tasks[op.index]
        if sources.get(task) == deepest or depths.first.get(task, deepest) >= deepest:
            continue
        op_tasks[op.index] = max(
            (t for t, d in sources.items() if d == deepest), key=lambda t: depths.first.get(t, 0)
        )


def _backward_flow(graph: Graph, region: list[Op], movable: list[Op], op_tasks: list[Task]) -> None:
    """A backward op joins the input on the earliest stage (where each task holds one stage)."""
    producer = {v: op for op in region for v in op.outs}
    updates = after_backward(graph)
    level, late = forward_levels(graph, region, op_tasks)
    stage: dict[Task, set[int]] = {}
    for op in region:
        if not op.backward and op.index not in updates and op.index not in late:
            stage.setdefault(op_tasks[op.index], set()).add(level[op.index])
    if any(len(levels_) != 1 for levels_ in stage.values()):
        return
    stage_of = {task: min(levels_) for task, levels_ in stage.items()}
    inside = {op.index for op in region}
    consumers = graph.consumers()

    def readers_bound(op: Op) -> Task | None:
        readers = [
            op_tasks[c.index]
            for v in op.outs
            for c in consumers.get(v, ())
            if c.index in inside and c.backward and op_tasks[c.index] in stage_of
        ]
        return max(readers, key=stage_of.get) if readers else None

    for op in reversed(movable):
        bound = readers_bound(op) if op.backward and op_tasks[op.index] in stage_of else None
        if bound is not None and stage_of[bound] > stage_of[op_tasks[op.index]]:
            op_tasks[op.index] = bound
    for op in movable:
        inputs = [
            producer[a]
            for a in op.ins
            if isinstance(a, int) and a in producer and producer[a].backward
        ]
        if not op.backward or not inputs or op_tasks[op.index] not in stage_of:
            continue
        tasks = [op_tasks[p.index] for p in inputs if op_tasks[p.index] in stage_of]
        if tasks:
            latest = min(tasks, key=stage_of.get)
            if stage_of[latest] < stage_of[op_tasks[op.index]]:
                bound = readers_bound(op)  # never before a stage whose backward reads it
                if bound is None or stage_of[latest] >= stage_of[bound]:
                    op_tasks[op.index] = latest


@dataclasses.dataclass(frozen=True)
class PinnedDepths:
    """Per value, each pinned task it comes from and its depth; per task, its first visit."""

    sources: dict[int, dict[Task, int]]
    first: dict[Task, int]

    def sources_of(self, op: Op) -> dict[Task, int]:
        return _merged(self.sources.get(a, {}) for a in op.ins if isinstance(a, int))


def _merged(maps: Iterable[dict[Task, int]], pick=max) -> dict[Task, int]:
    """The union of ``maps``, a task in several keeping the ``pick`` of its depths."""
    out: dict[Task, int] = {}
    for m in maps:
        for task, depth in m.items():
            out[task] = pick(out[task], depth) if task in out else depth
    return out


def pinned_depths(
    graph: Graph, forward: Sequence[Op], op_tasks: Sequence[Task], pinned: AbstractSet[int]
) -> PinnedDepths:
    """The :class:`PinnedDepths` of ``forward``. A pinned op with no source on another task moves as
    deep as the pinned ops its result reaches allow (reaching none, it marks no visit)."""
    inside = {op.index for op in forward}
    depth: dict[int, int] = {}
    crossed: set[int] = set()  # pinned ops with a source on another task

    def propagate() -> dict[int, dict[Task, int]]:
        sources: dict[int, dict[Task, int]] = {}
        for op in forward:
            merged = _merged(sources.get(a, {}) for a in op.ins if isinstance(a, int))
            if op.index in pinned:
                task = op_tasks[op.index]
                if any(t != task for t in merged):
                    crossed.add(op.index)
                d = max((d + (t != task) for t, d in merged.items()), default=0)
                depth[op.index] = max(depth.get(op.index, 0), d)
                merged = {task: depth[op.index]}
            for v in op.outs:
                sources[v] = merged
        return sources

    propagate()
    consumers = graph.consumers()
    reaches: dict[int, dict[Task, int]] = {}
    anchored = set(crossed)  # the pinned ops that mark a visit of their task
    for op in reversed(forward):
        reached = _merged(
            (
                ({op_tasks[c.index]: depth[c.index]} if c.index in pinned else reaches[c.index])
                for v in op.outs
                for c in consumers.get(v, ())
                if c.index in inside
            ),
            pick=min,
        )
        if op.index not in pinned:
            reaches[op.index] = reached
        elif reached:
            anchored.add(op.index)
            if op.index not in crossed:
                task = op_tasks[op.index]
                bound = min(d - (t != task) for t, d in reached.items())
                depth[op.index] = max(depth[op.index], bound)
    sources = propagate()
    first: dict[Task, int] = {}
    for index in anchored:
        task = op_tasks[index]
        first[task] = min(first.get(task, depth[index]), depth[index])
    return PinnedDepths(sources, first)
