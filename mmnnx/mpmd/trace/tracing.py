"""Tracing a step to the engine's flat IR (``ir.Graph``): calls inlined, each op's backward
flag, ``mm.task`` region and ``mm.microbatch`` group read from its name scope, splittable
control flow split, ops nothing needs dropped."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import AxisType

from mmnnx._jax.tracing import (
    CALLS,
    fast_sharding_probes,
    name_trace_as,
    ordered_effects,
    source_line,
)
from mmnnx.errors import SideEffectError
from mmnnx.mpmd.ir import GROUP_PREFIX, REGION_PREFIX, Const, Graph, Op, aval_info, live_ops
from mmnnx.mpmd.primitives import is_accumulate, marker_kind
from mmnnx.mpmd.trace.callbacks import CallbackFailures, catch_callbacks
from mmnnx.mpmd.trace.constraints import on_tasks
from mmnnx.mpmd.trace.control_flow import split_eqn
from mmnnx.mpmd.trace.mesh_context import traced_mesh

# JAX names the transposed (backward) pass of a computation ``transpose(...)`` in name stacks.
_BACKWARD_MARK = "transpose("
_REGION = re.compile(re.escape(REGION_PREFIX) + r"([^/()]+)")
_GROUP = re.compile(re.escape(GROUP_PREFIX) + r"(\d+)")
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "callback"})


def _calls_back(eqn: jcore.JaxprEqn, known: dict[int, bool] | None = None) -> bool:
    """Whether ``eqn`` is, or holds at any depth, a host callback (``known``: by nested jaxpr
    id)."""
    if eqn.primitive.name in _CALLBACKS:
        return True
    known = {} if known is None else known
    for sub in jcore.jaxprs_in_params(eqn.params):
        if id(sub) not in known:
            known[id(sub)] = any(_calls_back(inner, known) for inner in getattr(sub, "eqns", ()))
        if known[id(sub)]:
            return True
    return False


def is_backward_scope(scope: str) -> bool:
    """Whether a name scope (as the tracer records it) is inside a backward (transposed) pass.

    Example:
        >>> is_backward_scope("jvp(step)/transpose(jvp(mm_task:a))"), is_backward_scope("a/b")
        (True, False)
    """
    return _BACKWARD_MARK in scope


_TRANSFORM = re.compile(r"^(?:[\w\-]+\()*([^()]*?)\)*$")


def scope_components(scope: str) -> list[str]:
    """The names in a name scope, outermost first, with JAX's transform wrappers (``jvp(...)``,
    ``transpose(...)``) taken off.

    Example:
        >>> scope_components("/jvp(step)/transpose(jvp(layer0))/dense")
        ['step', 'layer0', 'dense']
    """
    return [m.group(1) for part in scope.split("/") if (m := _TRANSFORM.match(part)) and m.group(1)]


def scopes_of(closed: jcore.ClosedJaxpr) -> list[tuple[str, bool]]:
    """``(scope, backward)`` of every op a traced function (``jax.make_jaxpr``) runs, with calls
    inlined as mm.jit inlines them."""
    return [(op.scope, op.backward) for op in to_graph(closed).ops]


def _last(pattern: re.Pattern, scope: str) -> str | None:
    found = pattern.findall(scope)
    return found[-1] if found else None


def trace(
    fun: Callable,
    avals: Sequence[jax.ShapeDtypeStruct],
    *,
    name_as: Callable | None = None,
    arg_names: Sequence[str] | None = None,
    callback_failures: CallbackFailures | None = None,
) -> tuple[Graph, Any]:
    """Traces ``fun(*avals)`` to a flat op graph; returns it and the output shapes' pytree. With
    ``name_as``, JAX's tracing errors name the trace as that function's, with inputs named
    ``arg_names``; with ``callback_failures``, host callbacks record their exceptions there
    (:mod:`~mmnnx.mpmd.trace.callbacks`)."""
    if name_as is not None:
        name_trace_as(fun, name_as, "mm.jit", arg_names)
    with fast_sharding_probes():
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*avals)
    closed = on_tasks(closed)  # bare PartitionSpec constraints (mpmd/constraints.py)
    if callback_failures is not None:
        closed = catch_callbacks(closed, callback_failures)
    return to_graph(closed), out_shape


def to_graph(closed: jcore.ClosedJaxpr) -> Graph:
    """The flat op graph of a traced function (``jax.make_jaxpr``), calls inlined."""
    graph = Graph()
    env: dict[Any, Any] = {}
    calls_back: dict[int, bool] = {}  # by nested jaxpr id; the jaxprs live as long as `closed`
    scope_of: dict[tuple[str, int], str] = {}  # by (prefix, id of the eqn's name stack)
    # scope -> (microbatch group, mm.task region, backward): scopes repeat across many ops
    marks: dict[str, tuple[int | None, str | None, bool]] = {}

    def scope_marks(scope: str) -> tuple[int | None, str | None, bool]:
        if scope not in marks:
            group = _last(_GROUP, scope)
            marks[scope] = (
                int(group) if group is not None else None,
                _last(_REGION, scope),
                is_backward_scope(scope),
            )
        return marks[scope]

    def atom(a):
        if isinstance(a, jcore.Literal):
            return Const(a.val)
        return env[a]

    def walk(jaxpr: jcore.Jaxpr, consts: Sequence[Any], inputs: Sequence[Any], prefix: str = ""):
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            env[v] = Const(c)
        for v, x in zip(jaxpr.invars, inputs, strict=True):
            env[v] = x
        for eqn in jaxpr.eqns:
            stack = eqn.source_info.name_stack
            scope = scope_of.get((prefix, id(stack)))
            if scope is None:
                scope = scope_of[(prefix, id(stack))] = f"{prefix}/{stack}"
            if eqn.primitive.name in CALLS and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                inner_jaxpr = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
                inner_consts = inner.consts if isinstance(inner, jcore.ClosedJaxpr) else []
                outs = walk(inner_jaxpr, inner_consts, [atom(a) for a in eqn.invars], scope)
                for v, o in zip(eqn.outvars, outs, strict=True):
                    env[v] = o
                continue
            ordered = ordered_effects(eqn)
            if ordered:
                raise SideEffectError(
                    f"mm.jit: `{eqn.primitive.name}` at {source_line(eqn.source_info)} has the "
                    f"ordered side effect {ordered[0]}, which mm.jit cannot keep in order across "
                    "tasks; use an unordered callback (e.g. jax.debug.print) or move it out of "
                    "the step"
                )
            pieces = split_eqn(eqn)
            if pieces is None:
                pieces = [(dict(eqn.params), list(eqn.invars), list(eqn.outvars))]
            for params, invars, outvars in pieces:
                ins = [atom(a) for a in invars]
                outs = [_new_value(graph, v.aval) for v in outvars]
                for v, o in zip(outvars, outs, strict=True):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = o
                group, region, backward = scope_marks(scope)
                graph.ops.append(
                    Op(
                        index=len(graph.ops),
                        primitive=eqn.primitive,
                        params=params,
                        ins=ins,
                        outs=outs,
                        multiple_results=eqn.primitive.multiple_results,
                        source=source_line(eqn.source_info),
                        name=eqn.primitive.name,
                        scope=scope,
                        effectful=bool(eqn.effects),
                        backward=backward,
                        region=region,
                        group=group,
                        may_fail=_calls_back(eqn, calls_back),
                        mesh=traced_mesh(eqn),
                    )
                )
        return [atom(a) for a in jaxpr.outvars]

    inputs = [_new_value(graph, v.aval) for v in closed.jaxpr.invars]
    graph.inputs = inputs
    graph.outputs = walk(closed.jaxpr, closed.consts, inputs)
    made_per_microbatch(graph)
    drop_dead_ops(graph)
    return graph


def made_per_microbatch(graph: Graph) -> None:
    """Gives every ``mm.microbatch`` output its own op in the microbatched region. An output that
    does not depend on the microbatch (a constant, an argument or a Variable returned as it is:
    ``return loss, {"lr": lr, "steps": 1}``) is otherwise made before the region, or nowhere, and
    the region's per-microbatch sum would read what no stage makes: it gets a copy made in the
    region, once per microbatch, as a value computed from it would be. Ops are renumbered after."""
    made_in = {v: op.group for op in graph.ops for v in op.outs}
    ops: list[Op] = []
    for op in graph.ops:
        if is_accumulate(op):
            group = op.params["group"]
            x = op.ins[0]
            if isinstance(x, Const) or made_in.get(x) != group:
                out = op.outs[0]
                copy = graph.new_value((graph.shapes[out], graph.dtypes[out], graph.nbytes[out]))
                if out in graph.specs:
                    graph.specs[copy] = graph.specs[out]
                made = op.derived(jax.lax.copy_p, {}, [x], [copy])
                ops.append(
                    dataclasses.replace(
                        made, scope=f"{op.scope}/{GROUP_PREFIX}{group}", group=group
                    )
                )
                op.ins = [copy, *op.ins[1:]]
        ops.append(op)
    graph.ops = ops


def drop_dead_ops(graph: Graph) -> None:
    """Removes ops whose results nothing needs (and that have no effect); renumbers the rest. An
    unresolved ``rng_next`` marker is kept, with its draws: it counts one microbatch's draws."""
    outputs = [a for a in graph.outputs if isinstance(a, int)]
    graph.ops = live_ops(graph.ops, outputs, lambda op: marker_kind(op) == "rng_next")
    for i, op in enumerate(graph.ops):
        op.index = i


def _new_value(graph: Graph, aval: Any) -> int:
    """A graph value for ``aval``, with its sharding type if traced under explicit axes."""
    v = graph.new_value(aval_info(aval))
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
        graph.specs[v] = sharding.spec
    return v
