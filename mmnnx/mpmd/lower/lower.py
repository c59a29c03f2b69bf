"""Lowering: a cut (and possibly pipelined) graph -> one typed program per task.

The first pass of ``passes.py``: it decides which slot holds each value on each task, which values
move between tasks (a Send/Recv pair each), where microbatch sums run and which buffers may be
donated. It compiles nothing and touches no device; ``runner.py`` does that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.mpmd.lower.gather_once import gathered_layouts
from mmnnx.mpmd.lower.program import (
    Action,
    Constant,
    ConstantOutput,
    Output,
    Recv,
    Run,
    Send,
    StepProgram,
    Zeros,
)
from mmnnx.mpmd.lower.sum_layouts import layout_on, sum_layouts, trimmed
from mmnnx.mpmd.lower.whole import whole_everywhere
from mmnnx.mpmd.plan.cut import Fragment, Transfer
from mmnnx.mpmd.plan.pipeline import Pipeline
from mmnnx.mpmd.primitives import constraint_names, is_accumulate, is_constraint
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task
from mmnnx.sharding.specs import check_spec


def compatible(sharding: Any, task: Task) -> NamedSharding:
    """The sharding on ``task``'s mesh closest to ``sharding``: same spec if it fits, else P()."""
    mesh = task.jax_mesh
    spec = getattr(sharding, "spec", None)
    if isinstance(sharding, NamedSharding) and spec is not None:
        src_sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        dst_sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
        if all(a in dst_sizes and dst_sizes[a] == src_sizes.get(a) for a in axes):
            return NamedSharding(mesh, spec)
    return NamedSharding(mesh, PartitionSpec())


def constraint_layout(
    task: Task, names: Sequence[Any], shape: Sequence[int], source: str
) -> NamedSharding:
    """The sharding an ``mm.with_sharding_constraint`` of ``names`` (logical names or ``task``'s
    mesh axes) at line ``source`` asks for on ``task``."""
    spec = task.resolve(names)
    where = f"with_sharding_constraint at {source} on task {task.name!r}"
    check_spec(spec, shape, task.jax_mesh, where)
    return NamedSharding(task.jax_mesh, spec)


def _donations(
    graph: Graph, order: Sequence[tuple[Fragment, int | None]], inputs: Sequence[StepInput]
) -> dict[int, Fragment]:
    """Donated inputs -> their last reader, which may consume their buffer (never one run per
    microbatch)."""
    returned = {a for a in graph.outputs if isinstance(a, int)}
    last: dict[int, tuple[Fragment, int | None]] = {}
    for frag, m in order:
        for v in frag.in_ids:
            last[v] = (frag, m)
    out = {}
    for v, item in zip(graph.inputs, inputs, strict=True):
        frag, m = last.get(v, (None, None))
        once = frag is not None and m is None  # its last reader runs outside the loop
        if item.donated and once and frag.task == item.task and v not in returned:
            out[v] = frag
    return out


class _Lowering:
    """The state of one lowering pass: slots, where each value is, and the actions so far."""

    def __init__(self, graph: Graph, pipeline: Pipeline | None):
        self.graph = graph
        self.per_replica = set(pipeline.region_values) if pipeline else set()
        self.index_value = pipeline.index_value if pipeline else None
        if self.index_value is not None:
            self.per_replica.add(self.index_value)
        self.slot_task: list[Task | None] = []
        self.sharding_of: list[Any] = []  # None: decided by the compiler
        self.by_value: dict[tuple, list[int]] = {}
        self.where: dict[tuple[int, int | None], Task | None] = {}
        self.activations: dict[int, tuple[str, int]] = {}
        self.actions: list[Action] = []
        self.transfers: list[Transfer] = []
        self.first_constraint: dict[int, Op] = {}
        for op in graph.ops:
            if is_constraint(op) and isinstance(op.ins[0], int):
                self.first_constraint.setdefault(op.ins[0], op)
        self.op_task: dict[int, Task] = {}
        self.carry = pipeline.carry if pipeline else None
        self.last = pipeline.num_microbatches - 1 if pipeline else 0

    def replica(self, v: int, m: int | None) -> int | None:
        return m if v in self.per_replica else None

    def find(self, v: int, task: Task | None, m: int | None, want: Any = None) -> int | None:
        for slot in self.by_value.get((v, task, m), ()):
            if want is None or self.sharding_of[slot] == want:
                return slot
        return None

    def new_slot(self, v: int, task: Task | None, sharding: Any, m: int | None) -> int:
        slot = len(self.slot_task)
        self.slot_task.append(task)
        self.sharding_of.append(sharding)
        self.by_value.setdefault((v, task, m), []).append(slot)
        if m is not None:
            self.activations[slot] = (task.name, m)
        return slot

    def zeros(
        self,
        frag: Fragment,
        positions: Sequence[int],
        sums: Sequence[int],
        shardings: Sequence,
        met: dict[int, tuple[NamedSharding, ...]],
    ) -> tuple[int, ...]:
        """Slots of zero-filled running sums ``sums`` of ``frag``'s outputs at ``positions``: on the
        output's pinned sharding, else the one layout on the task that the sum ``met`` after the
        loop (its parameter's: :mod:`~.sum_layouts`), else replicated (known before its program
        compiles)."""
        task = frag.task
        layouts = [
            shardings[i] or layout_on(task, met.get(u, ())) or task.sharding()
            for i, u in zip(positions, sums, strict=True)
        ]
        slots = tuple(self.new_slot(u, task, s, None) for u, s in zip(sums, layouts, strict=True))
        self.where.update(dict.fromkeys([(u, None) for u in sums], task))
        self.actions.append(
            Zeros(
                task=task,
                slots=slots,
                shapes=tuple(self.graph.shapes[u] for u in sums),
                dtypes=tuple(self.graph.dtypes[u] for u in sums),
                shardings=tuple(layouts),
            )
        )
        return slots

    def chained(self, v: int, m: int | None) -> tuple[int, int | None]:
        """The value (and microbatch) a chain marker's result stands for: the Variable's value
        before the step, the previous microbatch's result, or the last one's as the step's
        result."""
        if v in self.carry.results:
            return self.carry.results[v], self.last
        before, new = self.carry.starts[v]
        if new is None or m in (None, 0):
            return before, None
        return new, m - 1

    def reads(self, frag: Fragment, m: int | None, other: Fragment, m_other: int | None) -> bool:
        """Whether ``frag`` on microbatch ``m`` reads a result of ``other`` on ``m_other``."""
        made = {(v, self.replica(v, m_other)) for v in other.out_ids}
        for v in frag.in_ids:
            at = m
            if self.carry is not None and v in self.carry.marker_values:
                v, at = self.chained(v, m)
            if (v, self.replica(v, at)) in made:
                return True
        return False

    def ensure(self, v: int, task: Task, m: int | None, want: NamedSharding | None = None) -> int:
        """The slot holding value ``v`` (of microbatch ``m``) on ``task``, received first if
        needed."""
        graph = self.graph
        if self.carry is not None and v in self.carry.marker_values:
            value, m = self.chained(v, m)
            return self.ensure(value, task, m, want)
        m = self.replica(v, m)
        found = self.find(v, task, m, want)
        if found is not None:
            return found
        if v == self.index_value:
            slot = self.new_slot(v, task, task.sharding(), m)
            del self.activations[slot]  # a constant, not an activation
            self.actions.append(Constant(slot=slot, task=task, value=m))
            return slot
        if (v, m) not in self.where:  # read before any program makes it
            maker = graph.producers().get(v)
            what = f"`{maker.name}` at {maker.source}" if maker is not None else f"value {v}"
            made_on = self.op_task.get(maker.index) if maker is not None else None
            where = f" on task {made_on.name!r}" if made_on is not None else ""
            of = f" for microbatch {m}" if m is not None else ""
            raise MPMDError(
                f"mm.jit: a program on task {task.name!r} reads the result of {what}{where}{of} "
                "before the program that makes it runs; place the Variables that code reads on "
                f"task {task.name!r}, or put it in an mm.task({task.name!r}) region"
            )
        source = self.where[(v, m)]
        src_slot = self.find(v, source, m)
        if want is None and graph.specs:  # sharding in types: the type's, on this task
            want = task.sharding(graph.specs.get(v, PartitionSpec()))
        if want is None:
            if source is None and v in self.first_constraint:
                op = self.first_constraint[v]
                names, on = constraint_names(op), self.op_task[op.index]
                want = constraint_layout(on, names, graph.shapes[v], op.source)
                if want.mesh != task.jax_mesh:
                    want = compatible(want, task)
            elif source is None:
                want = task.sharding()
            elif self.sharding_of[src_slot] is not None:
                want = compatible(self.sharding_of[src_slot], task)
        slot = self.new_slot(v, task, want, m)
        if source is not None:
            self.actions.append(
                Send(value=v, slot=src_slot, source=source, target=task, microbatch=m)
            )
        self.actions.append(
            Recv(
                value=v,
                slot=slot,
                source=source,
                target=task,
                from_slot=src_slot,
                sharding=want,
                microbatch=m,
            )
        )
        if m in (None, 0) and source != task:  # not a gather on its own task (gather_once)
            self.transfers.append(
                Transfer(
                    value=v,
                    source=source,
                    target=task,
                    shape=graph.shapes[v],
                    dtype=graph.dtypes[v],
                    nbytes=graph.nbytes[v],
                    sharding=want,
                )
            )
        return slot


def lower(
    graph: Graph,
    tasks: list[Task],
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    order: Sequence[tuple[Fragment, int | None]],
    pipeline: Pipeline | None = None,
    gather_weights: str | None = None,
) -> tuple[StepProgram, list[Transfer]]:
    """Lowers fragments in dispatch ``order`` (each with its microbatch, ``None`` outside the loop)
    to a :class:`StepProgram`; returns it and the first microbatch's transfers between tasks.
    ``gather_weights``: a mesh axis over which pipeline stages read the weights sharded over it
    gathered, once per step (:mod:`~.gather_once`)."""
    low = _Lowering(graph, pipeline)
    low.op_task = {op.index: f.task for f, _ in order for op in f.ops}
    accumulated = pipeline.accumulated if pipeline else {}
    sum_of = {v: u for u, v in accumulated.items()}
    after = [op for f in pipeline.post for op in f.ops] if pipeline else []
    met = sum_layouts(graph, accumulated, after, inputs, outputs) if not graph.specs else {}

    input_slots = []
    for i, (v, item) in enumerate(zip(graph.inputs, inputs, strict=True)):
        low.where[(v, None)] = item.task
        input_slots.append((low.new_slot(v, item.task, item.task_sharding, None), i))

    home_of: dict[int, NamedSharding] = {}
    for atom, output in zip(graph.outputs, outputs, strict=True):
        if isinstance(atom, int) and output.sharding is not None:
            home_of.setdefault(atom, output.sharding)

    donate_in = _donations(graph, order, inputs)
    labels = {}  # fragment id -> (task, kind, stage, part) of a pipeline stage or part of one
    if pipeline is not None:
        stages = pipeline.stages.items()
        labels = {id(f): (f.task.name, kind, stage, 0) for (kind, stage), f in stages}
        labels.update(pipeline.parts)
    typed = graph.specs or None
    gathered = {}
    if gather_weights is not None and pipeline is not None:
        if typed:
            raise MPMDError(
                f"mm.jit: gather_weights={gather_weights!r} needs a step traced without explicit "
                "mesh axes (with them every program keeps the types' layouts)"
            )
        gathered = gathered_layouts(graph, inputs, tasks, gather_weights)

    def placed_on(v: int, frag: Fragment) -> bool:
        """Whether step input ``v`` is placed on ``frag``'s task."""
        return low.where.get((v, None)) is frag.task

    whole = typed is None and whole_everywhere(graph, tasks, inputs, outputs, low.op_task)
    consumers = graph.consumers()
    fragment_of = {op.index: id(f) for f, _ in order for op in f.ops}
    returned = {a for a in graph.outputs if isinstance(a, int)}

    def only_summed(v: int, frag: Fragment) -> bool:
        """Whether ``frag``'s result ``v`` is read only by its microbatch sum (a gradient)."""
        return v not in returned and all(
            is_accumulate(c) or fragment_of.get(c.index) == id(frag) for c in consumers.get(v, ())
        )

    layout_of: dict[int, tuple[tuple, tuple[int, ...], frozenset[int]]] = {}

    def prepare(frag: Fragment, m: int | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The slots of ``frag``'s inputs on its task (received first where needed) and of
        its running sums (started at zero for the first microbatch)."""
        staged = id(frag) in labels
        in_slots = tuple(
            low.ensure(v, frag.task, m, gathered.get(v) if staged and placed_on(v, frag) else None)
            for v in frag.in_ids
        )
        if id(frag) not in layout_of:  # the same for every microbatch
            positions = tuple(i for i, v in enumerate(frag.out_ids) if v in sum_of)
            dropped = frozenset(i for i in positions if only_summed(frag.out_ids[i], frag))
            shardings = _out_shardings(frag, home_of, typed, whole, graph.shapes)
            layout_of[id(frag)] = (shardings, positions, dropped)
        shardings, positions, _ = layout_of[id(frag)]
        summed = [frag.out_ids[i] for i in positions]
        totals = tuple(low.find(sum_of[v], frag.task, None) for v in summed)
        if summed and totals[0] is None:  # the first microbatch adds to zeros
            totals = low.zeros(frag, positions, [sum_of[v] for v in summed], shardings, met)
        return in_slots, totals

    def emit(
        frag: Fragment, m: int | None, in_slots: tuple, totals: tuple, fused: bool = False
    ) -> None:
        shardings, positions, dropped = layout_of[id(frag)]
        out_slots: list[int | None] = []
        for i, (v, s) in enumerate(zip(frag.out_ids, shardings, strict=True)):
            if i in dropped:
                out_slots.append(None)
                continue
            r = low.replica(v, m)
            out_slots.append(low.new_slot(v, frag.task, s, r))
            low.where[(v, r)] = frag.task
        donate = tuple(i for i, v in enumerate(frag.in_ids) if donate_in.get(v) is frag)
        label = labels.get(id(frag))
        low.actions.append(
            Run(
                fragment=frag,
                ins=in_slots,
                outs=tuple(out_slots),
                microbatch=m,
                sums=totals,
                summed=positions,
                donate=donate,
                out_shardings=shardings,
                label=label,
                fused=fused,
            )
        )

    fused = pipeline.fused if pipeline else frozenset()
    position = 0
    while position < len(order):
        frag, m = order[position]
        if position in fused and not low.reads(*order[position + 1], *order[position]):
            second, m2 = order[position + 1]
            first_in = prepare(frag, m)
            second_in = prepare(second, m2)
            apart = set(first_in[1]) & set(second_in[1])  # both add to one sum: in turn
            emit(frag, m, *first_in, fused=not apart)
            emit(second, m2, *second_in)
            position += 2
        else:
            emit(frag, m, *prepare(frag, m))
            position += 1

    if low.carry is not None:  # a chained result is where the last microbatch left it
        for result, new in low.carry.results.items():
            low.where[(result, None)] = low.where[(new, low.last)]
    results: list[Output | ConstantOutput] = []
    task_on: dict[int, Task] = {}  # id of a home's mesh -> its task (comparing meshes is slow)
    for atom, output in zip(graph.outputs, outputs, strict=True):
        home = output.sharding
        if isinstance(atom, Const):
            results.append(ConstantOutput(value=atom.value, home=home))
        elif home is not None:
            if id(home.mesh) not in task_on:
                task_on[id(home.mesh)] = next(t for t in tasks if t.jax_mesh == home.mesh)
            task = task_on[id(home.mesh)]
            slot = low.ensure(atom, task, None, home)
            results.append(Output(slot=slot, value=atom, task=task))
        else:
            task = low.where[(atom, None)]  # None: a step input on no task, returned as it is
            slot = low.ensure(atom, task, None) if task else low.find(atom, task, None)
            results.append(Output(slot=slot, value=atom, task=task))
    program = StepProgram(
        tasks=tuple(tasks),
        actions=tuple(low.actions),
        inputs=tuple(input_slots),
        outputs=tuple(results),
        shardings=tuple(low.sharding_of),
        activations=low.activations,
    )
    return program, low.transfers


def _out_shardings(
    frag: Fragment,
    home_of: dict[int, NamedSharding],
    typed: dict[int, Any] | None,
    whole: bool = False,
    shapes: Sequence[tuple[int, ...]] = (),
) -> tuple:
    """A fragment's results' shardings: their home's when on this task; replicated with no inputs,
    on one device or where every value is ``whole``, except that a result of an
    ``mm.with_sharding_constraint`` in a fragment with no inputs keeps that constraint's layout
    (nothing else pins the program to its task); else the compiler's choice; with sharding in
    types (``typed``), the type's."""
    pinned = typed is None and not frag.in_ids and not whole
    made_by = {v: op for op in frag.ops if is_constraint(op) for v in op.outs} if pinned else {}
    out = []
    for v in frag.out_ids:
        home = home_of.get(v)
        if home is None and v in made_by:
            op = made_by[v]
            names = constraint_names(op)
            out.append(constraint_layout(frag.task, names, shapes[v], op.source))
            continue
        if typed is not None:
            spec = typed.get(v, PartitionSpec())
            on_home = home is not None and home.mesh == frag.task.jax_mesh
            on_home = on_home and trimmed(home.spec) == trimmed(spec)
            out.append(home if on_home else frag.task.sharding(spec))
        elif home is not None and home.mesh == frag.task.jax_mesh:
            out.append(home)
        elif whole or not frag.in_ids or frag.task.jax_mesh.size == 1:
            out.append(frag.task.sharding())  # nothing to infer from, or nothing to choose
        else:
            out.append(None)
    return tuple(out)
