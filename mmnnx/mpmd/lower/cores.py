"""Sharing stage programs: an edge stage's fragment cut into the core the middle stages run
and the rest (``share_cores``, on unless ``mm.jit(share_cores=False)``).

XLA shares no kernel between programs, and the first and last stages' programs (embedding,
head, loss) differ from the middle stages' alike ones, so each compiles its own copy of the
blocks' kernels. ``share_cores`` finds, inside such a fragment, the ops of a smaller fragment
of the same pass, and cuts it into the part before that *core*, the core (which reuses the
middle stages' program) and the part after: up to three launches per microbatch.

The core is matched op by op in the smaller fragment's order (:func:`_match`). No cut is made
where the core would not be alike the smaller fragment, in a fragment run as half of an
overlapped pair, nor in a backward whose forward is alike no other. Ops recomputed in every
fragment that reads them are recomputed in each part; what one part passes the next is never
packed. Cutting moves no op between passes: the planner splits an edge stage's block ops as a
middle stage's (:func:`~mmnnx.mpmd.plan.stage_levels.join_consumers`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence

from mmnnx.mpmd.ir import Graph, Op, live_ops
from mmnnx.mpmd.lower.alike import AlikeKeys, live_view, op_key
from mmnnx.mpmd.plan.cut import Fragment, after_backward, kinds_of
from mmnnx.mpmd.plan.pipeline import Pipeline
from mmnnx.mpmd.primitives import is_constraint

_MAX_RETRIES = 256  # other fits tried before a fragment is taken to hold no core


def share_cores(graph: Graph, pipeline: Pipeline) -> Pipeline:
    """``pipeline`` with each stage fragment (and update after the loop) holding the ops of a
    smaller one of the same pass cut into parts around that core; ``parts`` names their stages."""
    fused = {id(pipeline.order[i + k][0]) for i in pipeline.fused for k in (0, 1)}
    keys = _OpKeys(graph)
    alike = AlikeKeys(graph)
    seen = collections.Counter(
        op.index for frag in {id(f): f for f, _ in pipeline.order}.values() for op in frag.ops
    )
    replicas = {index for index, count in seen.items() if count > 1}  # ops recomputed by several
    label_of = {id(f): (f.task.name, kind, stage) for (kind, stage), f in pipeline.stages.items()}
    groups: dict[Hashable, list[Fragment]] = {}
    for (kind, _), frag in pipeline.stages.items():
        groups.setdefault((kind, frag.task.jax_mesh.devices.shape), []).append(frag)
    for frag in pipeline.post:
        groups.setdefault(("post", frag.task.jax_mesh.devices.shape), []).append(frag)
    cut: dict[int, list[Fragment]] = {}
    shared: set[int] = set()  # fragments alike another, as a whole or by their core
    for group in groups.values():
        references: list[Fragment] = []
        for frag in sorted(group, key=lambda f: len(keys.live(f)[0])):
            tries = (_cut(graph, frag, r, keys, alike, replicas) for r in references)
            parts = None if id(frag) in fused else next((p for p in tries if p is not None), None)
            if parts is None:
                references.append(frag)
                continue
            shared.add(id(frag))
            if len(parts) > 1:
                cut[id(frag)] = parts
    for (kind, stage), frag in pipeline.stages.items():
        if kind != "F" and id(pipeline.stages.get(("F", stage))) not in shared:
            cut.pop(id(frag), None)  # its core would read residuals laid out as no other's
    if not cut:
        return pipeline
    order, new_fused = [], set()
    for position, (frag, m) in enumerate(pipeline.order):
        if position in pipeline.fused:
            new_fused.add(len(order))
        order += [(part, m) for part in cut.get(id(frag), (frag,))]
    parts = {
        id(part): (*label_of[whole], k)
        for whole, made in cut.items()
        if whole in label_of
        for k, part in enumerate(made)
    }
    return dataclasses.replace(
        pipeline, order=order, fused=frozenset(new_fused), parts={**pipeline.parts, **parts}
    )


class _OpKeys:
    """Each op's :func:`op_key` and each fragment's :func:`live_view`, made once."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._keys: dict[int, Hashable | None] = {}
        self._live: dict[int, tuple[Fragment, tuple[list[Op], dict[int, int]]]] = {}

    def live(self, frag: Fragment) -> tuple[list[Op], dict[int, int]]:
        """``live_view(frag)``."""
        known = self._live.get(id(frag))
        if known is None:
            known = self._live[id(frag)] = (frag, live_view(frag))
        return known[1]

    def __call__(self, op: Op) -> Hashable | None:
        key = self._keys.get(id(op), self)
        if key is self:
            key = self._keys[id(op)] = op_key(op, self.graph)
        return key


def _cut(
    graph: Graph,
    frag: Fragment,
    reference: Fragment,
    keys: _OpKeys,
    alike: AlikeKeys,
    replicas: set[int],
) -> list[Fragment] | None:
    """``frag`` cut into parts in their order, the core alike ``reference``: ``[frag]`` if it is
    alike as a whole; ``None`` if it holds no such core or cannot be cut around it."""
    whole = alike.fragment(frag)
    if whole is not None and whole == alike.fragment(reference):
        return [frag]
    match = _match(frag, reference, keys)
    if match is None:
        return None
    ops, values = match
    core = Fragment(
        name=f"{frag.name}.core",
        task=frag.task,
        ops=ops,
        in_ids=[values[v] for v in reference.in_ids],
        out_ids=[values[v] for v in reference.out_ids],
        kinds=reference.kinds,
    )
    core = _with_constraints(frag, _reading_constraints(frag, core))
    made = {v for op in core.ops for v in op.outs} | set(core.in_ids)
    if not made.issuperset(core.out_ids):  # returns an input it now reads through a constraint
        return None
    return _around(graph, frag, core, replicas)


def _reading_constraints(frag: Fragment, core: Fragment) -> Fragment:
    """``core`` (on one device) reading, for an input that a constraint of ``frag`` outside it
    reads, that constraint's result, which the rest reads too (a first stage's tokens)."""
    if core.task.jax_mesh.size != 1:
        return core
    inside = {id(op) for op in core.ops}
    result: dict[int, int] = {}
    for op in frag.ops:
        if is_constraint(op) and id(op) not in inside and type(op.ins[0]) is int:
            result.setdefault(op.ins[0], op.outs[0])
    renamed = {v: result[v] for v in core.in_ids if v in result and v not in frag.in_ids}
    if not renamed:
        return core
    ops = [
        op
        if not any(type(a) is int and a in renamed for a in op.ins)
        else dataclasses.replace(
            op, ins=[renamed.get(a, a) if type(a) is int else a for a in op.ins]
        )
        for op in core.ops
    ]
    in_ids = [renamed.get(v, v) for v in core.in_ids]
    return dataclasses.replace(core, ops=ops, in_ids=in_ids)


def _with_constraints(frag: Fragment, core: Fragment) -> Fragment:
    """``core`` (on one device) returning, for a result only a chain of constraints of ``frag``
    reads, the chain's last result, made in the core."""
    if core.task.jax_mesh.size != 1:
        return core
    readers: dict[int, list[Op]] = {}
    for op in frag.ops:
        for a in op.ins:
            if type(a) is int:
                readers.setdefault(a, []).append(op)
    outs, added = list(core.out_ids), []
    for k, v in enumerate(outs):
        while v not in frag.out_ids and len(read := readers.get(v, [])) == 1:
            if not is_constraint(read[0]):
                break
            v = outs[k] = read[0].outs[0]
            added.append(read[0])
    if not added:
        return core
    after: dict[int, list[Op]] = {}  # each right after its operand is made (inputs: first)
    for op in added:
        after.setdefault(op.ins[0], []).append(op)
    ops: list[Op] = []
    stack = [*reversed(core.ops), *reversed([c for v in core.in_ids for c in after.get(v, ())])]
    while stack:
        op = stack.pop()
        ops.append(op)
        stack += reversed([c for v in op.outs for c in after.get(v, ())])
    return dataclasses.replace(core, ops=ops, out_ids=outs)


def _match(frag: Fragment, reference: Fragment, keys: _OpKeys) -> tuple[list[Op], dict] | None:
    """The ops of ``frag`` matching ``reference``'s live ones in its order, and the image of
    each of ``reference``'s values. Where several ops fit, the first after the last op matched
    is taken, the others tried (later matches undone) when a later op then fits none."""
    wanted, seen_as = keys.live(reference)
    live, stands_for = keys.live(frag)
    need = collections.Counter(keys(op) for op in wanted)
    if None in need:
        return None
    candidates: dict[Hashable, list[Op]] = {}
    for op in live:
        key = keys(op)
        if key in need:
            candidates.setdefault(key, []).append(op)
    if any(len(candidates.get(k, ())) < n for k, n in need.items()):
        return None
    match = _Match(set(reference.in_ids), stands_for)
    at = {id(op): k for k, op in enumerate(live)}
    readers: dict[tuple[Hashable, int, int], list[Op]] = {}  # by (key, position, value read)
    for key, ops in candidates.items():
        for op in ops:
            for position, y in enumerate(op.ins):
                if type(y) is int:
                    readers.setdefault((key, position, stands_for.get(y, y)), []).append(op)
    ops: list[Op] = []
    where: list[int] = []  # the place in ``live`` of each op matched
    choices: list[tuple[int, list[Op], _Match]] = []  # (position, untried fits, match before)
    retries, i = 0, 0
    while i < len(wanted):
        r = wanted[i]
        ins = [seen_as.get(x, x) if type(x) is int else x for x in r.ins]
        last = where[-1] if where else -1
        fits = [a for a in _pool(r, ins, match, candidates, readers, keys) if match.fits(ins, a)]
        fits.sort(key=lambda a: (at[id(a)] < last, at[id(a)]))
        while not fits:
            if not choices or retries == _MAX_RETRIES:
                return None
            retries += 1
            i, fits, before = choices.pop()
            match, r = before.copy(), wanted[i]
            ins = [seen_as.get(x, x) if type(x) is int else x for x in r.ins]
            del ops[i:], where[i:]
        if len(fits) > 1:
            choices.append((i, fits[1:], match.copy()))
        ops.append(match.take(ins, r.outs, fits[0]))
        where.append(at[id(fits[0])])
        i += 1
    values = match.values
    for v, alias in seen_as.items():
        if alias in values:
            values[v] = values[alias]
    if any(v not in values for v in (*reference.in_ids, *reference.out_ids)):
        return None
    return ops, values


def _pool(
    r: Op,
    ins: Sequence,
    match: _Match,
    candidates: dict[Hashable, list[Op]],
    readers: dict[tuple[Hashable, int, int], list[Op]],
    keys: _OpKeys,
) -> list[Op]:
    """The candidates for reference op ``r`` reading ``ins``: those reading the image of its
    first operand already matched, else every candidate of its key."""
    key = keys(r)
    for position, x in enumerate(ins):
        if type(x) is int and x in match.values:
            return readers.get((key, position, match.values[x]), [])
    return candidates[key]


class _Match:
    """The images of a reference's values in a larger fragment, one for one, as its ops are
    matched; ``stands_for``: the larger fragment's constraints read as their operands."""

    def __init__(self, inputs: set[int], stands_for: dict[int, int]):
        self.inputs = inputs
        self.stands_for = stands_for
        self.values: dict[int, int] = {}  # reference value -> image
        self.images: set[int] = set()
        self.made: set[int] = set()  # images made by matched ops
        self.taken: set[int] = set()

    def copy(self) -> _Match:
        other = _Match(self.inputs, self.stands_for)
        other.values, other.images = dict(self.values), set(self.images)
        other.made, other.taken = set(self.made), set(self.taken)
        return other

    def fits(self, ins: Sequence, a: Op) -> bool:
        """Whether op ``a`` can stand for a reference op reading ``ins``: matched operands read
        their images, new reference inputs values not yet images nor made by matched ops."""
        if id(a) in self.taken or any(y in self.images for y in a.outs):
            return False
        fresh: dict[int, int] = {}
        for x, y in zip(ins, a.ins, strict=True):
            if type(x) is not int:
                continue
            if type(y) is not int:
                return False
            y = self.stands_for.get(y, y)
            if x in self.values:
                if self.values[x] != y:
                    return False
            elif (
                x not in self.inputs
                or y in self.images
                or y in self.made
                or fresh.setdefault(x, y) != y
                or y in (v for k, v in fresh.items() if k != x)
            ):
                return False
        return True

    def take(self, ins: Sequence, outs: Sequence[int], a: Op) -> Op:
        """Maps the reference op to ``a``; returns ``a`` reading what its constraints stand for."""
        self.taken.add(id(a))
        read = [self.stands_for.get(y, y) if type(y) is int else y for y in a.ins]
        for x, y in zip(ins, read, strict=True):
            if type(x) is int and x not in self.values:
                self.values[x] = y
                self.images.add(y)
        for x, y in zip(outs, a.outs, strict=True):
            self.values[x] = y
            self.images.add(y)
            self.made.add(y)
        return a if read == list(a.ins) else dataclasses.replace(a, ins=read)


def _around(
    graph: Graph, frag: Fragment, core: Fragment, replicas: set[int]
) -> list[Fragment] | None:
    """The parts of ``frag`` around ``core``: the ops it needs before and after; ``None`` if the
    core keeps a value others read, or a part would read what it makes."""
    core_ids = {id(op) for op in core.ops}
    core_indices = {op.index for op in core.ops}
    core_made = {v for op in core.ops for v in op.outs}
    core_out = set(core.out_ids)
    outside = [op for op in frag.ops if id(op) not in core_ids and op.index not in core_indices]
    rest = live_ops(outside, [*frag.out_ids, *core.in_ids])
    made_by = {v: op for op in (*core.ops, *rest) for v in op.outs}
    for op in rest:
        for a in op.ins:
            inside = type(a) is int and a in core_made and a not in core_out
            if inside and made_by[a].index not in replicas:
                return None
    if any(v in core_made and v not in core_out for v in frag.out_ids):
        return None
    rest_ids = {id(op) for op in rest}
    before = _upstream(core.in_ids, made_by, lambda op: id(op) in rest_ids)
    first = [op for op in rest if id(op) in before]
    last = [op for op in rest if id(op) not in before]
    parts = [
        _part(graph, frag, f"{frag.name}.before", first, made_by, replicas),
        core,
        _part(graph, frag, f"{frag.name}.after", last, made_by, replicas),
    ]
    parts = [p for p in parts if p.ops]
    read_later: set[int] = set(frag.out_ids)
    for k in range(len(parts) - 1, -1, -1):  # each but the core returns what later ones read
        part = parts[k]
        if part is not core:
            recomputed = {v for p in parts if p is not part for op in p.ops for v in op.outs}
            made = [v for op in part.ops for v in op.outs]
            outs = [v for v in made if v in read_later and v not in recomputed]
            part = parts[k] = dataclasses.replace(part, out_ids=outs)
        read_later.update(part.in_ids)
    ready = set(frag.in_ids)
    for part in parts:  # each reads what the step has or an earlier part made
        if any(v not in ready for v in part.in_ids):
            return None
        ready.update(part.out_ids)
    return parts if all(v in ready for v in frag.out_ids) else None


def _part(
    graph: Graph,
    frag: Fragment,
    name: str,
    ops: Sequence[Op],
    made_by: dict[int, Op],
    replicas: set[int],
) -> Fragment:
    """A part of ``frag`` of ``ops``, with the ``replicas`` they read; no outputs yet."""
    operands = [a for op in ops for a in op.ins]
    mine = {id(op) for op in ops} | _upstream(operands, made_by, lambda op: op.index in replicas)
    body = [op for op in frag.ops if id(op) in mine]
    made = {v for op in body for v in op.outs}
    in_ids = list(
        dict.fromkeys(a for op in body for a in op.ins if type(a) is int and a not in made)
    )
    kinds = kinds_of(body, after_backward(graph)) if body else frag.kinds
    return Fragment(name=name, task=frag.task, ops=body, in_ids=in_ids, out_ids=[], kinds=kinds)


def _upstream(values: Iterable, made_by: dict[int, Op], keep: Callable[[Op], bool]) -> set[int]:
    """The ids of the ops ``keep`` accepts that make ``values``, and their operands in turn."""
    found: set[int] = set()
    stack = [made_by[v] for v in values if type(v) is int and v in made_by and keep(made_by[v])]
    while stack:
        op = stack.pop()
        if id(op) not in found:
            found.add(id(op))
            stack += [
                made_by[a] for a in op.ins if type(a) is int and a in made_by and keep(made_by[a])
            ]
    return found
