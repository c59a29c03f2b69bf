"""Colouring: which task runs each op.

An op that reads state placed on task T runs on T; an op in an ``mm.task`` region runs on its
task. Every other op goes where the fewest bytes cross tasks: a start from the producers (heaviest
operand, ties to the operand produced last), then alpha-expansion moves, each an exact min cut
(scipy's maximum_flow) over "switch these ops to task alpha", until no move lowers the bytes.
Updated state pulls its producers home; gradients returned as Variables pull theirs to their
parameter's task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from mmnnx.errors import PlacementConflictError
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.op_kinds import is_view
from mmnnx.sharding import Task

_MAX_ROUNDS = 4
_MAX_CAPACITY = 2**20


@dataclasses.dataclass(frozen=True)
class Colouring:
    """The task of every op of a graph (``op_tasks``, in op order), and ``pinned``, the indices
    of the ops whose task is fixed (they read placed state or sit in a region); the others may
    move."""

    op_tasks: tuple[Task, ...]
    pinned: frozenset[int]


def colour(
    graph: Graph,
    input_tasks: Sequence[Task | None],
    input_names: Sequence[str],
    output_homes: Sequence[Task | None],
    tasks: Sequence[Task],
    regions: dict[str, Task] | None = None,
) -> Colouring:
    """The task of every op in ``graph.ops``.

    ``regions`` maps the task names of ``mm.task`` regions to their tasks; ops traced inside a
    region (forward or backward) run on its task.
    """
    regions = regions or {}
    placed = {v: t for v, t in zip(graph.inputs, input_tasks, strict=True) if t is not None}
    names = dict(zip(graph.inputs, input_names, strict=True))
    producer = graph.producers()
    sinks: dict[int, list[Task]] = {}
    for atom, home in zip(graph.outputs, output_homes, strict=True):
        if isinstance(atom, int) and home is not None:
            sinks.setdefault(atom, []).append(home)

    # A view of placed state (reshaped, broadcast, transposed, cast) still is that state: an op
    # reading it reads the state, so a stage's layer runs where its parameters live.
    state = dict(placed)
    origin = {v: v for v in placed}
    fixed: dict[int, Task] = {}
    for op in graph.ops:
        reads = {}
        for a in op.ins:
            if isinstance(a, int) and a in state:
                reads.setdefault(state[a], origin[a])
        if is_view(op) and len(reads) == 1 and len(op.outs) == 1:
            ((task, source),) = reads.items()
            state[op.outs[0]] = task
            origin[op.outs[0]] = source
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

    # Start from the producers: an op joins its heaviest operand's task; on a tie, the operand
    # produced last (the data that just arrived, as a pipeline passes activations forward and
    # cotangents back).
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
    edges = _edges(graph, producer, placed, sinks)
    free = [op.index for op in graph.ops if op.index not in fixed]
    for _ in range(_MAX_ROUNDS):
        improved = False
        for alpha in tasks:
            improved |= _expand(labels, alpha, free, edges)
        if not improved:
            break
    return Colouring(tuple(labels), frozenset(fixed))


# An edge joins two ops (ints) or an op and a fixed task (a Task): (a, b, bytes).
Edge = tuple[int | Task, int | Task, int]


def _edges(graph: Graph, producer, placed, sinks) -> list[Edge]:
    weights: dict[tuple, int] = {}
    for op in graph.ops:
        for a in op.ins:
            if not isinstance(a, int):
                continue
            src = producer[a].index if a in producer else placed.get(a)
            if src is not None:
                key = (src, op.index)
                weights[key] = weights.get(key, 0) + graph.nbytes[a]
    for v, homes in sinks.items():
        if v in producer:
            for home in homes:
                key = (producer[v].index, home)
                weights[key] = weights.get(key, 0) + graph.nbytes[v]
    return [(a, b, w) for (a, b), w in weights.items() if w > 0]


def _expand(labels: list[Task], alpha: Task, free: list[int], edges: list[Edge]) -> bool:
    """One alpha-expansion move: the cheapest set of free ops to switch to ``alpha`` (min cut).

    Minimises the bytes crossing tasks exactly over all such switches (Boykov, Veksler & Zabih),
    so whole chains move together where single-op moves would stall on ties.
    """
    movable = [op for op in free if labels[op] is not alpha]
    index = {op: i for i, op in enumerate(movable)}
    if not index:
        return False
    n = len(index)
    source, sink = n, n + 1
    to_alpha = np.zeros(n + 2, dtype=np.int64)  # paid when switched (edge source -> p)
    to_keep = np.zeros(n + 2, dtype=np.int64)  # paid when kept (edge p -> sink)
    pairs: dict[tuple[int, int], int] = {}

    def label(x):
        return x if isinstance(x, Task) else labels[x]

    def unary(p: int, keep: int, switch: int):
        to_keep[p] += keep
        to_alpha[p] += switch

    before = 0
    for a, b, w in edges:
        before += w * (label(a) is not label(b))
        ia = index.get(a) if isinstance(a, int) else None
        ib = index.get(b) if isinstance(b, int) else None
        if ia is None and ib is None:
            continue
        if ib is None:
            ia, ib, a, b = ib, ia, b, a  # make b the free end
        lb = label(b)
        if ia is None:
            la = label(a)
            unary(ib, w * (lb is not la), w * (alpha is not la))
            continue
        la = label(a)
        e00, e01, e10 = w * (la is not lb), w * (la is not alpha), w * (alpha is not lb)
        # E = e00 + (e10 - e00) x_a + (0 - e10) x_b + (e01 + e10 - e00) (1 - x_a) x_b
        d = e10 - e00
        unary(ia, 0, d) if d >= 0 else unary(ia, -d, 0)
        unary(ib, e10, 0)
        pairs[(ia, ib)] = pairs.get((ia, ib), 0) + (e01 + e10 - e00)

    scale = max(1, int(max(to_alpha.max(), to_keep.max(), *pairs.values(), 1)) // _MAX_CAPACITY)
    rows, cols, caps = [], [], []
    for p in range(n):
        if to_alpha[p]:
            rows.append(source), cols.append(p), caps.append(to_alpha[p])
        if to_keep[p]:
            rows.append(p), cols.append(sink), caps.append(to_keep[p])
    for (p, q), c in pairs.items():
        if c:
            rows.append(p), cols.append(q), caps.append(c)
    if not rows:
        return False
    caps = np.maximum(1, np.asarray(caps, dtype=np.int64) // scale).astype(np.int32)
    capacity = csr_matrix((caps, (rows, cols)), shape=(n + 2, n + 2))
    flow = maximum_flow(capacity, source, sink).flow
    residual = (capacity - flow).tocsr()
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    reached = set(breadth_first_order(residual, source, directed=True, return_predecessors=False))
    switch = [op for op, i in index.items() if i not in reached]
    if not switch:
        return False
    old = {op: labels[op] for op in switch}
    for op in switch:
        labels[op] = alpha
    after = sum(w * (label(a) is not label(b)) for a, b, w in edges)
    if after >= before:
        for op, t in old.items():
            labels[op] = t
        return False
    return True
