"""Stacked layers split over tasks: a traced step rewritten so that each task runs its chunk of a
:class:`~mmnnx.sharding.TaskStack` Variable (a scan becomes one scan per chunk, elementwise ops and
views run chunk by chunk, a reduction combines per-chunk partials)."""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from mmnnx._jax.scan import scan_counts
from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Atom, Const, Graph, Op
from mmnnx.mpmd.plan import stack_rules
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task
from mmnnx.sharding.specs import itemsize
from mmnnx.sharding.stack import TaskStack

StackHome = tuple[TaskStack, PartitionSpec]
"""A stacked value's tasks and the PartitionSpec of each chunk on its task."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    stack: TaskStack
    bounds: tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Expansion:
    """How a step's inputs and outputs map to those of its rewritten graph: a stacked one (not
    ``None``) becomes one per task of its stack. The chunks of each joined result are kept while
    it lives, so the next step takes them instead of cutting it again."""

    inputs: list[StackHome | None]
    outputs: list[StackHome | None]
    _joined: dict[int, tuple[weakref.ref, list]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    def expand_inputs(self, items: Sequence[Any], chunk: Any) -> list[Any]:
        """``items`` with each stacked input's item replaced by one ``chunk(...)`` per task."""
        return _expand(items, self.inputs, chunk)

    def expand_outputs(self, items: Sequence[Any], chunk: Any) -> list[Any]:
        """As :meth:`expand_inputs`, for the outputs."""
        return _expand(items, self.outputs, chunk)

    def split_leaves(self, leaves: Sequence[Any]) -> list[Any]:
        """The step's input arrays with each stacked one cut into its chunks (no copies)."""
        out: list[Any] = []
        for leaf, home in zip(leaves, self.inputs, strict=True):
            if home is None:
                out.append(leaf)
                continue
            known = self._joined.get(id(leaf))
            if known is not None and known[0]() is leaf:
                out.extend(known[1])
            else:
                out.extend(home[0].split(leaf, home[1]))
        return out

    def join_results(self, results: Sequence[Any]) -> list[Any]:
        """The rewritten graph's results with each stacked output's chunks joined again."""
        out: list[Any] = []
        i = 0
        for home in self.outputs:
            k = 1 if home is None else len(home[0].tasks)
            chunks = list(results[i : i + k])
            out.append(chunks[0] if home is None else home[0].join(chunks, home[1]))
            if home is not None:
                self._remember(out[-1], chunks)
            i += k
        return out

    def _remember(self, joined: Any, chunks: list) -> None:
        """Keeps ``joined``'s ``chunks`` until ``joined`` is garbage."""
        key = id(joined)

        def forget(_: weakref.ref) -> None:
            entry = self._joined.get(key)
            if entry is not None and entry[0]() is None:
                del self._joined[key]

        self._joined[key] = (weakref.ref(joined, forget), chunks)


def _expand(items: Sequence[Any], homes: Sequence[StackHome | None], chunk: Any) -> list[Any]:
    out: list[Any] = []
    for item, home in zip(items, homes, strict=True):
        if home is None:
            out.append(item)
        else:
            out.extend(chunk(item, t, j, home) for j, t in enumerate(home[0].tasks))
    return out


def chunk_sharding(_item: Any, task: Task, _index: int, home: StackHome) -> Any:
    """A stacked value's chunk layout on ``task`` (for :meth:`Expansion.expand_inputs`)."""
    return task.sharding(home[1])


# What the slices of a stacked step result are made "like" (no op of the step makes them).
_OUTPUT = Op(
    index=-1,
    primitive=None,
    params={},
    ins=[],
    outs=[],
    multiple_results=False,
    source="<stacked output>",
    name="",
)


class _Rewriter:
    def __init__(self, graph: Graph, names: Sequence[str]):
        self.old = graph
        self.new = Graph()
        self.names = dict(zip(graph.inputs, names, strict=True))
        self.whole: dict[int, Atom] = {}
        self.split: dict[int, tuple[_Layout, list[Atom]]] = {}
        self.origin: dict[int, str] = {}  # split value -> the stacked input it comes from
        self.pieces: dict[tuple[int, int, int], Atom] = {}
        self.computed: set[int] = set()  # split values computed per layer (a scan's outputs)

    def info(self, v: int, size: int | None = None) -> tuple:
        """Shape, dtype and bytes of the step's value ``v``, or of a chunk of ``size`` of it."""
        shape = self.old.shapes[v] if size is None else (size, *self.old.shapes[v][1:])
        dtype = self.old.dtypes[v]
        return tuple(shape), dtype, math.prod(shape) * itemsize(dtype)

    def emit(self, like: Op | None, primitive: Any, params: dict, ins: list, infos: list) -> list:
        outs = [self.new.new_value(i) for i in infos]
        like = like or _OUTPUT
        op = like.derived(primitive, params, ins, outs)
        op.index = len(self.new.ops)
        self.new.ops.append(op)
        return outs

    def read(self, a: Atom, op: Op) -> Atom:
        if isinstance(a, Const):
            return a
        if a in self.split:
            raise self.refuse(op, a)
        return self.whole[a]

    def shape(self, a: Atom) -> tuple:
        return tuple(np.shape(a.value)) if isinstance(a, Const) else self.old.shapes[a]

    def piece(self, a: Atom, layout: _Layout, j: int, like: Op | None) -> Atom:
        """Chunk ``j`` of operand ``a`` along the leading axis (sliced if ``a`` is whole)."""
        start, stop = layout.bounds[j]
        if isinstance(a, Const):
            return Const(np.asarray(a.value)[start:stop])
        if a in self.split:
            return self.split[a][1][j]
        key = (a, start, stop)
        if key not in self.pieces:
            shape = self.old.shapes[a]
            info = self.info(a, stop - start)
            made = self.old.producers().get(a)
            if made is not None and stack_rules.is_constant_broadcast(made):
                # a constant filled over the layers: made at the chunk's size where it is read
                params = stack_rules.chunk_params(made, stop - start)
                (self.pieces[key],) = self.emit(made, made.primitive, params, made.ins, [info])
            else:
                primitive, params = stack_rules.slice_leading(shape, start, stop)
                (self.pieces[key],) = self.emit(like, primitive, params, [self.whole[a]], [info])
        return self.pieces[key]

    def refuse(self, op: Op, a: int) -> MPMDError:
        return MPMDError(
            f"`{op.name}` at {op.source} needs the whole of a value computed from the stacked "
            f"Variable {self.origin.get(a, '?')!r}, whose layers are split over tasks; over the "
            "layer axis mm.jit splits scans, elementwise ops, views that keep it first, "
            "reductions and batched matmuls, and joins what a scan computed per layer, not the "
            "Variable's own layers. Keep other ops inside the scan's body, or place the Variable "
            "on one task"
        )

    def joined(self, a: int, op: Op) -> Atom:
        """The whole of split value ``a``, its chunks concatenated, if a scan computed it (a
        per-layer result, such as a sown metric; never a Variable's layers)."""
        if a not in self.computed:
            raise self.refuse(op, a)
        if a not in self.whole:
            chunks = self.split[a][1]
            (self.whole[a],) = self.emit(
                op, jax.lax.concatenate_p, {"dimension": 0}, chunks, [self.info(a)]
            )
        return self.whole[a]

    def emit_whole(self, op: Op, ins: list[Atom]) -> None:
        outs = self.emit(op, op.primitive, op.params, ins, [self.info(v) for v in op.outs])
        self.whole.update(zip(op.outs, outs, strict=True))

    def layout_of(self, op: Op, flags: list[bool]) -> _Layout:
        layouts = {self.split[a][0] for a, f in zip(op.ins, flags, strict=True) if f}
        if len(layouts) > 1:
            a = next(a for a, f in zip(op.ins, flags, strict=True) if f)
            raise MPMDError(
                f"`{op.name}` at {op.source} combines stacked values split over different tasks "
                f"or in different chunks (one comes from {self.origin.get(a, '?')!r}); place "
                "stacked Variables that are used together on the same list of tasks"
            )
        return layouts.pop()

    def chunk_ins(self, op: Op, layout: _Layout, j: int, ins: Sequence[Atom]) -> list[Atom]:
        length = layout.bounds[-1][1]
        out = []
        for a in ins:
            if isinstance(a, int) and a in self.split:
                out.append(self.split[a][1][j])
            elif self.shape(a) == ():
                out.append(self.read(a, op))
            elif self.shape(a)[0] == length:
                out.append(self.piece(a, layout, j, op))
            else:
                raise self.refuse(op, next(x for x in op.ins if x in self.split))
        return out

    def mark(self, op: Op, olds: Sequence[int], layout: _Layout, chunks: list[list[Atom]]):
        source = next(self.origin[a] for a in op.ins if isinstance(a, int) and a in self.origin)
        for k, v in enumerate(olds):
            self.split[v] = (layout, [c[k] for c in chunks])
            self.origin[v] = source

    def rewrite(self, op: Op) -> None:
        flags = [isinstance(a, int) and a in self.split for a in op.ins]
        if not any(flags):
            self.emit_whole(op, [self.read(a, op) for a in op.ins])
            return
        rule = stack_rules.stack_rule(op, flags, [self.shape(a) for a in op.ins])
        if rule is None:
            pairs = zip(op.ins, flags, strict=True)
            self.emit_whole(op, [self.joined(a, op) if f else self.read(a, op) for a, f in pairs])
            return
        layout = self.layout_of(op, flags)
        if rule == "scan":
            self.rewrite_scan(op, layout)
            return
        per_chunk = []
        for j, (start, stop) in enumerate(layout.bounds):
            size = stop - start
            infos = [self.info(v, None if rule == "reduce" else size) for v in op.outs]
            ins = self.chunk_ins(op, layout, j, op.ins)
            per_chunk.append(
                self.emit(op, op.primitive, stack_rules.chunk_params(op, size), ins, infos)
            )
        if rule == "map":
            self.mark(op, op.outs, layout, per_chunk)
            if any(a in self.computed for a, f in zip(op.ins, flags, strict=True) if f):
                self.computed.update(op.outs)
            return
        combine = stack_rules.COMBINE[op.name]
        for k, v in enumerate(op.outs):
            total = per_chunk[0][k]
            info = self.info(v)
            for outs in per_chunk[1:]:
                (total,) = self.emit(op, combine, {}, [total, outs[k]], [info])
            self.whole[v] = total

    def rewrite_scan(self, op: Op, layout: _Layout) -> None:
        num_consts, num_carry = scan_counts(op.params)
        consts = [self.read(a, op) for a in op.ins[:num_consts]]
        carry = [self.read(a, op) for a in op.ins[num_consts : num_consts + num_carry]]
        xs = op.ins[num_consts + num_carry :]
        carry_infos = [self.info(v) for v in op.outs[:num_carry]]
        order = range(len(layout.bounds))
        ys: list[list[Atom]] = [[] for _ in order]
        for j in reversed(order) if op.params["reverse"] else order:
            start, stop = layout.bounds[j]
            infos = carry_infos + [self.info(v, stop - start) for v in op.outs[num_carry:]]
            ins = [*consts, *carry, *self.chunk_ins(op, layout, j, xs)]
            outs = self.emit(
                op, op.primitive, stack_rules.chunk_params(op, stop - start), ins, infos
            )
            carry, ys[j] = outs[:num_carry], outs[num_carry:]
        self.whole.update(zip(op.outs[:num_carry], carry, strict=True))
        self.mark(op, op.outs[num_carry:], layout, ys)
        self.computed.update(op.outs[num_carry:])


def split_stacks(
    graph: Graph, inputs: Sequence[StepInput], outputs: Sequence[StepOutput]
) -> tuple[Graph, Expansion]:
    """``graph`` rewritten on chunks of its stacked inputs, and how its inputs and outputs
    expanded (an output homed on a stack, or computed on chunks, as chunks on its tasks).
    Raises an ``MPMDError`` where an op needs the whole of a stacked value."""
    homes = [(i.stack, i.spec) if i.stack is not None else None for i in inputs]
    out_homes = [(o.home, o.spec) if isinstance(o.home, TaskStack) else None for o in outputs]
    rw = _Rewriter(graph, [i.name for i in inputs])
    new_inputs: list[int] = []
    for v, home in zip(graph.inputs, homes, strict=True):
        if home is None:
            rw.whole[v] = rw.new.new_value(rw.info(v))
            new_inputs.append(rw.whole[v])
            continue
        stack, _ = home
        shape = graph.shapes[v]
        layout = _Layout(stack, tuple(stack.chunks(shape[0], where=rw.names[v])))
        chunks = [rw.new.new_value(rw.info(v, b - a)) for a, b in layout.bounds]
        rw.split[v] = (layout, chunks)
        rw.origin[v] = rw.names[v]
        new_inputs.extend(chunks)
    rw.new.inputs = new_inputs
    for op in graph.ops:
        rw.rewrite(op)
    new_outputs: list[Atom] = []
    expanded: list[StackHome | None] = []
    for atom, home in zip(graph.outputs, out_homes, strict=True):
        if isinstance(atom, int) and atom in rw.split:
            layout, chunks = rw.split[atom]
            if home is not None and home[0] != layout.stack:
                raise MPMDError(
                    f"a step result computed on the stack {layout.stack.name!r} belongs to a "
                    f"Variable stacked on {home[0].name!r}; place both on the same tasks"
                )
            new_outputs.extend(chunks)
            expanded.append(home or (layout.stack, PartitionSpec()))
        elif home is not None:  # a stacked Variable given a whole new value: cut it up
            stack, _ = home
            shape = rw.shape(atom)
            layout = _Layout(stack, tuple(stack.chunks(shape[0])))
            new_outputs.extend(rw.piece(atom, layout, j, None) for j in range(len(stack.tasks)))
            expanded.append(home)
        else:
            new_outputs.append(atom if isinstance(atom, Const) else rw.whole[atom])
            expanded.append(None)
    rw.new.outputs = new_outputs
    return rw.new, Expansion(homes, expanded)
