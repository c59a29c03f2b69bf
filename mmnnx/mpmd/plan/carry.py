"""The microbatch carry: state a pipelined ``mm.microbatch`` function updates, traced once. An RNG
count starts microbatch ``index`` at ``count + index * d`` (:func:`resolve_rng_counts`); other state
is chained, microbatch ``k`` starting from what ``k - 1`` left (:func:`carry_of`)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from mmnnx.errors import MPMDError
from mmnnx.mpmd.evaluate import pruned_to, run_ops
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.primitives import count_ops, marker_kind, offset_op
from mmnnx.mpmd.trace.tracing import drop_dead_ops


def _upstream(
    graph: Graph, start: int, stop: set[int], prune: bool = False
) -> tuple[list[Op], set[int], bool]:
    """Walking back from ``start`` to values in ``stop``: the ops on the way (in graph order),
    the ``stop`` values reached, and whether no other input of the step was reached.
    ``prune``: an op with several results is returned computing only the results on the way."""
    producer = graph.producers()
    ops: dict[tuple[int, int], Op] = {}
    seen: set[int] = set()
    reached: set[int] = set()
    closed = True
    stack = [start]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in stop:
            reached.add(v)
            continue
        op = producer.get(v)
        if op is None:
            closed = False
            continue
        if prune and len(op.outs) > 1:
            op = pruned_to(op, v, graph) or op
        ops[op.index, op.outs[0] if len(op.outs) == 1 else -1] = op
        stack += [a for a in op.ins if isinstance(a, int)]
    return sorted(ops.values(), key=lambda op: op.index), reached, closed


def resolve_rng_counts(graph: Graph, num_microbatches: dict[int, int]) -> None:
    """Replaces the RNG count markers of ``graph`` (in place) by ``count + index * d`` at each
    microbatch's start and ``count + M * d`` as the step's result; an ``MPMDError`` names the source
    line of a count advancing by something other than constants."""
    bases = {op.outs[0]: op for op in graph.ops if marker_kind(op) == "rng_base"}
    if not bases:
        return
    replace: dict[int, list[Op]] = {}
    stride: dict[int, np.ndarray] = {}
    for op in graph.ops:
        if marker_kind(op) != "rng_next":
            continue
        advance, reached, closed = (
            _upstream(graph, op.ins[0], set(bases), prune=True)
            if isinstance(op.ins[0], int)
            else ([], set(), False)
        )
        if not closed or len(reached) != 1:
            raise MPMDError(
                f"mm.microbatch: an RNG count updated at {op.source} does not advance by a fixed "
                "number of draws per microbatch; draw from nnx.Rngs the same way in every "
                "microbatch"
            )
        (start,) = reached
        zero = np.zeros(graph.shapes[start], graph.dtypes[start])
        (after,) = run_ops(advance, [start], [op.ins[0]], [zero])
        stride[start] = d = np.asarray(after)
        total = d * num_microbatches[op.params["group"]]
        replace[op.index] = [offset_op(op, bases[start].ins[0], total, graph)]
    for start, base in bases.items():
        d = stride.get(start, np.zeros(graph.shapes[start], graph.dtypes[start]))
        replace[base.index] = count_ops(base, base.ins[1], d, graph)
    graph.ops = [new for op in graph.ops for new in replace.get(op.index, [op])]
    drop_dead_ops(graph)  # a count nothing reads after the step (a forked nnx.Rngs)
    graph._producers = graph._consumers = None


@dataclasses.dataclass(frozen=True)
class Carry:
    """``starts``: each ``chain_in`` result -> the Variable's value before the step and the value
    one microbatch leaves (``None`` if none changes it); ``results``: each ``chain_out`` result
    -> the value the last microbatch leaves."""

    starts: dict[int, tuple[int, int | None]]
    results: dict[int, int]

    @functools.cached_property
    def marker_values(self) -> frozenset[int]:
        """The values that stand for another (read by the lowering for every fragment input)."""
        return frozenset(self.starts) | frozenset(self.results)


def carry_of(graph: Graph) -> Carry:
    """The carry of ``graph``, each ``chain_out`` paired with its slot's ``chain_in``."""
    starts = {op.outs[0]: op for op in graph.ops if marker_kind(op) == "chain_in"}
    pairs: dict[int, tuple[int, int | None]] = {v: (op.ins[0], None) for v, op in starts.items()}
    by_slot: dict[int, set[int]] = {}
    for v, op in starts.items():
        by_slot.setdefault(op.params["slot"], set()).add(v)
    results: dict[int, int] = {}
    for op in graph.ops:
        if marker_kind(op) != "chain_out":
            continue
        new = op.ins[0]
        same_slot = by_slot.get(op.params["slot"], set())
        found = _upstream(graph, new, same_slot)[1] if isinstance(new, int) else set()
        if len(found) != 1:
            raise MPMDError(
                f"mm.microbatch: the state updated at {op.source} is not computed from its own "
                "value in the microbatch (each microbatch must start from the previous one's "
                "result); update it from its current value, as BatchNorm does"
            )
        (start,) = found
        pairs[start] = (pairs[start][0], new)
        results[op.outs[0]] = new
    return Carry(pairs, results)


def is_marker(op: Op) -> bool:
    """Whether ``op`` is a chain marker (handled by the lowering, never compiled)."""
    return marker_kind(op) in ("chain_in", "chain_out")
