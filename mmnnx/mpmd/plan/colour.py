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
from mmnnx.mpmd.step_io import StepInput, StepOutput
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
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    tasks: Sequence[Task],
    regions: dict[str, Task] | None = None,
) -> Colouring:
    """The task of every op in ``graph.ops``, given the step's ``inputs`` and ``outputs`` (one
    record per graph input and output: an input placed on a task pins its readers there, an
    output's task pulls its producers).

    ``regions`` maps the task names of ``mm.task`` regions to their tasks; ops traced inside a
    region (forward or backward) run on its task.
    """
    regions = regions or {}
    placed = {v: i.task for v, i in zip(graph.inputs, inputs, strict=True) if i.task is not None}
    names = {v: i.name for v, i in zip(graph.inputs, inputs, strict=True)}
    producer = graph.producers()
    sinks: dict[int, list[Task]] = {}
    for atom, output in zip(graph.outputs, outputs, strict=True):
        if isinstance(atom, int) and output.task is not None:
            sinks.setdefault(atom, []).append(output.task)

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
    cut = _Cut.of(graph, _edges(graph, producer, placed, sinks), labels, tasks, fixed)
    for _ in range(_MAX_ROUNDS):
        improved = False
        for alpha in range(len(tasks)):
            improved |= cut.expand(alpha)
        if not improved:
            break
    return Colouring(cut.tasks_of_ops(), frozenset(fixed))


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


@dataclasses.dataclass
class _Cut:
    """The edges as arrays over nodes: ops ``0..n-1``, then one node per task (an edge's fixed
    end); ``labels[node]`` is a task's number in ``tasks``."""

    tasks: list[Task]
    labels: np.ndarray  # int64, ops then task nodes (whose labels never change)
    free: np.ndarray  # bool per node: an op whose task may change
    a: np.ndarray
    b: np.ndarray
    w: np.ndarray
    num_ops: int

    @classmethod
    def of(cls, graph: Graph, edges: list[Edge], labels: list[Task], tasks, fixed) -> _Cut:
        known = list(tasks)
        number = {id(t): i for i, t in enumerate(known)}
        for t in [*labels, *(x for e in edges for x in e[:2] if isinstance(x, Task))]:
            if id(t) not in number:
                number[id(t)] = len(known)
                known.append(t)
        n = len(graph.ops)

        def node(x: int | Task) -> int:
            return n + number[id(x)] if isinstance(x, Task) else x

        free = np.zeros(n + len(known), dtype=bool)
        free[[op.index for op in graph.ops if op.index not in fixed]] = True
        return cls(
            tasks=known,
            labels=np.array([number[id(t)] for t in labels] + list(range(len(known))), np.int64),
            free=free,
            a=np.array([node(e[0]) for e in edges], dtype=np.int64),
            b=np.array([node(e[1]) for e in edges], dtype=np.int64),
            w=np.array([e[2] for e in edges], dtype=np.int64),
            num_ops=n,
        )

    def tasks_of_ops(self) -> tuple[Task, ...]:
        return tuple(self.tasks[i] for i in self.labels[: self.num_ops])

    def crossing(self) -> int:
        return int((self.w * (self.labels[self.a] != self.labels[self.b])).sum())

    def expand(self, alpha: int) -> bool:
        """One alpha-expansion move: the cheapest set of free ops to switch to task number
        ``alpha`` (min cut); ``True`` when it lowered the bytes crossing tasks.

        Minimises the bytes crossing tasks exactly over all such switches (Boykov, Veksler &
        Zabih), so whole chains move together where single-op moves would stall on ties.
        """
        labels, a, b, w = self.labels, self.a, self.b, self.w
        movable = self.free & (labels != alpha)
        n = int(movable.sum())
        if not n:
            return False
        index = np.full(len(labels), -1, dtype=np.int64)
        index[movable] = np.arange(n)
        source, sink = n, n + 1
        la, lb = labels[a], labels[b]
        before = int((w * (la != lb)).sum())
        ia, ib = index[a], index[b]
        to_alpha = np.zeros(n + 2, dtype=np.int64)  # paid when switched (edge source -> p)
        to_keep = np.zeros(n + 2, dtype=np.int64)  # paid when kept (edge p -> sink)
        # one free end: its unary costs
        for mine, other, lm, lo in ((ib, ia, lb, la), (ia, ib, la, lb)):
            one = (mine >= 0) & (other < 0)
            np.add.at(to_keep, mine[one], (w * (lm != lo))[one])
            np.add.at(to_alpha, mine[one], (w * (lo != alpha))[one])
        # both free: E = e00 + (e10 - e00) x_a + (0 - e10) x_b + (e01 + e10 - e00) (1 - x_a) x_b
        both = (ia >= 0) & (ib >= 0)
        pa, pb, wb, la2, lb2 = ia[both], ib[both], w[both], la[both], lb[both]
        e00, e01, e10 = wb * (la2 != lb2), wb * (la2 != alpha), wb * (lb2 != alpha)
        d = e10 - e00
        np.add.at(to_alpha, pa, np.maximum(d, 0))
        np.add.at(to_keep, pa, np.maximum(-d, 0))
        np.add.at(to_keep, pb, e10)
        keys, inverse = np.unique(pa * (n + 2) + pb, return_inverse=True)
        pair_caps = np.bincount(inverse, weights=e01 + e10 - e00, minlength=len(keys))
        pair_caps = pair_caps.astype(np.int64)
        nonzero = pair_caps != 0
        keys, pair_caps = keys[nonzero], pair_caps[nonzero]
        largest = max(int(to_alpha.max()), int(to_keep.max()), int(pair_caps.max(initial=0)), 1)
        scale = max(1, largest // _MAX_CAPACITY)
        ops = np.arange(n)
        switch_cost, keep_cost = to_alpha[:n] != 0, to_keep[:n] != 0
        rows = np.concatenate([np.full(switch_cost.sum(), source), ops[keep_cost], keys // (n + 2)])
        cols = np.concatenate([ops[switch_cost], np.full(keep_cost.sum(), sink), keys % (n + 2)])
        caps = np.concatenate([to_alpha[:n][switch_cost], to_keep[:n][keep_cost], pair_caps])
        if not len(rows):
            return False
        caps = np.maximum(1, caps // scale).astype(np.int32)
        capacity = csr_matrix((caps, (rows, cols)), shape=(n + 2, n + 2))
        flow = maximum_flow(capacity, source, sink).flow
        residual = (capacity - flow).tocsr()
        residual.data = (residual.data > 0).astype(np.int8)
        residual.eliminate_zeros()
        reached = np.zeros(n + 2, dtype=bool)
        reached[breadth_first_order(residual, source, directed=True, return_predecessors=False)] = (
            True
        )
        switch = np.flatnonzero(movable)[~reached[:n]]
        if not len(switch):
            return False
        old = labels[switch].copy()
        labels[switch] = alpha
        if self.crossing() >= before:
            labels[switch] = old
            return False
        return True
