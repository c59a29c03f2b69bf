"""Control flow cut into independent pieces, each to run on the task holding its state: a
``cond`` or ``while_loop`` by independent groups of results, a ``scan`` in two (zero-bubble)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.extend import core as jcore

from mmnnx._jax.scan import scan_counts, scan_params
from mmnnx._jax.tracing import ShapedArray, dce_jaxpr, inline_calls, join_effects
from mmnnx.mpmd.ir import Graph, Op, aval_info
from mmnnx.mpmd.op_kinds import COSTLY


def _split_cond(eqn: jcore.JaxprEqn) -> list[tuple[dict, list, list]] | None:
    """A ``cond`` as one cond per independent group of results (each with the predicate and the
    operands its group reads), or ``None``. Results are independent when, in every branch, they
    share no computation but scalar arithmetic and arrays made from scalars alone (the zeros
    JAX 0.11 makes once per shape), which each piece recomputes (as in ``optax.MultiSteps``)."""
    if eqn.effects or len(eqn.outvars) < 2:
        return None
    branches = [inline_calls(b) for b in eqn.params["branches"]]
    n = len(eqn.outvars)
    links: list[tuple[int, int]] = []
    for branch in branches:
        jaxpr = branch.jaxpr
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        owner: dict[int, int] = {}  # id of a shared (non-scalar) equation -> an output using it
        for i, out in enumerate(jaxpr.outvars):
            stack, seen = [out], set()
            while stack:
                v = stack.pop()
                e = None if isinstance(v, jcore.Literal) else producer.get(v)
                if e is None or id(e) in seen:
                    continue
                seen.add(id(e))
                if not _from_scalars(e):
                    links.append((i, owner.setdefault(id(e), i)))
                stack += [v for v in e.invars if not isinstance(v, jcore.Literal)]
    groups = _groups(range(n), links)
    if len(groups) < 2:
        return None
    pieces = []
    for positions in groups:
        used = [i in positions for i in range(n)]
        keep = [False] * (len(eqn.invars) - 1)
        for branch in branches:
            _, reads = dce_jaxpr(branch.jaxpr, used)
            keep = [a or b for a, b in zip(keep, reads, strict=True)]
        new_branches = []
        for branch in branches:
            jaxpr, _ = dce_jaxpr(branch.jaxpr, used, instantiate=keep)
            new_branches.append(jcore.ClosedJaxpr(jaxpr, branch.consts))
        operands = [v for v, k in zip(eqn.invars[1:], keep, strict=True) if k]
        outvars = [eqn.outvars[i] for i in positions]
        pieces.append(({"branches": tuple(new_branches)}, [eqn.invars[0], *operands], outvars))
    return pieces


def _split_while(eqn: jcore.JaxprEqn) -> list[tuple[dict, list, list]] | None:
    """A ``while_loop`` as one loop per independent group of carried values (grouped as by
    :func:`_split_cond`), or ``None``. Scalars computed only from each other (a step counter), which
    must hold all the predicate reads, are carried by every piece."""
    params = eqn.params
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"], params["body_jaxpr"]
    init = eqn.invars[cond_n + body_n :]
    n = len(init)
    if eqn.effects or n < 2:
        return None
    jaxpr = body.jaxpr
    carry_in = jaxpr.invars[body_n:]
    position = {v: i for i, v in enumerate(carry_in)}
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}

    def reads(out) -> tuple[set[int], set[int]]:
        """The carried inputs an output reads, and the ids of non-scalar equations on the way."""
        found, shared, seen, stack = set(), set(), set(), [out]
        while stack:
            v = stack.pop()
            if isinstance(v, jcore.Literal):
                continue
            if v in position:
                found.add(position[v])
                continue
            e = producer.get(v)
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if any(getattr(o.aval, "shape", ()) != () for o in e.outvars):
                shared.add(id(e))
            stack += list(e.invars)
        return found, shared

    deps = [reads(out) for out in jaxpr.outvars]
    scalar = {i for i in range(n) if getattr(carry_in[i].aval, "shape", ()) == ()}
    replicated = set(scalar)
    changed = True
    while changed:  # scalars computed from replicated scalars only
        changed = False
        for i in list(replicated):
            if not deps[i][0] <= replicated or deps[i][1]:
                replicated.discard(i)
                changed = True
    _, cond_used = dce_jaxpr(cond.jaxpr, [True])
    if not {i for i, used in enumerate(cond_used[cond_n:]) if used} <= replicated:
        return None
    others = [i for i in range(n) if i not in replicated]
    owner: dict[int, int] = {}
    links = [(i, j) for i in others for j in deps[i][0] - replicated]
    links += [(i, owner.setdefault(e, i)) for i in others for e in deps[i][1]]
    groups = _groups(others, links)
    if len(groups) < 2:
        return None
    pieces = []
    for members in groups:
        keep = sorted({*members, *replicated})
        carried = [i in keep for i in range(n)]
        _, body_reads = dce_jaxpr(jaxpr, carried)
        body_keep = body_reads[:body_n] + carried
        new_body, _ = dce_jaxpr(jaxpr, carried, instantiate=body_keep)
        cond_keep = cond_used[:cond_n] + carried
        new_cond, _ = dce_jaxpr(cond.jaxpr, [True], instantiate=cond_keep)
        piece = dict(params)
        piece.update(
            cond_jaxpr=jcore.ClosedJaxpr(new_cond, cond.consts),
            body_jaxpr=jcore.ClosedJaxpr(new_body, body.consts),
            cond_nconsts=sum(cond_keep[:cond_n]),
            body_nconsts=sum(body_keep[:body_n]),
        )
        cond_consts = [v for v, k in zip(eqn.invars[:cond_n], cond_keep, strict=False) if k]
        body_consts = [
            v for v, k in zip(eqn.invars[cond_n : cond_n + body_n], body_keep, strict=False) if k
        ]
        operands = [*cond_consts, *body_consts, *(init[i] for i in keep)]
        pieces.append((piece, operands, [eqn.outvars[i] for i in keep]))
    return pieces


def _groups(items: Sequence[int], links: Sequence[tuple[int, int]]) -> list[list[int]]:
    """``items`` grouped by ``links`` (pairs that belong together, transitively), in order."""
    parent = {i: i for i in items}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in links:
        parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for i in items:
        groups.setdefault(root(i), []).append(i)
    return list(groups.values())


def _from_scalars(eqn: jcore.JaxprEqn) -> bool:
    """Whether ``eqn`` makes only scalars, or reads only scalars and literals (a broadcast
    constant): cheap for each piece of a split to recompute."""
    scalar = lambda v: getattr(v.aval, "shape", ()) == ()  # noqa: E731
    return all(map(scalar, eqn.outvars)) or all(map(scalar, eqn.invars))


def split_eqn(eqn: jcore.JaxprEqn) -> list[tuple[dict, list, list]] | None:
    """A ``cond`` or ``while_loop`` equation as independent pieces, each ``(params, invars,
    outvars)`` of one equation of the same primitive; ``None`` if it does not split."""
    split = {"cond": _split_cond, "while": _split_while}.get(eqn.primitive.name)
    return split(eqn) if split is not None else None


def _vars(atoms: Any) -> set:
    """The variables among jaxpr atoms (literals left out)."""
    return {a for a in atoms if isinstance(a, jcore.Var)}


@dataclasses.dataclass
class _ScanCut:
    """A scan's body divided into the part making the results needed now (``first``) and the part
    that can wait (``later``, fed the values it reads from the first, stacked)."""

    first_outs: list[bool]  # per result of the scan: computed by the first part
    first_eqns: list[Any]
    later_eqns: list[Any]
    saved: list[Any]  # body values the later part reads from the first part, one per iteration
    first_operands: list[bool]  # per operand of the scan: read by the first part
    later_operands: list[bool]  # the same for the later part (which also reads ``saved``)


def _scan_cut(op: Op, wanted: Sequence[bool]) -> _ScanCut | None:
    """The cut of scan ``op`` whose first part makes the ``wanted`` results (and the carries they
    depend on); ``None`` when there is none, the op has effects, or the rest holds no contraction
    (cutting elementwise layers saves more operands than the weight pass saves:
    benchmarks/HISTORY.md)."""
    if op.name != "scan" or op.effectful or op.mesh is not None:
        return None
    body = op.params["jaxpr"].jaxpr
    num_consts, num_carry = scan_counts(op.params)
    carry_in = body.invars[num_consts : num_consts + num_carry]
    made_by = {v: i for i, eqn in enumerate(body.eqns) for v in eqn.outvars}

    def closure(roots: Sequence[Any]) -> tuple[set[int], set[Any]]:
        eqns: set[int] = set()
        reads = {v for v in roots if isinstance(v, jcore.Var)}
        stack = list(reads)
        while stack:
            i = made_by.get(stack.pop())
            if i is None or i in eqns:
                continue
            eqns.add(i)
            for a in body.eqns[i].invars:
                if isinstance(a, jcore.Var) and a not in reads:
                    reads.add(a)
                    stack.append(a)
        return eqns, reads

    first = list(wanted)
    while True:  # a carry the first part reads is one the first part must update
        eqns, reads = closure([v for v, w in zip(body.outvars, first, strict=True) if w])
        grow = [j for j in range(num_carry) if not first[j] and carry_in[j] in reads]
        if not grow:
            break
        for j in grow:
            first[j] = True
    if all(first):
        return None
    later_roots = [v for v, w in zip(body.outvars, first, strict=True) if not w]
    later_eqns, _ = closure(later_roots)
    later_eqns -= eqns
    if any(body.eqns[i].effects for i in later_eqns):
        return None
    if not any(body.eqns[i].primitive.name in COSTLY for i in later_eqns):
        return None  # elementwise weight gradients: saving their operands costs more than them
    later_made = {v for i in later_eqns for v in body.eqns[i].outvars}
    later_reads = _vars(a for i in later_eqns for a in body.eqns[i].invars) | _vars(later_roots)
    own = set(body.invars[:num_consts]) | set(body.invars[num_consts + num_carry :])
    own |= {carry_in[j] for j in range(num_carry) if not first[j]} | set(body.constvars)
    saved = [v for v in dict.fromkeys(later_reads) if v not in later_made and v not in own]
    first_reads = _vars(a for i in eqns for a in body.eqns[i].invars) | set(saved)
    first_reads |= _vars(v for v, w in zip(body.outvars, first, strict=True) if w)

    def operands(reads: set, carries: Sequence[bool]) -> list[bool]:
        """Per operand of the scan: whether a part reading ``reads`` and carrying ``carries`` takes
        it."""
        flags = [v in reads for v in body.invars]
        flags[num_consts : num_consts + num_carry] = carries
        return flags

    return _ScanCut(
        first_outs=first,
        first_eqns=[e for i, e in enumerate(body.eqns) if i in eqns],
        later_eqns=[e for i, e in enumerate(body.eqns) if i in later_eqns],
        saved=saved,
        first_operands=operands(first_reads, first[:num_carry]),
        later_operands=operands(later_reads, [not c for c in first[:num_carry]]),
    )


def scan_first_part(op: Op, wanted: Sequence[bool]) -> tuple[list[bool], list[bool]] | None:
    """The results and operands of scan ``op``'s first part (:func:`split_scan`), or ``None``."""
    cut = _scan_cut(op, wanted)
    return None if cut is None else (cut.first_outs, cut.first_operands)


def split_scan(op: Op, wanted: Sequence[bool], graph: Graph) -> tuple[Op, Op] | None:
    """Scan ``op`` as two scans (zero-bubble's split of a backward pass): the first makes the
    ``wanted`` results and saves, per iteration, what the second (weight gradients) reads from it;
    its extra results are new values of ``graph``. ``None`` when the scan does not split."""
    cut = _scan_cut(op, wanted)
    if cut is None:
        return None
    closed = op.params["jaxpr"]
    body = closed.jaxpr
    num_consts, num_carry = scan_counts(op.params)

    length = op.params["length"]
    saved_ids = [
        graph.new_value(aval_info(ShapedArray((length, *v.aval.shape), v.aval.dtype)))
        for v in cut.saved
    ]

    def scan(eqns: list, pick: list, made: list, extra: list, saved: Sequence = ()) -> Op:
        """The scan of ``eqns`` reading the operands ``pick`` flags, then ``saved``, and making
        the results ``made`` flags, then ``extra``."""
        invars = _picked(body.invars, pick) + list(saved)
        outvars = _picked(body.outvars, made) + (cut.saved if extra else [])
        jaxpr = jcore.ClosedJaxpr(_body(body, invars, outvars, eqns), closed.consts)
        ins = _picked(op.ins, pick) + (saved_ids if saved else [])
        outs = _picked(op.outs, made) + extra
        return _rescan(op, jaxpr, ins, outs, sum(pick[:num_consts]), sum(made[:num_carry]))

    later_outs = [not w for w in cut.first_outs]
    first = scan(cut.first_eqns, cut.first_operands, cut.first_outs, saved_ids)
    return first, scan(cut.later_eqns, cut.later_operands, later_outs, [], cut.saved)


def scan_remake(
    op: Op,
    wanted: Sequence[bool],
    readable: Sequence[bool],
    cheap: Callable[[str], bool],
    made: dict | None = None,
) -> Op | None:
    """A scan remaking those of ``op``'s per-iteration results flagged in ``wanted`` that its
    body computes by ``cheap`` primitives from the operands flagged in ``readable`` alone (no
    carry), e.g. the casts of stacked weights; ``None``: none qualifies. ``made``: the bodies made
    so far, shared so that scans of one body stay alike (compiled once)."""
    if op.name != "scan" or op.effectful or op.may_fail or op.mesh is not None:
        return None
    closed = op.params["jaxpr"]
    body = closed.jaxpr
    num_consts, num_carry = scan_counts(op.params)
    made_by = {v: i for i, eqn in enumerate(body.eqns) for v in eqn.outvars}
    allowed = {v for v, ok in zip(body.invars, readable, strict=True) if ok}
    allowed -= set(body.invars[num_consts : num_consts + num_carry])
    allowed |= set(body.constvars)
    picked: list[int] = []
    eqns: set[int] = set()
    for k in range(num_carry, len(op.outs)):
        out = body.outvars[k]
        if not wanted[k] or not isinstance(out, jcore.Var):
            continue
        mine: set[int] = set()
        stack, ok = [out], True
        while stack and ok:
            v = stack.pop()
            i = made_by.get(v)
            if i is None:
                ok = v in allowed
            elif i not in mine:
                eqn = body.eqns[i]
                ok = not eqn.effects and cheap(eqn.primitive.name)
                mine.add(i)
                stack += _vars(eqn.invars)
        if ok:
            picked.append(k)
            eqns |= mine
    if not picked:
        return None
    kept = [e for i, e in enumerate(body.eqns) if i in eqns]
    reads = _vars(a for e in kept for a in e.invars) | _vars(body.outvars[k] for k in picked)
    pick = [v in reads for v in body.invars]
    made = {} if made is None else made
    key = (id(closed), tuple(picked), tuple(pick))
    if key not in made:  # the source kept with it, so that no other body takes its id
        part = _body(body, _picked(body.invars, pick), [body.outvars[k] for k in picked], kept)
        made[key] = (jcore.ClosedJaxpr(part, closed.consts), closed)
    outs = [op.outs[k] for k in picked]
    return _rescan(op, made[key][0], _picked(op.ins, pick), outs, sum(pick[:num_consts]), 0)


def _picked(items: Sequence, flags: Sequence[bool]) -> list:
    return [x for x, f in zip(items, flags, strict=True) if f]


def _body(body: Any, invars: list, outvars: list, eqns: list) -> Any:
    """``body`` with these variables and equations (and their effects)."""
    effects = join_effects(*(e.effects for e in eqns))
    return body.replace(invars=invars, outvars=outvars, eqns=eqns, effects=effects)


def _rescan(op: Op, jaxpr: Any, ins: list, outs: list, num_consts: int, num_carry: int) -> Op:
    """A scan like ``op`` of ``jaxpr`` over ``ins``, making ``outs``."""
    params = scan_params(op.params, jaxpr, num_consts, num_carry, len(ins) - num_consts - num_carry)
    return op.derived(op.primitive, params, ins, outs)
