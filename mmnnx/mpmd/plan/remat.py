"""Rematerialisation: which residuals a stage's backward recomputes instead of reading, so that the
forward returns fewer arrays and fewer bytes wait between the passes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.plan.cut import Fragment, inputs_of, makers_of
from mmnnx.mpmd.trace.control_flow import scan_remake

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
    """The stage fragments with each forward's cheap residuals (ops in :data:`RECOMPUTED`, within
    :data:`MAX_DEPTH` of available values, read only by that stage's passes) recomputed by the
    backward fragments of its stage that read them, and so the residuals a forward's scan makes from
    the step's inputs alone (:func:`_weight_scans`). ``replicated``: ops every fragment may remake,
    at any depth; ``excluded``: values never recomputed from nor dropped."""
    replicated = set(replicated)
    excluded = set(excluded)
    outside = _read_outside(graph, stages)
    bodies: dict = {}  # the scans' remade bodies, shared by alike stages
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
        read_back = {v for key in backward for v in stages[key].in_ids}
        scans = _weight_scans(graph, forward, read_back - elsewhere, bodies)
        if not remade and not scans:
            continue
        kept -= set(scans)
        producer = {v: op for op in forward.ops for v in op.outs}
        for key in backward:
            remakers = makers_of(stages[key].ops, producer, remade).values()
            frag = _run_first(stages[key], sorted(remakers, key=lambda op: op.index))
            needed = {id(scans[v]): scans[v] for v in frag.in_ids if v in scans}
            out[key] = _run_first(frag, list(needed.values()))
        still_read = {v for key in backward for v in out[key].in_ids} | elsewhere | kept
        held = [v for op in forward.ops for v in op.outs if v in kept]  # in their order
        out_ids = [v for v in (*forward.out_ids, *held) if v in still_read]
        out[(kind, stage)] = dataclasses.replace(forward, out_ids=list(dict.fromkeys(out_ids)))
    return out


def _weight_scans(graph: Graph, forward: Fragment, residuals: set[int], bodies: dict) -> dict:
    """The scans remaking the ``residuals`` each scan of ``forward`` computes per iteration from
    the step's inputs alone (weights, not the microbatch) by :data:`RECOMPUTED` ops, by value
    made; numbered past the graph's ops (and split_backward's scans) by their scan's index.
    ``bodies``: their bodies made so far (``control_flow.scan_remake``'s ``made``)."""
    inputs = set(graph.inputs)
    cheap = RECOMPUTED.__contains__
    scans: dict[int, Op] = {}
    for op in forward.ops:
        wanted = [v in residuals for v in op.outs]
        if op.name != "scan" or not any(wanted):
            continue
        readable = [isinstance(a, int) and a in inputs for a in op.ins]
        remake = scan_remake(op, wanted, readable, cheap, bodies)
        if remake is not None:
            remake.index = 3 * len(graph.ops) + op.index  # split_backward's are below
            scans.update(dict.fromkeys(remake.outs, remake))
    return scans


def _run_first(frag: Fragment, needed: list[Op]) -> Fragment:
    """``frag`` running ``needed`` first, their results no longer read from elsewhere."""
    if not needed:
        return frag
    first = {op.index for op in needed}
    ops = [*needed, *(op for op in frag.ops if op.index not in first)]
    made = {v for op in needed for v in op.outs}
    return dataclasses.replace(
        frag, ops=ops, in_ids=inputs_of(ops), out_ids=[v for v in frag.out_ids if v not in made]
    )


def _read_outside(graph: Graph, stages: dict[tuple[str, int], Fragment]) -> set[int]:
    """Values some op outside the stage fragments reads, or the step returns."""
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
    """The values ``backward`` may remake from ``forward``'s, and the residuals it keeps."""
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
    """The values remade, those kept, and the recomputed ops each available value needs."""
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
    """The values that, kept, would let the backward remake two or more kept residuals."""
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
