"""State that a pipelined ``mm.microbatch`` function updates, traced once.

``mm.microbatch`` traces its function once, for microbatch ``index``, with two kinds of markers
around the Variables it may update (``_jax.py``):

- An RNG count starts microbatch ``index`` at ``count + index * d``, ``d`` being how far one
  microbatch advances it. ``d`` is known once the function is traced: :func:`resolve_rng_counts`
  evaluates the count's arithmetic (one ``+ 1`` per draw) and replaces the markers, so every
  microbatch draws the keys of the unrolled loop, on whichever stage draws them, and the step
  returns ``count + M * d``.
- Other state (batch statistics, a running average) is chained: microbatch 0 starts from the
  Variable's value, microbatch ``k`` from what microbatch ``k - 1`` left, and the step returns
  the last. :func:`chains` pairs the markers; the lowering hands each microbatch's result to the
  next microbatch's program on the same stage.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mmnnx.mpmd import _jax
from mmnnx.mpmd.errors import MPMDError
from mmnnx.mpmd.ir import Const, Graph, Op


def _cone(graph: Graph, start: int, stop: set[int]) -> tuple[list[Op], set[int]] | None:
    """The ops computing ``start`` back to values in ``stop`` (in graph order) and the ``stop``
    values reached; ``None`` if ``start`` also depends on another input."""
    producer = graph.producers()
    seen: dict[int, Op] = {}
    reached: set[int] = set()
    stack = [start]
    while stack:
        v = stack.pop()
        if v in stop:
            reached.add(v)
            continue
        op = producer.get(v)
        if op is None:
            return None
        if op.index not in seen:
            seen[op.index] = op
            stack += [a for a in op.ins if isinstance(a, int)]
    return sorted(seen.values(), key=lambda op: op.index), reached


def resolve_rng_counts(graph: Graph, num_microbatches: dict[int, int]) -> None:
    """Replaces the RNG count markers of ``graph`` (in place) by ``count + index * d`` at each
    microbatch's start and ``count + M * d`` as the step's result.

    Raises:
        MPMDError: a count advances by something other than constants (naming the source line).
    """
    bases = {op.outs[0]: op for op in graph.ops if _jax.marker_kind(op) == "rng_base"}
    if not bases:
        return
    replace: dict[int, list[Op]] = {}
    stride: dict[int, np.ndarray] = {}
    for op in graph.ops:
        if _jax.marker_kind(op) != "rng_next":
            continue
        found = _cone(graph, op.ins[0], set(bases)) if isinstance(op.ins[0], int) else None
        if found is None or len(found[1]) != 1:
            raise MPMDError(
                f"mm.microbatch: an RNG count updated at {op.source} does not advance by a fixed "
                "number of draws per microbatch; draw from nnx.Rngs the same way in every "
                "microbatch"
            )
        ops, (start,) = found
        base = bases[start]
        zero = np.zeros(graph.shapes[start], graph.dtypes[start])
        (after,) = _jax.run_ops(ops, [start], [op.ins[0]], [zero])
        d = np.asarray(after)
        stride[start] = d
        total = d * num_microbatches[op.params["group"]]
        replace[op.index] = [_jax.offset_op(op, base.ins[0], total, graph)]
    for start, base in bases.items():
        d = stride.get(start, np.zeros(graph.shapes[start], graph.dtypes[start]))
        replace[base.index] = _jax.count_ops(base, base.ins[1], d, graph)
    ops: list[Op] = []
    for op in graph.ops:
        ops.extend(replace.get(op.index, [op]))
    for i, op in enumerate(ops):
        op.index = i
    graph.ops = ops
    graph._producers = graph._consumers = None


@dataclasses.dataclass(frozen=True)
class Chains:
    """Chained state of a pipelined step: for each value a microbatch starts from (a
    ``chain_in`` result), the Variable's value before the step and the value one microbatch
    leaves (``None`` if no microbatch changes it); for each chained result of the step (a
    ``chain_out`` result), the value the last microbatch leaves."""

    starts: dict[int, tuple[int, int | None]]
    results: dict[int, int]

    @property
    def marker_values(self) -> set[int]:
        return set(self.starts) | set(self.results)


def chains(graph: Graph) -> Chains:
    """Pairs the chain markers of ``graph``: each ``chain_out`` with the ``chain_in`` its value
    is computed from (the same slot).

    Raises:
        MPMDError: a chained value is computed from another microbatch-start value of its slot,
            or from none.
    """
    starts = {op.outs[0]: op for op in graph.ops if _jax.marker_kind(op) == "chain_in"}
    pairs: dict[int, tuple[int, int | None]] = {v: (op.ins[0], None) for v, op in starts.items()}
    results: dict[int, int] = {}
    for op in graph.ops:
        if _jax.marker_kind(op) != "chain_out":
            continue
        new = op.ins[0]
        same_slot = {v for v, s in starts.items() if s.params["slot"] == op.params["slot"]}
        found = _reach(graph, new, same_slot) if isinstance(new, int) else set()
        if len(found) != 1:
            raise MPMDError(
                f"mm.microbatch: the state updated at {op.source} is not computed from its own "
                "value in the microbatch (each microbatch must start from the previous one's "
                "result); update it from its current value, as BatchNorm does"
            )
        (start,) = found
        pairs[start] = (pairs[start][0], new)
        results[op.outs[0]] = new
    return Chains(pairs, results)


def _reach(graph: Graph, value: int, targets: set[int]) -> set[int]:
    """The ``targets`` that ``value`` depends on."""
    producer = graph.producers()
    seen: set[int] = set()
    found: set[int] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in targets:
            found.add(v)
            continue
        op = producer.get(v)
        if op is not None:
            stack += [a for a in op.ins if isinstance(a, int)]
    return found


def is_marker(op: Op) -> bool:
    """Whether ``op`` is a chain marker (handled by the lowering, never compiled)."""
    return _jax.marker_kind(op) in ("chain_in", "chain_out")


__all__ = ["Chains", "Const", "chains", "is_marker", "resolve_rng_counts"]
