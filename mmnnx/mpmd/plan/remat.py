"""Rematerialisation: which residuals a stage's backward recomputes instead of reading.

A stage's forward returns every value its backward reads: 56 arrays per microbatch for a
2-block GPT stage, a third of them arithmetic on the others (``2 * x``, ``x * rsqrt``, a norm's
broadcast scale, the pieces of a GELU). Each returned array costs the host a few microseconds
per launch and holds memory until the backward runs. Here the backward fragments of each stage
recompute such residuals from those they keep, fused into their own kernels, so the forward
returns fewer arrays and fewer bytes wait between the passes; a value they would remake two
or more residuals from is kept in their place (a first stage's embedded tokens, from which its
backward then remakes what a middle stage's remakes from its input). A pure pass over
fragments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.plan.cut import Fragment

_ARITHMETIC = ("add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "square")
_MORE_ARITHMETIC = ("integer_pow", "select_n", "copy", "copy_p", "iota")
_LOGIC = ("eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not")
_LAYOUT = ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims")
_MORE_LAYOUT = ("slice", "concatenate", "mm_sharding_constraint")
RECOMPUTED = frozenset((*_ARITHMETIC, *_MORE_ARITHMETIC, *_LOGIC, *_LAYOUT, *_MORE_LAYOUT))
"""Primitives a backward recomputes: arithmetic and layout ops that fuse into its kernels.
Transcendentals (``exp``, ``tanh``, ``rsqrt``), reductions and contractions are kept."""

MAX_DEPTH = 3
"""The longest chain of recomputed ops behind one dropped residual."""


def recompute_residuals(
    graph: Graph,
    stages: dict[tuple[str, int], Fragment],
    replicated: Iterable[int] = (),
    excluded: Iterable[int] = (),
) -> dict[tuple[str, int], Fragment]:
    """The stage fragments with each forward's cheap residuals recomputed by the backward
    fragments of its stage (``B``, ``I``, ``W``) that read them.

    A residual is recomputed when its op is in :data:`RECOMPUTED`, every value it reads is
    available to the backward (kept, a forward input, or itself recomputable) within
    :data:`MAX_DEPTH` ops, and nothing but that stage's passes reads it; a value the forward
    makes that two or more such residuals would be remade from, no larger than they are
    together, is kept. ``replicated``: ops
    every fragment may remake (side inputs: masks, positions), recomputed at any depth;
    ``excluded``: values never recomputed from nor dropped (chained state).

    Example:
        >>> recompute_residuals(Graph(), {})
        {}
    """
    replicated = set(replicated)
    excluded = set(excluded)
    outside = _read_outside(graph, stages)
    out = dict(stages)
    for (kind, stage), forward in stages.items():
        if kind != "F":
            continue
        backward = [k for k in stages if k[1] == stage and k[0] in ("B", "I", "W")]
        if not backward:
            continue
        elsewhere = outside | excluded
        for key, frag in stages.items():
            if key != (kind, stage) and key not in backward:
                elsewhere.update(frag.in_ids)
        remade, kept = _recomputable(
            graph, forward, [stages[k] for k in backward], replicated, excluded, elsewhere
        )
        if not remade:
            continue
        producer = {v: op for op in forward.ops for v in op.outs}
        for key in backward:
            out[key] = _recomputing(stages[key], remade, producer)
        still_read = {v for key in backward for v in out[key].in_ids} | elsewhere | kept
        held = [v for op in forward.ops for v in op.outs if v in kept]  # in their order
        out_ids = [v for v in (*forward.out_ids, *held) if v in still_read]
        out[(kind, stage)] = dataclasses.replace(forward, out_ids=list(dict.fromkeys(out_ids)))
    return out


def _read_outside(graph: Graph, stages: dict[tuple[str, int], Fragment]) -> set[int]:
    """Values some op outside the stage fragments reads (a microbatch sum, a marker), or the step
    returns."""
    staged = {op.index for frag in stages.values() for op in frag.ops}
    read = {a for a in graph.outputs if isinstance(a, int)}
    for op in graph.ops:
        if op.index not in staged:
            read.update(a for a in op.ins if isinstance(a, int))
    return read


def _recomputable(
    graph: Graph,
    forward: Fragment,
    backward: list[Fragment],
    replicated: set[int],
    excluded: set[int],
    elsewhere: set[int],
) -> tuple[set[int], set[int]]:
    """The values of ``forward`` its ``backward`` fragments may remake, and the residuals they
    read as they are: those they read, and a value they do not read but would remake two or
    more residuals from, no larger than them together (a first stage's embedded tokens, from
    which its backward remakes a norm's ``2 * x`` and ``x - mean``, as a middle stage's remakes
    them from its input)."""
    read_back = {v for frag in backward for v in frag.in_ids}
    held: set[int] = set()
    while True:
        remade, kept, depth = _walk(forward, read_back | held, replicated, excluded, elsewhere)
        more = _operands_to_hold(graph, forward, kept, depth, excluded, elsewhere) - held
        if not more:
            return remade, kept
        held |= more


def _walk(
    forward: Fragment,
    read_back: set[int],
    replicated: set[int],
    excluded: set[int],
    elsewhere: set[int],
) -> tuple[set[int], set[int], dict[int, int]]:
    """The values remade, those kept, and the number of recomputed ops each available value
    needs (0: available as it is), walking ``forward`` in order; ``read_back``: the values the
    backward reads."""
    returned = set(forward.out_ids)
    depth: dict[int, int] = {v: 0 for v in forward.in_ids if v not in excluded}
    remade: set[int] = set()
    kept: set[int] = set()
    for op in forward.ops:
        ins = [a for a in op.ins if isinstance(a, int)]
        known = [depth[a] for a in ins if a in depth]
        reach = None
        if len(known) == len(ins) and not op.effectful and not op.may_fail:
            if op.index in replicated:
                reach = 0
            elif op.name in RECOMPUTED:
                reach = 1 + max(known, default=0)
        for v in op.outs:
            if v in excluded:
                continue
            if reach is not None and reach <= MAX_DEPTH and v not in elsewhere:
                depth[v] = reach
                remade.add(v)
            elif v in read_back or v in returned:
                depth[v] = 0  # returned by the forward anyway
                if v in read_back:
                    kept.add(v)
    return remade, kept, depth


def _operands_to_hold(
    graph: Graph,
    forward: Fragment,
    kept: set[int],
    depth: dict[int, int],
    excluded: set[int],
    elsewhere: set[int],
) -> set[int]:
    """The values of ``forward`` not available to the backward that, kept, would let it remake
    two or more kept residuals (each made by one recomputed op reading it and values available),
    no larger than those together."""
    saves: dict[int, list[int]] = {}
    for op in forward.ops:
        ins = [a for a in op.ins if isinstance(a, int)]
        missing = {a for a in ins if a not in depth}
        residuals = [v for v in op.outs if v in kept and v not in elsewhere]
        if (
            len(missing) != 1
            or not residuals
            or op.name not in RECOMPUTED
            or op.effectful
            or op.may_fail
            or max((depth[a] for a in ins if a in depth), default=0) >= MAX_DEPTH
        ):
            continue
        (operand,) = missing
        if operand not in excluded:
            saves.setdefault(operand, []).extend(residuals)
    return {
        v
        for v, residuals in saves.items()
        if len(residuals) >= 2 and graph.nbytes[v] <= sum(graph.nbytes[r] for r in residuals)
    }


def _recomputing(frag: Fragment, remade: set[int], producer: dict[int, Op]) -> Fragment:
    """``frag`` with the forward ops that remake the ``remade`` values it reads put first (a side
    input it made itself moves up with them)."""
    needed: dict[int, Op] = {}
    stack = [a for op in frag.ops for a in op.ins if isinstance(a, int) and a in remade]
    while stack:
        op = producer[stack.pop()]
        if op.index not in needed:
            needed[op.index] = op
            stack += [a for a in op.ins if isinstance(a, int) and a in remade]
    if not needed:
        return frag
    ops = [
        *sorted(needed.values(), key=lambda op: op.index),
        *(op for op in frag.ops if op.index not in needed),
    ]
    made = {v for op in needed.values() for v in op.outs}
    produced = {v for op in ops for v in op.outs}
    in_ids: list[int] = []
    for op in ops:
        for a in op.ins:
            if isinstance(a, int) and a not in produced and a not in in_ids:
                in_ids.append(a)
    return dataclasses.replace(
        frag, ops=ops, in_ids=in_ids, out_ids=[v for v in frag.out_ids if v not in made]
    )
