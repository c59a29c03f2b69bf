"""Cutting a coloured graph into per-task fragments; the transfers between them (pure data)."""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import Any

import jax.numpy as jnp

from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.op_kinds import is_cheap, is_slicing
from mmnnx.sharding import Task


@dataclasses.dataclass
class Fragment:
    """A maximal run of one task's ops that can execute as one compiled program."""

    name: str
    task: Task
    ops: list[Op]
    in_ids: list[int]
    out_ids: list[int]
    kinds: tuple[str, ...]

    @property
    def num_eqns(self) -> int:
        return len(self.ops)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A value moved to ``target`` (``sharding``: its layout there, once compiled)."""

    value: int
    source: Task | None
    target: Task
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    sharding: Any = None


def kinds_of(ops: Sequence[Op], after_backward: set[int]) -> tuple[str, ...]:
    kinds = {
        "backward" if op.backward else "update" if op.index in after_backward else "forward"
        for op in ops
    }
    return tuple(k for k in ("forward", "backward", "update") if k in kinds)


def after_backward(graph: Graph) -> frozenset[int]:
    """The non-backward ops that depend on a backward op (updates), cached per list of ops."""
    cached = graph._after_backward
    if cached is not None and cached[0] is graph.ops and cached[1] == len(graph.ops):
        return cached[2]
    tainted: set[int] = set()
    out: set[int] = set()
    for op in graph.ops:
        if op.backward or any(isinstance(a, int) and a in tainted for a in op.ins):
            tainted.update(op.outs)
            if not op.backward:
                out.add(op.index)
    graph._after_backward = (graph.ops, len(graph.ops), frozenset(out))
    return graph._after_backward[2]


def levels(
    graph: Graph, ops: Sequence[Op], op_tasks: Sequence[Task], *, inputs_movable: bool = True
) -> dict[int, int]:
    """Cross-task depth of each op in ``ops`` (values from outside ``ops`` are at depth 0), ops
    that depend on no other task's op moved as late as their consumers allow. With
    ``inputs_movable=False`` only ops that read no value from outside ``ops`` move."""
    inside = {op.index for op in ops}
    producer = {v: op for op in ops for v in op.outs}
    level: dict[int, int] = {}
    for op in ops:
        lv = 0
        for a in op.ins:
            if isinstance(a, int) and a in producer:
                p = producer[a]
                lv = max(lv, level[p.index] + (op_tasks[p.index] != op_tasks[op.index]))
        level[op.index] = lv
    movable: set[int] = set()
    for op in ops:
        task = op_tasks[op.index]
        if all(
            (inputs_movable and a not in producer)
            or (
                a in producer
                and producer[a].index in movable
                and op_tasks[producer[a].index] == task
            )
            for a in op.ins
            if isinstance(a, int)
        ):
            movable.add(op.index)
    last_level: dict[Task, int] = {}
    for op in ops:
        if op.index not in movable:
            task = op_tasks[op.index]
            last_level[task] = max(last_level.get(task, 0), level[op.index])
    consumers = graph.consumers()
    for op in reversed(ops):
        if op.index not in movable:
            continue
        task = op_tasks[op.index]
        bounds = reader_bounds(op, level, op_tasks, consumers, inside)
        latest = min(bounds) if bounds else last_level.get(task, 0)
        level[op.index] = max(level[op.index], latest)
    return level


def reader_bounds(
    op: Op,
    level: dict[int, int],
    op_tasks: Sequence[Task],
    consumers: dict[int, list[Op]],
    inside: set[int],
) -> list[int]:
    """The deepest level each reader of ``op``'s results among ``inside`` allows ``op``."""
    task = op_tasks[op.index]
    return [
        level[c.index] - (op_tasks[c.index] != task)
        for v in op.outs
        for c in consumers.get(v, ())
        if c.index in inside
    ]


def make_fragment(
    graph: Graph,
    name: str,
    task: Task,
    ops: list[Op],
    kinds: tuple[str, ...],
    consumers: dict[int, list[Op]] | None = None,
) -> Fragment:
    """A fragment of ``ops``, its outputs what another op or the step's result reads."""
    inside = {op.index for op in ops}
    consumers = graph.consumers() if consumers is None else consumers
    graph_outputs = {a for a in graph.outputs if isinstance(a, int)}
    in_ids = inputs_of(ops)
    out_ids = [
        v
        for op in ops
        for v in op.outs
        if v in graph_outputs or any(c.index not in inside for c in consumers.get(v, ()))
    ]
    return Fragment(name=name, task=task, ops=ops, in_ids=in_ids, out_ids=out_ids, kinds=kinds)


def inputs_of(ops: Sequence[Op]) -> list[int]:
    """The values ``ops`` read but do not make, in the order first read."""
    produced = {v for op in ops for v in op.outs}
    return list(
        dict.fromkeys(a for op in ops for a in op.ins if isinstance(a, int) and a not in produced)
    )


def replicable_ops(
    graph: Graph,
    ops: Sequence[Op],
    seeds: set[int],
    allowed: set[int],
    *,
    side_inputs: bool = False,
) -> list[Op]:
    """Cheap ops that read at least one ``seeds`` value (or another such op's result) and
    otherwise only ``allowed`` values; their results are not step outputs. With
    ``side_inputs`` (a microbatch region), ops that read no value are seeds too, any op
    :func:`is_cheap` counts is cheap, and results read outside ``ops`` are not recomputed."""
    outputs = {a for a in graph.outputs if isinstance(a, int)}
    inside = {op.index for op in ops}
    consumers = graph.consumers() if side_inputs else {}
    reachable = set(seeds)
    found = []
    for op in ops:
        if op.effectful or op.may_fail or not op.outs:
            continue  # runs exactly once: effects and callbacks are not recomputed (nor dropped)
        sources = [a for a in op.ins if isinstance(a, int)]
        if side_inputs:
            cheap = is_cheap(op) and all(
                c.index in inside for v in op.outs for c in consumers.get(v, ())
            )
            seeded = not sources or any(a in reachable for a in sources)
        else:
            cheap = is_slicing(op) or all(
                graph.shapes[v] == () or not jnp.issubdtype(graph.dtypes[v], jnp.floating)
                for v in op.outs
            )
            seeded = any(a in reachable for a in sources)
        if (
            cheap
            and seeded
            and all(a in reachable or a in allowed for a in sources)
            and not outputs.intersection(op.outs)
        ):
            found.append(op)
            reachable.update(op.outs)
    return found


def with_replicas(
    graph: Graph, name: str, task: Task, ops: list[Op], kinds: tuple[str, ...], replicas: list[Op]
) -> Fragment:
    """A fragment of ``ops`` plus the replicable ops whose results they read (recomputed here)."""
    producer = {v: op for op in replicas for v in op.outs}
    needed = makers_of(ops, producer, producer)
    body = sorted([*ops, *needed.values()], key=lambda op: op.index)
    frag = make_fragment(graph, name, task, body, kinds)
    frag.out_ids = [v for v in frag.out_ids if v not in producer]
    return frag


def makers_of(ops: Sequence[Op], producer: dict[int, Op], wanted: Container[int]) -> dict[int, Op]:
    """The ops of ``producer`` that make the ``wanted`` values ``ops`` read, transitively."""
    needed: dict[int, Op] = {}
    stack = [a for op in ops for a in op.ins if isinstance(a, int) and a in wanted]
    while stack:
        p = producer[stack.pop()]
        if p.index not in needed:
            needed[p.index] = p
            stack += [a for a in p.ins if isinstance(a, int) and a in wanted]
    return needed


def _input_slicing(graph: Graph, ops: list[Op], free: set[int]) -> list[Op]:
    """The ops of ``ops`` that cut free inputs (a batch into inputs and targets), to recompute
    in each fragment that reads them; not for inputs an ``mm.task`` region reads (directly or
    through such ops), nor ops whose result is read outside ``ops``."""
    consumers = graph.consumers()
    candidates = replicable_ops(graph, ops, free, free)
    origin: dict[int, set[int]] = {v: {v} for v in free}
    for op in candidates:
        sources = set().union(*(origin.get(a, set()) for a in op.ins if isinstance(a, int)))
        origin.update((v, sources) for v in op.outs)
    regional = {
        seed
        for v, seeds in origin.items()
        if any(c.region is not None for c in consumers.get(v, ()))
        for seed in seeds
    }
    if regional:
        free = free - regional
        candidates = replicable_ops(graph, ops, free, free)
    inside = {op.index for op in ops}
    return [
        op
        for op in candidates
        if all(c.index in inside for v in op.outs for c in consumers.get(v, ()))
    ]


def cut(
    graph: Graph,
    op_tasks: Sequence[Task],
    tasks: Sequence[Task],
    ops: Sequence[Op] | None = None,
    suffix: str = "",
    free_inputs: set[int] | None = None,
) -> list[Fragment]:
    """Groups ``ops`` (default: all) into fragments by (cross-task depth, task), in order."""
    ops = list(graph.ops if ops is None else ops)
    replicas = _input_slicing(graph, ops, free_inputs or set())
    replica_ids = {op.index for op in replicas}
    ops = [op for op in ops if op.index not in replica_ids]
    level = levels(graph, ops, op_tasks)
    updates = after_backward(graph)
    order = {t: i for i, t in enumerate(tasks)}
    groups: dict[tuple[int, int], list[Op]] = {}
    for op in ops:
        groups.setdefault((level[op.index], order[op_tasks[op.index]]), []).append(op)
    fragments = []
    counts: dict[Task, int] = {}
    for key in sorted(groups):
        task = tasks[key[1]]
        k = counts[task] = counts.get(task, -1) + 1
        group = groups[key]
        name = f"{task.name}#{suffix}{k}"
        fragments.append(
            with_replicas(graph, name, task, group, kinds_of(group, updates), replicas)
        )
    return fragments
