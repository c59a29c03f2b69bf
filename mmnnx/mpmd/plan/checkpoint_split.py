"""A checkpoint (``jax.checkpoint`` / ``nnx.remat``) whose body reads state placed on several
tasks (a whole model's forward under one remat) split, before colouring, into one checkpoint per
task segment, each keeping the policy and ``prevent_cse``: each stage's backward still
recomputes its own forward. A value one segment would hand another task that the step's forward
already made (a stage's output activation) is read from the forward instead of being made again,
so that the segments form a chain as the stages do."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from jax.extend import core as jcore

from mmnnx._jax.tracing import debug_info, inline_calls, join_effects
from mmnnx.mpmd.ir import Atom, Const, Graph, Op, aval_info
from mmnnx.mpmd.op_kinds import is_view_name
from mmnnx.mpmd.plan.colour import placed_reads, state_origins
from mmnnx.mpmd.step_io import StepInput
from mmnnx.mpmd.trace.tracing import drop_dead_ops
from mmnnx.sharding import Task

CHECKPOINT = "remat2"
"""JAX's name of the primitive that ``jax.checkpoint`` and ``nnx.remat`` bind."""

Var = Any  # a jax.extend.core.Var


def split_checkpoints(graph: Graph, inputs: Sequence[StepInput]) -> None:
    """Splits, in place, each checkpoint op of ``graph`` whose body reads state of several tasks
    (one record per graph input) into one checkpoint per task segment (:func:`_split`)."""
    placed = {v: i.task for v, i in zip(graph.inputs, inputs, strict=True) if i.task is not None}
    origin = state_origins(graph, placed)
    spanning = {
        op.index
        for op in graph.ops
        if op.name == CHECKPOINT and len(placed_reads(op, origin, placed)) > 1
    }
    if not spanning:
        return
    numbers: dict[int, Hashable] = {}  # a value -> the first value computed alike
    table: dict[Hashable, list[int]] = {}  # an application's number -> its results
    ops: list[Op] = []
    for op in graph.ops:
        pieces = None
        if op.index in spanning:
            state = {a: placed[origin[a]] for a in op.ins if type(a) is int and a in origin}
            pieces = _split(op, state, numbers, table, graph)
        ops += pieces or [op]
        _number(op, numbers, table)
    graph.ops = ops
    drop_dead_ops(graph)
    graph._producers = graph._consumers = None


def _const_number(value: Any) -> Hashable:
    """A constant's value number: equal constants alike, an unhashable one by identity."""
    key = (type(value), getattr(value, "dtype", None), value)
    try:
        hash(key)
    except TypeError:
        return ("id", id(value))
    return key


def _atom_numbers(atoms: Sequence[Any], numbers: dict) -> tuple:
    """The value numbers of graph atoms or jaxpr atoms (literals by value)."""
    out = []
    for a in atoms:
        if isinstance(a, Const | jcore.Literal):
            out.append(_const_number(a.value if isinstance(a, Const) else a.val))
        else:
            out.append(numbers.get(a, a))
    return tuple(out)


def _application(primitive: Any, params: dict, effectful: bool, args: tuple) -> Hashable | None:
    """The value number of ``primitive`` applied with ``params`` to ``args`` (value numbers);
    ``None`` for an effect or params that do not hash."""
    if effectful:
        return None
    key = (primitive, tuple(sorted(params.items())), args)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _number(op: Op, numbers: dict, table: dict) -> None:
    """Numbers ``op``'s results: those of the first op computing the same, else themselves."""
    key = _application(op.primitive, op.params, op.effectful, _atom_numbers(op.ins, numbers))
    found = table.get(key) if key is not None else None
    if found is not None:
        numbers.update(zip(op.outs, found, strict=True))
    elif key is not None:
        table[key] = op.outs


def _twins(body: Any, outer: dict, numbers: dict, table: dict) -> dict[Var, int]:
    """The body's values that an op before the checkpoint computes alike -> that op's result."""
    local = {v: _atom_numbers([a], numbers)[0] for v, a in outer.items()}
    twins: dict[Var, int] = {}
    for eqn in body.eqns:
        args = _atom_numbers(eqn.invars, local)
        key = _application(eqn.primitive, eqn.params, bool(eqn.effects), args)
        found = table.get(key) if key is not None else None
        if found is not None:
            local.update(zip(eqn.outvars, found, strict=True))
            twins.update(zip(eqn.outvars, found, strict=True))
    return twins


def _eqn_tasks(body: Any, state: dict[Var, Task], made: dict[Var, int]) -> list[Task] | None:
    """The task of each of ``body``'s equations: that of the placed state it reads (``state``:
    the body's inputs that are, views followed), else of its first reader, else of its latest
    operand's maker (``made``: each value's equation); ``None`` when an equation reads state of
    two tasks. Taking the reader's task leaves to a stage the ops between its predecessor's last
    weight and its own first (a norm, its derivative's factors), so that what crosses forward is
    what the forward sends."""
    eqns = body.eqns
    tasks: list[Task | None] = [None] * len(eqns)
    state = dict(state)
    for i, eqn in enumerate(eqns):
        reads = {state[a] for a in eqn.invars if isinstance(a, jcore.Var) and a in state}
        if len(reads) > 1:
            return None
        if reads:
            tasks[i] = next(iter(reads))
            if is_view_name(eqn.primitive.name) and len(eqn.outvars) == 1:
                state[eqn.outvars[0]] = tasks[i]
    readers: dict[Var, list[int]] = {}
    for i, eqn in enumerate(eqns):
        for a in eqn.invars:
            if isinstance(a, jcore.Var):
                readers.setdefault(a, []).append(i)
    for i in reversed(range(len(eqns))):
        if tasks[i] is None:
            after = sorted(j for v in eqns[i].outvars for j in readers.get(v, ()))
            tasks[i] = next((tasks[j] for j in after if tasks[j] is not None), None)
    for i, eqn in enumerate(eqns):
        makers = [made[a] for a in eqn.invars if isinstance(a, jcore.Var) and a in made]
        if tasks[i] is None and makers:
            tasks[i] = tasks[max(makers)]
    first = next((t for t in tasks if t is not None), None)
    return None if first is None else [first if t is None else t for t in tasks]


def _split(
    op: Op, state: dict[int, Task], numbers: dict, table: dict, graph: Graph
) -> list[Op] | None:
    """Checkpoint ``op`` as one checkpoint per task segment, or ``None`` when its equations run on
    one task, or one reads state of two (colouring then says which). ``state``: its operands
    that are placed state, by task; ``numbers`` and ``table``: the value numbers of the ops
    before it, for reading a value made on another task from the forward."""
    closed = inline_calls(jcore.ClosedJaxpr(op.params["jaxpr"], []))
    body = closed.jaxpr
    outer: dict[Var, Atom] = dict(zip(body.invars, op.ins, strict=True))
    outer |= {v: Const(c) for v, c in zip(body.constvars, closed.consts, strict=True)}
    placed = {v: state[a] for v, a in outer.items() if type(a) is int and a in state}
    made = {v: i for i, e in enumerate(body.eqns) for v in e.outvars}
    tasks = _eqn_tasks(body, placed, made)
    if tasks is None or len(set(tasks)) < 2:
        return None
    twins = _twins(body, outer, numbers, table)

    def source(i: int, v: Any) -> Any:
        """What equation ``i`` reads for its operand ``v``: the forward's twin of a value made on
        another task, else ``v``."""
        j = made.get(v)
        return twins[v] if j is not None and tasks[j] != tasks[i] and v in twins else v

    segment = _segment_of(body, tasks, source, made)
    return _segments(op, body, outer, segment, source, made, graph)


def _segment_of(
    body: Any, tasks: list[Task], source: Callable[[int, Any], Any], made: dict[Var, int]
) -> list[int | None]:
    """Each equation's segment (``None``: nothing needs it), numbered in run order. Equations are
    grouped by task and by how many task changes follow them, as late as they can run; then
    each joins the earliest group of its task that its operands allow (a stage's weight
    gradients join its input gradients), so that no two segments wait on each other."""
    eqns = body.eqns
    before: list[list[int]] = [[] for _ in eqns]
    after: list[list[int]] = [[] for _ in eqns]
    for i, eqn in enumerate(eqns):
        for a in eqn.invars:
            if isinstance(a, jcore.Var) and source(i, a) is a and a in made:
                before[i].append(made[a])
                after[made[a]].append(i)
    results = {v for v in body.outvars if isinstance(v, jcore.Var)}
    left: list[int | None] = [None] * len(eqns)  # task changes after the equation
    for i in reversed(range(len(eqns))):
        counts = [left[j] + (tasks[j] != tasks[i]) for j in after[i] if left[j] is not None]
        if eqns[i].effects or results.intersection(eqns[i].outvars):
            counts.append(0)
        left[i] = max(counts, default=None)
    groups = {(n, tasks[i]) for i, n in enumerate(left) if n is not None}
    for i, n in enumerate(left):  # operands first: their groups are final
        if n is not None:
            upper = min((left[j] - (tasks[j] != tasks[i]) for j in before[i]), default=None)
            left[i] = max(
                m for m, t in groups if t == tasks[i] and n <= m and (upper is None or m <= upper)
            )
    keys = dict.fromkeys((-n, tasks[i]) for i, n in enumerate(left) if n is not None)
    number = {k: s for s, k in enumerate(sorted(keys, key=lambda k: k[0]))}
    return [None if n is None else number[(-n, tasks[i])] for i, n in enumerate(left)]


def _segments(
    op: Op,
    body: Any,
    outer: dict[Var, Atom],
    segment: list[int | None],
    source: Callable[[int, Any], Any],
    made: dict[Var, int],
    graph: Graph,
) -> list[Op]:
    """One checkpoint op per segment of ``op``'s body, in run order; a value one segment hands
    another is a new graph value, a result of the body the op's own."""
    count = 1 + max(s for s in segment if s is not None)
    value: dict[Var, int] = {}  # values segments hand on -> graph values
    for k, v in enumerate(body.outvars):
        if isinstance(v, jcore.Var):
            value.setdefault(v, op.outs[k])
    reads: list[dict[Var, Atom]] = [{} for _ in range(count)]  # each segment's operands
    for i, eqn in enumerate(body.eqns):
        s = segment[i]
        for a in eqn.invars if s is not None else ():
            src = source(i, a) if isinstance(a, jcore.Var) else a
            if isinstance(a, jcore.Literal) or (a in made and segment[made[a]] == s):
                continue
            if src is not a:
                reads[s][a] = src
            elif a in made:
                if a not in value:
                    value[a] = graph.new_value(aval_info(a.aval))
                reads[s][a] = value[a]
            else:
                reads[s][a] = outer[a]
    writes: list[list[tuple[Any, int]]] = [[] for _ in range(count)]
    for k, v in enumerate(body.outvars):
        s = segment[made[v]] if isinstance(v, jcore.Var) and v in made else count - 1
        writes[s].append((v, op.outs[k]))
        if s == count - 1 and isinstance(v, jcore.Var) and v not in made:
            reads[s][v] = outer[v]
    handed = set(op.outs)
    for v, out in value.items():
        if out not in handed:
            writes[segment[made[v]]].append((v, out))
    flags = op.params["prevent_cse"]
    position = {v: k for k, v in enumerate(body.invars)}
    pieces = []
    for s in range(count):
        eqns = [e for i, e in enumerate(body.eqns) if segment[i] == s]
        invars = list(reads[s])
        params = dict(op.params)
        params["jaxpr"] = body.replace(
            constvars=[],
            invars=invars,
            outvars=[v for v, _ in writes[s]],
            eqns=eqns,
            effects=join_effects(*(e.effects for e in eqns)),
            debug_info=debug_info("mm.jit", "a checkpoint's part on one task"),
        )
        if isinstance(flags, tuple):
            flags_of = [flags[position[v]] if v in position else True for v in invars]
            params["prevent_cse"] = tuple(flags_of)
        ins = list(reads[s].values())
        pieces.append(op.derived(op.primitive, params, ins, [out for _, out in writes[s]]))
    return pieces
