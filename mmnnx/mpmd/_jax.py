"""The one module that touches JAX internals: jaxpr types and primitives, name-stack and
source-info conventions, which primitives are views or slicing, and the marker primitives.

Everything else in the engine works on the flat IR this module produces (``ir.Graph``), whose ops
already say whether they are backward, which ``mm.task`` region and which ``mm.microbatch`` call
they belong to; so a JAX upgrade changes this file only (``mmnnx/_nnx.py`` is its Flax twin).
Public ``jax.extend`` names are used where they exist; ``jax._src`` only for the ordered-effects
set, the user frame of a source location, whether a trace is in progress, and the debug info that
names a traced step in JAX's errors, which JAX does not export; and, on the per-step path, for an
array's per-device arrays and layouts (``_arrays``, ``_addressable_device_assignment``), making
an array from them without re-checking it, the runtime's batched copy between devices, and a
compiled program's launch without JAX's per-argument checks (``DirectLaunch``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import functools
import math
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import api_util, dispatch, effects, source_info_util
from jax._src import core as jax_core
from jax._src.array import ArrayImpl
from jax._src.interpreters import partial_eval as pe
from jax._src.interpreters import pxla
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding

from mmnnx.errors import MPMDError, SideEffectError
from mmnnx.mpmd.ir import GROUP_PREFIX, REGION_PREFIX, Atom, Const, Graph, Op
from mmnnx.sharding.specs import itemsize

# Call-like primitives whose bodies are spliced into the enclosing graph: they carry no semantics
# beyond grouping, and splicing lets their pieces run on different tasks.
_INLINE = frozenset({"jit", "pjit", "closed_call", "core_call"})

# Ops that only re-present one value (reshaped, broadcast, transposed, cast): a view of placed
# state still is that state, so an op reading it runs where the state lives.
_VIEWS = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "copy",
        "reduce_precision",
        "mm_chain_in",
    }
)

# Data movement (slicing a batch into inputs and labels): cheap enough to recompute in every
# fragment that reads it instead of sending it.
_SLICING = frozenset(
    {"dynamic_slice", "slice", "reshape", "squeeze", "expand_dims", "convert_element_type"}
)

# JAX names the transposed (backward) pass of a computation ``transpose(...)`` in name stacks.
_BACKWARD_MARK = "transpose("
_REGION = re.compile(re.escape(REGION_PREFIX) + r"([^/()]+)")
_GROUP = re.compile(re.escape(GROUP_PREFIX) + r"(\d+)")


# Primitives that call back into Python (and so may raise while a compiled program runs).
_CALLBACKS = frozenset({"pure_callback", "io_callback", "debug_callback", "callback"})


def _calls_back(eqn: jcore.JaxprEqn) -> bool:
    if eqn.primitive.name in _CALLBACKS:
        return True
    return any(
        _calls_back(inner)
        for sub in jcore.jaxprs_in_params(eqn.params)
        for inner in getattr(sub, "eqns", ())
    )


def is_view(op: Op) -> bool:
    """Whether ``op`` only re-presents its operand (reshape, broadcast, transpose, cast)."""
    return op.name in _VIEWS


def is_slicing(op: Op) -> bool:
    """Whether ``op`` only cuts or re-presents data (cheap to recompute where it is needed)."""
    return op.name in _SLICING


# Ops too costly to repeat in every stage that reads their result (contractions), and ops that
# run a nested program (their cost is unknown).
_COSTLY = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def is_cheap(op: Op) -> bool:
    """Whether ``op`` is cheap enough to recompute where its result is needed: anything but a
    contraction or an op holding a nested program (scan, while, cond, custom derivatives)."""
    return op.name not in _COSTLY and not any(
        isinstance(p, jcore.Jaxpr | jcore.ClosedJaxpr) for p in op.params.values()
    )


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


def no_ambient_mesh():
    """A context without the ambient mesh (``with MultiMesh(...)``): the engine traces against
    abstract shapes and compiles and runs each fragment on its own task's mesh."""
    return jax.set_mesh(None)


def tracing() -> bool:
    """Whether a JAX trace (``jit``, ``grad``, ``vmap``, ``make_jaxpr``, ...) is in progress.

    Example:
        >>> tracing(), jax.make_jaxpr(lambda: tracing() or 0)().eqns
        (False, [])
    """
    return not jax_core.trace_state_clean()


def trace(
    fun: Callable,
    avals: Sequence[jax.ShapeDtypeStruct],
    *,
    name_as: Callable | None = None,
    arg_names: Sequence[str] | None = None,
) -> tuple[Graph, Any]:
    """Traces ``fun(*avals)`` to a flat op graph; returns it and the output shapes' pytree.

    With ``name_as``, JAX's tracing errors describe the trace as that function's (its name and
    source line) for ``mm.jit``, with inputs named ``arg_names``: a traced value used where a
    concrete one is needed (a shape, an ``if``) is reported "while tracing the function
    train_step at model.py:12 for mm.jit ... the argument arg2", not as mm.jit's wrapper.
    """
    if name_as is not None:
        names = None if arg_names is None else tuple(arg_names)
        info = jax_core.DebugInfo(
            "mm.jit", api_util.fun_sourceinfo(name_as), names, jax_core.initial_result_paths
        )
        api_util.save_wrapped_fun_debug_info(fun, info)
    with fast_sharding_probes():
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*avals)
    return to_graph(closed), out_shape


def _no_sharding(tracer: Any) -> Any:
    raise AttributeError(f"The 'sharding' attribute is not available on {type(tracer).__name__}")


@contextlib.contextmanager
def fast_sharding_probes():
    """Makes ``getattr(tracer, "sharding", None)`` cheap while tracing.

    Flax probes every value set into a Variable this way. JAX answers a tracer with an
    ``AttributeError`` whose message walks the whole trace so far to say where the tracer came
    from. A model's construction draws RNG keys thousands of times, so tracing it costs time
    quadratic in its size (measured: 17 of 21 s for a 64-block GPT). Inside this block the
    error says only that a tracer has no sharding.
    """
    original = jax_core.Tracer.sharding
    jax_core.Tracer.sharding = property(_no_sharding)
    try:
        yield
    finally:
        jax_core.Tracer.sharding = original


def outputs_of(closed: jcore.ClosedJaxpr, wanted: Sequence[int]) -> Callable[[], list]:
    """A function of no arguments computing the outputs ``wanted`` of ``closed`` (a traced
    function of no arguments), to compile with ``jax.jit``."""
    fun = jcore.jaxpr_as_fun(closed)

    def wanted_outputs() -> list:
        outs = fun()
        return [outs[i] for i in wanted]

    return wanted_outputs


def replay(
    closed: jcore.ClosedJaxpr, wanted: Sequence[int], device: Any, put: Callable[[int, Any], None]
) -> None:
    """Computes on ``device`` the outputs ``wanted`` of ``closed`` (a function of no arguments)
    and hands each to ``put(index, value)`` as soon as it is made.

    The ops that only one output needs (a Variable's initializer) run as one compiled program
    per output, cached by the ops' structure, so equal layers share one program and a model
    built again compiles nothing; the ops several outputs share (an ``nnx.Rngs`` counter) and
    ops with side effects run one by one, as eager code does. A value is dropped after its
    last use.
    """
    jaxpr = closed.jaxpr
    keep = sorted(set(wanted))
    owner = _owners(jaxpr, [(i, jaxpr.outvars[i]) for i in keep])
    shared: list[jcore.JaxprEqn] = []
    cones: dict[int, list[jcore.JaxprEqn]] = {}
    for e in jaxpr.eqns:
        who = _owner_of(e, owner)
        if who is _SHARED:
            shared.append(e)
        elif who is not None:  # None: no wanted output reads it
            cones.setdefault(who, []).append(e)
    made_at = {v: -1 for v in (*jaxpr.constvars, *jaxpr.invars)}  # the shared op making it
    last_read: dict[Any, int] = {}
    for n, e in enumerate(shared):
        made_at.update((v, n) for v in e.outvars)
        last_read.update((a, n) for a in e.invars if not isinstance(a, jcore.Literal))
    # Each output is made right after the last shared op its cone reads: by a program of
    # what it reads, or (``None``) as the shared value it is.
    due: dict[int, list[tuple[int, Callable | None, list]]] = {}
    for i in keep:
        v = jaxpr.outvars[i]
        if isinstance(v, jcore.Literal):
            program, reads = (lambda value=v.val: value), []
        elif v in made_at:
            program, reads = None, [v]
        else:
            program, reads = _cone_program(cones[i], v)
        at = max((made_at[a] for a in reads), default=-1)
        due.setdefault(at, []).append((i, program, reads))
        last_read.update((a, max(last_read.get(a, -1), at)) for a in reads)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))

    def finish(n: int) -> None:
        for i, program, reads in due.get(n, ()):
            ins = [env[a] for a in reads]
            put(i, ins[0] if program is None else program(*ins))
        for v in [v for v in env if last_read.get(v, -1) <= n]:
            del env[v]

    with jax.default_device(device):
        finish(-1)
        for n, e in enumerate(shared):
            ins = [a.val if isinstance(a, jcore.Literal) else env[a] for a in e.invars]
            with e.ctx.manager:
                out = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
            outs = out if e.primitive.multiple_results else [out]
            env.update(zip(e.outvars, outs, strict=True))
            finish(n)


# The owner of a value several wanted outputs (or an op with side effects) read.
_SHARED = object()


def _owner_of(eqn: jcore.JaxprEqn, owner: dict[Any, Any]) -> Any:
    """The output that ``eqn``'s results are computed for: ``_SHARED`` where several are (or
    where it has side effects), ``None`` where none is."""
    if eqn.effects or not eqn.outvars:
        return _SHARED
    owners = {owner[v] for v in eqn.outvars if v in owner}
    return owners.pop() if len(owners) == 1 else (_SHARED if owners else None)


def _owners(jaxpr: jcore.Jaxpr, outputs: Sequence[tuple[int, Any]]) -> dict[Any, Any]:
    """Maps each value of ``jaxpr`` that ``outputs`` (pairs of an output's index and its
    value) need to the one output whose computation reads it, or to ``_SHARED``."""
    owner: dict[Any, Any] = {}

    def claim(v: Any, who: Any) -> None:
        if not isinstance(v, jcore.Literal):
            have = owner.get(v)
            owner[v] = who if have is None or have == who else _SHARED

    for i, v in outputs:
        claim(v, i)
    for e in reversed(jaxpr.eqns):
        who = _owner_of(e, owner)
        if who is not None:
            for a in e.invars:
                claim(a, who)
    return owner


# Initializer programs by structure (ops, shapes, literals): equal layers share one.
_CONE_PROGRAMS: dict[tuple, Callable] = {}
_CONE_PROGRAMS_KEPT = 1024


def _cone_program(eqns: Sequence[jcore.JaxprEqn], out: Any) -> tuple[Callable, list]:
    """A jitted function computing ``out`` by ``eqns`` from the values they read but do not
    make, and those values. Lists of ops of the same structure share one function."""
    made = {o for e in eqns for o in e.outvars}
    reads = list(
        dict.fromkeys(
            a for e in eqns for a in e.invars if not isinstance(a, jcore.Literal) and a not in made
        )
    )
    number = {v: k for k, v in enumerate(reads)}
    key: list[Any] = [tuple(_aval_key(v.aval) for v in reads)]
    for e in eqns:
        ins = tuple(
            ("literal", _aval_key(a.aval), np.asarray(a.val).tobytes())
            if isinstance(a, jcore.Literal)
            else number[a]
            for a in e.invars
        )
        first = len(number)
        number.update((v, first + k) for k, v in enumerate(e.outvars))
        key.append((e.primitive, _params_key(e.params), ins))
    key.append(number[out])
    program = _CONE_PROGRAMS.get(tuple(key))
    if program is None:
        if len(_CONE_PROGRAMS) >= _CONE_PROGRAMS_KEPT:
            _CONE_PROGRAMS.clear()
        info = jax_core.DebugInfo("mm.init", "a Variable's initializer", None, None)
        jaxpr = jcore.Jaxpr([], reads, [out], list(eqns), debug_info=info)
        fun = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(jaxpr, []))
        program = _CONE_PROGRAMS[tuple(key)] = jax.jit(lambda *args: fun(*args)[0])
    return program, reads


def _aval_key(aval: Any) -> tuple:
    return aval.shape, aval.dtype, getattr(aval, "weak_type", False)


def _params_key(params: dict) -> Any:
    key = tuple(sorted(params.items()))
    try:
        hash(key)
    except TypeError:  # a list or dict among the params
        return repr(key)
    return key


def to_graph(closed: jcore.ClosedJaxpr) -> Graph:
    graph = Graph()
    env: dict[Any, Any] = {}

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
            scope = f"{prefix}/{eqn.source_info.name_stack}"
            if eqn.primitive.name in _INLINE and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                inner_jaxpr = inner.jaxpr if isinstance(inner, jcore.ClosedJaxpr) else inner
                inner_consts = inner.consts if isinstance(inner, jcore.ClosedJaxpr) else []
                outs = walk(inner_jaxpr, inner_consts, [atom(a) for a in eqn.invars], scope)
                for v, o in zip(eqn.outvars, outs, strict=True):
                    env[v] = o
                continue
            ordered = [e for e in eqn.effects if effects.ordered_effects.contains(e)]
            if ordered:
                raise SideEffectError(
                    f"mm.jit: `{eqn.primitive.name}` at {_source_line(eqn.source_info)} has the "
                    f"ordered side effect {ordered[0]}, which mm.jit cannot keep in order across "
                    "tasks; use an unordered callback (e.g. jax.debug.print) or move it out of "
                    "the step"
                )
            split = _SPLITTERS.get(eqn.primitive.name)
            pieces = split(eqn) if split is not None else None
            if pieces is None:
                pieces = [(dict(eqn.params), list(eqn.invars), list(eqn.outvars))]
            for params, invars, outvars in pieces:
                ins = [atom(a) for a in invars]
                outs = [_new_value(graph, v.aval) for v in outvars]
                for v, o in zip(outvars, outs, strict=True):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = o
                group = _last(_GROUP, scope)
                graph.ops.append(
                    Op(
                        index=len(graph.ops),
                        primitive=eqn.primitive,
                        params=params,
                        ins=ins,
                        outs=outs,
                        multiple_results=eqn.primitive.multiple_results,
                        source=_source_line(eqn.source_info),
                        name=eqn.primitive.name,
                        scope=scope,
                        effectful=bool(eqn.effects),
                        backward=is_backward_scope(scope),
                        region=_last(_REGION, scope),
                        group=int(group) if group is not None else None,
                        may_fail=_calls_back(eqn),
                        mesh=_traced_mesh(eqn),
                    )
                )
        return [atom(a) for a in jaxpr.outvars]

    inputs = [_new_value(graph, v.aval) for v in closed.jaxpr.invars]
    graph.inputs = inputs
    graph.outputs = walk(closed.jaxpr, closed.consts, inputs)
    drop_dead_ops(graph)
    return graph


def _split_cond(eqn: jcore.JaxprEqn) -> list[tuple[dict, list, list]] | None:
    """A ``cond`` whose results fall into independent groups, as one cond per group (each with
    the predicate and only the operands its group reads), or ``None`` if it does not split.

    Results are independent when, in every branch, they share no computation but scalar
    arithmetic (a step count, a flag), which each piece recomputes. An optimizer wrapper such as
    ``optax.MultiSteps`` updates every parameter's state in one cond; split, each parameter's
    piece can run on the task that holds it."""
    branches = eqn.params["branches"]
    if eqn.effects or len(eqn.outvars) < 2:
        return None
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
                if any(getattr(v.aval, "shape", ()) != () for v in e.outvars):
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
            _, reads = pe.dce_jaxpr(branch.jaxpr, used)
            keep = [a or b for a, b in zip(keep, reads, strict=True)]
        new_branches = []
        for branch in branches:
            jaxpr, _ = pe.dce_jaxpr(branch.jaxpr, used, instantiate=keep)
            new_branches.append(jcore.ClosedJaxpr(jaxpr, branch.consts))
        operands = [v for v, k in zip(eqn.invars[1:], keep, strict=True) if k]
        outvars = [eqn.outvars[i] for i in positions]
        pieces.append(({"branches": tuple(new_branches)}, [eqn.invars[0], *operands], outvars))
    return pieces


def _split_while(eqn: jcore.JaxprEqn) -> list[tuple[dict, list, list]] | None:
    """A ``while_loop`` whose carried values fall into independent groups, as one loop per group,
    or ``None`` if it does not split.

    Scalar carried values computed only from each other (a step counter) are carried by every
    piece, and so is whatever the loop's predicate reads, which must be among them. The other
    values are grouped as :func:`_split_cond` groups results: one piece per group, each reading
    only the operands its group needs, so each can run on the task that holds its state."""
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
        """The carried inputs an output reads, and the ids of the non-scalar equations on
        the way."""
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
    _, cond_used = pe.dce_jaxpr(cond.jaxpr, [True])
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
        _, body_reads = pe.dce_jaxpr(jaxpr, carried)
        body_keep = body_reads[:body_n] + carried
        new_body, _ = pe.dce_jaxpr(jaxpr, carried, instantiate=body_keep)
        cond_keep = cond_used[:cond_n] + carried
        new_cond, _ = pe.dce_jaxpr(cond.jaxpr, [True], instantiate=cond_keep)
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
    """``items`` grouped by ``links`` (pairs that belong together, transitively), each group in
    the order of ``items``; groups ordered by their first item.

    Example:
        >>> _groups(range(5), [(0, 3), (3, 4)])
        [[0, 3, 4], [1], [2]]
    """
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


_SPLITTERS = {"cond": _split_cond, "while": _split_while}


def drop_dead_ops(graph: Graph) -> None:
    """Removes ops whose results nothing needs (and that have no effect); renumbers the rest.

    An RNG count's ``rng_next`` marker is kept while unresolved, with the draws counting up to
    it: its count may be read by nothing (an ``nnx.Rngs`` made by ``fork()`` inside the step),
    yet it is how many draws one microbatch makes, which sets where the next one starts."""
    needed = {a for a in graph.outputs if isinstance(a, int)}
    kept = []
    for op in reversed(graph.ops):
        if op.effectful or marker_kind(op) == "rng_next" or any(v in needed for v in op.outs):
            kept.append(op)
            needed.update(a for a in op.ins if isinstance(a, int))
    graph.ops = kept[::-1]
    for i, op in enumerate(graph.ops):
        op.index = i


def _traced_mesh(eqn: Any) -> Any:
    """The abstract mesh ``eqn`` was traced under, if it has any explicit axes (``None``
    otherwise: such ops re-trace in any context)."""
    mesh = getattr(eqn.ctx, "cur_abstract_mesh", None)
    if mesh is None or mesh.empty:
        return None
    return mesh if AxisType.Explicit in mesh.axis_types or _explicit_trace.get() else None


def _new_value(graph: Graph, aval: Any) -> int:
    """A graph value for ``aval``, with its sharding type if traced under explicit axes."""
    v = graph.new_value(_aval_info(aval))
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
        graph.specs[v] = sharding.spec
    return v


# Messages JAX raises when a step uses explicit-axes APIs (``jax.sharding.reshard``,
# ``out_sharding=P(...)``) with no mesh to give them meaning.
_NEEDS_MESH = (
    "not under a mesh context",
    "Reshard should only be used",
    "have a non-empty mesh",
)


def needs_explicit_axes(error: BaseException) -> bool:
    """Whether tracing failed because the step was written for explicit mesh axes."""
    return any(m in str(error) for m in _NEEDS_MESH)


@functools.cache
def explicit_twin(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis explicit (same devices and names): a task's programs compile
    under it when its step was traced with sharding in types."""
    return Mesh(
        mesh.devices, mesh.axis_names, axis_types=(AxisType.Explicit,) * len(mesh.axis_names)
    )


def auto_twin(x: Any, like: Any = None) -> Any:
    """``x`` on the same devices and spec with automatic axes, without a copy (values handed
    back to the caller stay on their task's own mesh), as sharding ``like`` if that lays it out
    alike (``P()`` for a type's ``P(None,)``: the caller's next call plans the same); other
    values unchanged."""
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    same_layout = isinstance(like, NamedSharding) and like.is_equivalent_to(sharding, x.ndim)
    if same_layout and like != sharding:
        return jax.device_put(x, like)
    if not isinstance(mesh, Mesh) or AxisType.Explicit not in mesh.axis_types:
        return x
    auto = Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    return jax.device_put(x, NamedSharding(auto, sharding.spec))


_explicit_trace: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "mm_explicit_trace", default=False
)


@contextlib.contextmanager
def explicit_tracing(mesh: Mesh):
    """Traces under ``mesh``'s shape with explicit axes, so that ``reshard`` and
    ``out_sharding=P(...)`` in a step mean the axes of whichever task runs them."""
    token = _explicit_trace.set(True)
    try:
        with jax.sharding.use_abstract_mesh(explicit_twin(mesh).abstract_mesh):
            yield
    finally:
        _explicit_trace.reset(token)


def typed_aval(shape: Sequence[int], dtype: Any, mesh: Mesh, spec: Any) -> Any:
    """An abstract input with sharding ``spec`` in its type, for :func:`explicit_tracing`."""
    return jax.ShapeDtypeStruct(
        shape, dtype, sharding=NamedSharding(explicit_twin(mesh).abstract_mesh, spec)
    )


def _aval_info(aval) -> tuple[tuple[int, ...], Any, int]:
    shape = tuple(getattr(aval, "shape", ()))
    dtype = getattr(aval, "dtype", np.dtype("float32"))
    try:
        nbytes = math.prod(shape) * itemsize(dtype)
    except TypeError:
        nbytes = 0
    return shape, dtype, nbytes


def _source_line(source_info) -> str:
    return _frame_line(source_info.traceback)


def _frame_line(traceback) -> str:
    frame = source_info_util.user_frame(traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def run_ops(ops: Sequence[Op], in_ids: Sequence[int], out_ids: Sequence[int], args) -> list:
    """Evaluates ``ops`` (in order) on ``args`` bound to ``in_ids``; returns ``out_ids``' values.

    Called inside ``jax.jit`` to build one fragment's program, lowered under
    :func:`constraint_layouts` for the fragment's task.
    """
    env = dict(zip(in_ids, args, strict=True))

    def read(a):
        return a.value if isinstance(a, Const) else env[a]

    for op in ops:
        params = op.primitive.get_bind_params(op.params)
        with jax.sharding.use_abstract_mesh(op.mesh) if op.mesh else contextlib.nullcontext():
            result = op.primitive.bind(*(read(a) for a in op.ins), **params)
        if not op.multiple_results:
            result = (result,)
        env.update(zip(op.outs, result, strict=True))
    return [read(i) for i in out_ids]


# A logical sharding constraint recorded while mm.jit traces a step: identity on values, lowered
# to ``jax.lax.with_sharding_constraint`` on the task whose fragment contains it, wherever it sits
# (the step's own ops, or the body of a scan, cond, while or checkpoint).
constraint_p = jcore.Primitive("mm_sharding_constraint")
constraint_p.def_impl(lambda x, *, names: x)
constraint_p.def_abstract_eval(lambda x, *, names: x)

# names, shape, source line -> the sharding on the task whose fragment is lowering
_CONSTRAINT_LAYOUT: contextvars.ContextVar[Callable[[tuple, tuple, str], Any] | None] = (
    contextvars.ContextVar("mm_constraint_layout", default=None)
)


@contextlib.contextmanager
def constraint_layouts(layout: Callable[[tuple, tuple, str], Any]):
    """Lowers the constraints met inside this block with ``layout(names, shape, source)``."""
    token = _CONSTRAINT_LAYOUT.set(layout)
    try:
        yield
    finally:
        _CONSTRAINT_LAYOUT.reset(token)


def _constraint_lowering(ctx, x, *, names):
    layout = _CONSTRAINT_LAYOUT.get()
    where = _frame_line(ctx.traceback)
    if layout is None:
        raise MPMDError(
            f"mm.with_sharding_constraint at {where}: a constraint traced inside an mm.jit step "
            "was compiled outside it (logical names mean something only on a task)"
        )
    sharding = layout(names, tuple(ctx.avals_in[0].shape), where)
    apply = mlir.lower_fun(
        lambda v: jax.lax.with_sharding_constraint(v, sharding), multiple_results=False
    )
    return apply(ctx, x)


mlir.register_lowering(constraint_p, _constraint_lowering)


def _constraint_transpose(ct, x, *, names):
    return [constraint_p.bind(ct, names=names)]


ad.deflinear2(constraint_p, _constraint_transpose)
batching.primitive_batchers[constraint_p] = lambda args, dims, *, names: (
    constraint_p.bind(args[0], names=(None, *names) if dims[0] == 0 else names),
    dims[0],
)


def constraint_names(op: Op) -> tuple:
    """The spec entries (logical or physical axis names) of a constraint op."""
    return op.params["names"]


def is_constraint(op: Op) -> bool:
    return op.primitive is constraint_p


# Microbatch markers, emitted only while mm.jit traces an ``mm.microbatch`` call (traced once, for
# one microbatch): ``index_p`` yields the microbatch number, which the runtime supplies per
# replica; ``accumulate_p`` marks a per-microbatch output that the runtime sums over replicas.
index_p = jcore.Primitive("mm_microbatch_index")
index_p.def_abstract_eval(lambda *, group: jax.core.ShapedArray((), np.dtype("int32")))

accumulate_p = jcore.Primitive("mm_microbatch_accumulate")
accumulate_p.def_impl(lambda x, *, group, gathered=False: x)
accumulate_p.def_abstract_eval(lambda x, *, group, gathered=False: x)
ad.deflinear2(accumulate_p, lambda ct, x, *, group, gathered=False: [ct])


def microbatch_index(group: int):
    """The current microbatch number (an int32 scalar) of microbatch group ``group``."""
    return index_p.bind(group=group)


def accumulate(x, group: int, gathered: bool = False):
    """Marks ``x`` as one microbatch's contribution to a sum over the microbatches of ``group``.
    ``gathered``: ``x`` is zero but for the microbatch's own rows (a gathered output), so its
    sum is kept in a buffer of its own, where adding it is an in-place update of those rows."""
    return accumulate_p.bind(x, group=group, gathered=gathered)


def is_index(op: Op) -> bool:
    return op.primitive is index_p


def is_accumulate(op: Op) -> bool:
    return op.primitive is accumulate_p


def is_gathered(op: Op) -> bool:
    """Whether ``op`` accumulates a gathered output (:func:`accumulate` with ``gathered``)."""
    return op.primitive is accumulate_p and op.params.get("gathered", False)


# How ops act on a stacked Variable's leading (layer) axis, split over tasks (``stacks.py``).
_ELEMENTWISE = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "pow",
        "integer_pow",
        "max",
        "min",
        "neg",
        "sign",
        "floor",
        "ceil",
        "round",
        "is_finite",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "atan2",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "sqrt",
        "rsqrt",
        "cbrt",
        "abs",
        "square",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "and",
        "or",
        "not",
        "xor",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "select_n",
        "clamp",
        "convert_element_type",
        "copy",
        "copy_p",
        "reduce_precision",
        "nextafter",
        "real",
        "imag",
        "conj",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "population_count",
        "clz",
        "mm_sharding_constraint",
        "mm_microbatch_accumulate",
        "mm_chain_in",
        "mm_chain_out",
        "mm_rng_base",
        "mm_rng_next",
    ]
)
_COMBINE = {
    "reduce_sum": jax.lax.add_p,
    "reduce_max": jax.lax.max_p,
    "reduce_min": jax.lax.min_p,
    "reduce_prod": jax.lax.mul_p,
    "reduce_and": jax.lax.and_p,
    "reduce_or": jax.lax.or_p,
}


def stack_rule(op: Op, split: Sequence[bool], in_shapes: Sequence[tuple]) -> str | None:
    """How ``op`` can run chunk by chunk when the operands marked ``split`` are split along
    their leading axis (the others are whole): ``"map"`` (each chunk's result is that chunk of
    the result), ``"reduce"`` (a reduction over the leading axis: per-chunk partials, then
    combined), ``"scan"`` (a scan over the split axis: one scan per chunk, the carry passed on),
    or ``None`` (it needs the whole array)."""
    name, p = op.name, op.params
    if name in _ELEMENTWISE:
        return "map"
    if name == "scan":
        first_x = p["num_consts"] + p["num_carry"]
        if any(split[:first_x]) or not any(split[first_x:]):
            return None
        return "scan"
    if name in _COMBINE:
        return "reduce" if 0 in p["axes"] else "map"
    if name in ("argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        axes = p["axes"] if "axes" in p else (p["axis"],)
        return None if 0 in axes else "map"
    if name == "broadcast_in_dim":
        dims = p["broadcast_dimensions"]
        return "map" if dims and dims[0] == 0 and in_shapes[0][0] == p["shape"][0] else None
    if name == "reshape":
        ok = p.get("dimensions") is None and p["new_sizes"][:1] == in_shapes[0][:1]
        return "map" if ok else None
    if name == "transpose":
        return "map" if p["permutation"][0] == 0 else None
    if name in ("squeeze", "rev"):
        return None if 0 in p["dimensions"] else "map"
    if name == "dot_general":
        (_, _), (lhs_batch, rhs_batch) = p["dimension_numbers"]
        return "map" if lhs_batch[:1] == (0,) and rhs_batch[:1] == (0,) else None
    return None


def is_constant_broadcast(op: Op) -> bool:
    """Whether ``op`` fills an array with one constant (``jnp.zeros``, ``jnp.full``)."""
    return op.name == "broadcast_in_dim" and all(
        isinstance(x, Const) and np.ndim(x.value) == 0 for x in op.ins
    )


def chunk_params(op: Op, size: int) -> dict:
    """``op``'s parameters for a chunk of ``size`` along the leading axis."""
    params = dict(op.params)
    if op.name == "broadcast_in_dim":
        params["shape"] = (size, *params["shape"][1:])
    elif op.name == "reshape":
        params["new_sizes"] = (size, *params["new_sizes"][1:])
    elif op.name == "scan":
        params["length"] = size
    return params


def scan_layout(op: Op) -> tuple[int, int, bool]:
    """A scan op's number of constant and carried operands, and whether it runs in reverse."""
    return op.params["num_consts"], op.params["num_carry"], bool(op.params["reverse"])


def combiner(op: Op) -> Any:
    """The binary primitive that combines partial results of a reduction op."""
    return _COMBINE[op.name]


def slice_leading(shape: Sequence[int], start: int, stop: int) -> tuple[Any, dict]:
    """The primitive and parameters slicing ``[start:stop]`` of an array's leading axis."""
    return jax.lax.slice_p, {
        "start_indices": (start, *(0 for _ in shape[1:])),
        "limit_indices": (stop, *shape[1:]),
        "strides": None,
    }


# State that a microbatched function updates, traced once (``mm.microbatch``; ``chains.py``).
# ``rng_base_p(count, index)`` is an RNG count as microbatch ``index`` starts:
# ``count + index * d``, ``d`` (the draws of one microbatch) known once the function is traced;
# ``rng_next_p(new)`` marks the count after one microbatch (the step's result: ``count + M * d``).
# ``chain_in_p(value)`` is a Variable's value as a microbatch starts (its input for the first, the
# previous microbatch's ``chain_out_p`` for the others); ``chain_out_p`` marks the value after.
rng_base_p = jcore.Primitive("mm_rng_base")
rng_base_p.def_abstract_eval(lambda count, index, *, group, slot: count)
rng_next_p = jcore.Primitive("mm_rng_next")
rng_next_p.def_abstract_eval(lambda new, *, group, slot: new)
chain_in_p = jcore.Primitive("mm_chain_in")
chain_in_p.def_abstract_eval(lambda x, *, group, slot: x)
chain_out_p = jcore.Primitive("mm_chain_out")
chain_out_p.def_abstract_eval(lambda x, *, group, slot: x)
for _p in (chain_in_p, chain_out_p):
    ad.deflinear2(_p, lambda ct, x, *, group, slot: [ct])


def rng_base(count, index, group: int, slot: int):
    """An RNG count as microbatch ``index`` of ``group`` starts (resolved after tracing)."""
    return rng_base_p.bind(count, index, group=group, slot=slot)


def rng_next(new, group: int, slot: int):
    """Marks an RNG count after one microbatch; the step's result is the count after all."""
    return rng_next_p.bind(new, group=group, slot=slot)


def chain_in(x, group: int, slot: int):
    """A Variable's value as a microbatch of ``group`` starts."""
    return chain_in_p.bind(x, group=group, slot=slot)


def chain_out(x, group: int, slot: int):
    """Marks a Variable's value after a microbatch; the step's result is the last one's."""
    return chain_out_p.bind(x, group=group, slot=slot)


def marker_kind(op: Op) -> str | None:
    """``"rng_base"``, ``"rng_next"``, ``"chain_in"`` or ``"chain_out"`` for those markers."""
    return {
        rng_base_p: "rng_base",
        rng_next_p: "rng_next",
        chain_in_p: "chain_in",
        chain_out_p: "chain_out",
    }.get(op.primitive)


def pruned_to(op: Op, out: int, graph: Graph) -> Op | None:
    """``op`` computing only its result ``out`` and reading only the inputs that needs, by
    JAX's dead-code rules (of a ``scan`` over layers, only the loop of ``out``); ``None`` if
    nothing is left to compute (``out`` is an input passed through)."""

    def var(value: Atom) -> jcore.Var:
        if isinstance(value, Const):
            return jcore.Var(jax.typeof(value.value))
        return jcore.Var(jax_core.ShapedArray(graph.shapes[value], graph.dtypes[value]))

    invars, outvars = [var(a) for a in op.ins], [var(v) for v in op.outs]
    eqn = jcore.new_jaxpr_eqn(
        invars, outvars, op.primitive, op.params, effects.no_effects, source_info_util.current()
    )
    kept, _ = pe.dce_jaxpr(jcore.Jaxpr([], invars, outvars, [eqn]), [v == out for v in op.outs])
    if len(kept.eqns) != 1:
        return None
    (new,) = kept.eqns
    position = {v: i for i, v in enumerate(invars)}
    ins = [op.ins[position[v]] if isinstance(v, jcore.Var) else Const(v.val) for v in new.invars]
    return dataclasses.replace(
        op.derived(new.primitive, dict(new.params), ins, [out]), index=op.index
    )


def count_ops(count: Op, index: Any, stride: Any, graph: Graph) -> list[Op]:
    """Ops computing ``count + index * stride`` (``stride`` a constant) in place of the
    ``rng_base`` marker ``count``: the same outputs, group and scope."""
    (out,) = count.outs
    dtype = graph.dtypes[out]
    shape = graph.shapes[out]
    cast = graph.new_value(((), dtype, itemsize(dtype)))
    step = graph.new_value((shape, dtype, math.prod(shape) * itemsize(dtype)))
    convert = {"new_dtype": np.dtype(dtype), "weak_type": False, "sharding": None}
    return [
        count.derived(jax.lax.convert_element_type_p, convert, [index], [cast]),
        count.derived(jax.lax.mul_p, {}, [cast, Const(np.asarray(stride, dtype))], [step]),
        count.derived(jax.lax.add_p, {}, [count.ins[0], step], [out]),
    ]


def offset_op(marker: Op, base: Any, offset: Any, graph: Graph) -> Op:
    """An op computing ``base + offset`` (``offset`` a constant) into ``marker``'s output."""
    (out,) = marker.outs
    return marker.derived(
        jax.lax.add_p, {}, [base, Const(np.asarray(offset, graph.dtypes[out]))], [out]
    )


def copier(source: Any, target: Any, ndim: int, dtype: Any) -> Callable[[Any], Any] | None:
    """A function moving an array laid out as ``source`` to ``target`` with one call into the
    runtime, skipping ``jax.device_put``'s Python layers, which cost several times the copy of a
    small activation (and, for a whole value onto more devices, fetch it to the host): either
    the same slicing on other devices of this process, or a whole (replicated) value onto the
    devices of another whole layout, each device that holds it already keeping its copy.
    ``None`` when the move is a reshard, leaves this process, or holds an extended dtype (a
    typed PRNG key), which ``jax.device_put`` does.

    Example:
        >>> from jax.sharding import SingleDeviceSharding
        >>> a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
        >>> move = copier(a, b, 1, np.float32)
        >>> move(jax.device_put(np.ones(3), a)).devices() == {jax.devices()[1]}
        True
    """
    from jax._src import array as jax_array  # noqa: PLC0415
    from jax._src.lib import xla_client  # noqa: PLC0415

    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return None
    if not target.is_fully_addressable or not source.is_fully_addressable:
        return None
    try:
        same = jax_array._sharding_indices_and_eq(source, target, ndim)
    except NotImplementedError:
        return None
    reuse = xla_client.ArrayCopySemantics.REUSE_INPUT
    batched = xla_client.batched_copy_array_to_devices_with_sharding
    if same:
        devices = target._internal_device_list.addressable_device_list

        def move(x: Any) -> Any:
            return batched([x], [devices], [target], [reuse])[0]

        return move
    if not (source.is_fully_replicated and target.is_fully_replicated):
        return None
    held = set(source._addressable_device_assignment)
    missing = [d for d in target._addressable_device_assignment if d not in held]
    alone = [SingleDeviceSharding(d) for d in missing]
    lists = [s._internal_device_list.addressable_device_list for s in alone]

    def spread(x: Any) -> Any:
        have = shards_by_device(x)
        if missing:
            whole = next(iter(have.values()))
            copies = batched([whole] * len(missing), lists, alone, [reuse] * len(missing))
            have.update(zip(missing, copies, strict=True))
        return array_from_shards(x.shape, target, have)

    return spread


@functools.lru_cache(maxsize=1024)
def _copier_of(source: Any, target: Any, ndim: int, dtype: Any) -> Callable[[Any], Any] | None:
    return copier(source, target, ndim, dtype)


def move_to(x: Any, target: Any) -> Any:
    """``x`` moved to the sharding ``target``: by one runtime copy (:func:`copier`, decided once
    per pair of layouts) where ``x`` is an array with the same slicing, else by
    ``jax.device_put``.

    Example:
        >>> from jax.sharding import SingleDeviceSharding
        >>> a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
        >>> move_to(jax.device_put(np.ones(3), a), b).devices() == {jax.devices()[1]}
        True
    """
    source = getattr(x, "sharding", None)
    if source is not None:
        move = _copier_of(source, target, x.ndim, x.dtype)
        if move is not None:
            return move(x)
    return jax.device_put(x, target)


def array_from_shards(shape: Sequence[int], sharding: Any, by_device: dict[Any, Any]) -> Any:
    """The array of ``shape`` laid out as ``sharding`` whose shard on each of this process's
    devices is ``by_device[device]`` (single-device arrays, committed, of one dtype): what
    ``jax.make_array_from_single_device_arrays`` makes, without re-checking each shard's dtype,
    device and order on every call (a stacked Variable's chunks are split and joined every step,
    and those checks cost several times the array's creation).

    Example:
        >>> from jax.sharding import SingleDeviceSharding
        >>> d = jax.devices()[0]
        >>> x = jax.device_put(np.ones(3, np.float32), d)
        >>> array_from_shards((3,), SingleDeviceSharding(d), {d: x}).shape
        (3,)
    """
    from jax._src import array as jax_array  # noqa: PLC0415

    arrays = [by_device[d] for d in sharding._addressable_device_assignment]
    if not arrays or jax.dtypes.issubdtype(arrays[0].dtype, jax.dtypes.extended):
        return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)
    aval = _sharded_aval(tuple(shape), arrays[0].dtype, sharding)
    return jax_array.ArrayImpl(aval, sharding, arrays, committed=True, _skip_checks=True)


def shards_by_device(array: Any) -> dict[Any, Any]:
    """``array``'s single-device arrays on this process's devices, by device: what
    ``{s.device: s.data for s in array.addressable_shards}`` gives, without making a ``Shard``
    (and its index) per device, which costs tens of microseconds for each new array.

    Example:
        >>> x = jax.device_put(np.ones(3, np.float32), jax.devices()[0])
        >>> list(shards_by_device(x)) == [jax.devices()[0]]
        True
    """
    arrays = getattr(array, "_arrays", None)
    if arrays is None:
        return {s.device: s.data for s in array.addressable_shards}
    return dict(zip(array.sharding._addressable_device_assignment, arrays, strict=True))


@functools.lru_cache(maxsize=4096)
def _sharded_aval(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Any:
    return jax_core.update_aval_with_sharding(
        jax_core.ShapedArray(shape, dtype, weak_type=False), sharding
    )


def _vars(atoms: Any) -> set:
    """The variables among jaxpr atoms (literals left out)."""
    return {a for a in atoms if isinstance(a, jcore.Var)}


@dataclasses.dataclass
class _ScanCut:
    """How a scan's body divides into the part computing the results needed now (``first``) and
    the part that can wait (``later``, fed the values it reads from the first part, stacked)."""

    first_outs: list[bool]  # per result of the scan: computed by the first part
    first_eqns: list[Any]
    later_eqns: list[Any]
    saved: list[Any]  # body values the later part reads from the first part, one per iteration
    first_operands: list[bool]  # per operand of the scan: read by the first part
    later_operands: list[bool]  # the same for the later part (which also reads ``saved``)


def _scan_cut(op: Op, wanted: Sequence[bool]) -> _ScanCut | None:
    """The cut of scan ``op`` whose first part makes the ``wanted`` results (and the carries
    they depend on); ``None`` when the op is no scan, has effects, the first part would be the
    whole body, or the rest holds no contraction (weight gradients of a matmul or convolution).

    Measured with ``benchmarks/pipeline.py``'s elementwise layers on a 16-core machine: cutting
    their backward scan (each layer's weight gradient a product and a sum) made the input
    gradient pass 25 ms against the whole backward's 29 ms and added a 27 ms weight pass,
    since the cut saves every layer's operands for the weight pass to read back."""
    if op.name != "scan" or op.effectful or op.mesh is not None:
        return None
    body = op.params["jaxpr"].jaxpr
    num_consts, num_carry = op.params["num_consts"], op.params["num_carry"]
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
    if not any(body.eqns[i].primitive.name in _COSTLY for i in later_eqns):
        return None  # elementwise weight gradients: saving their operands costs more than them
    later_made = {v for i in later_eqns for v in body.eqns[i].outvars}
    later_reads = _vars(a for i in later_eqns for a in body.eqns[i].invars) | _vars(later_roots)
    own = set(body.invars[:num_consts]) | set(body.invars[num_consts + num_carry :])
    own |= {carry_in[j] for j in range(num_carry) if not first[j]} | set(body.constvars)
    saved = [v for v in dict.fromkeys(later_reads) if v not in later_made and v not in own]
    first_reads = _vars(a for i in eqns for a in body.eqns[i].invars) | set(saved)
    first_reads |= _vars(v for v, w in zip(body.outvars, first, strict=True) if w)

    def operands(reads: set, carries: Sequence[bool]) -> list[bool]:
        """Per operand of the scan: whether a part reading ``reads`` and carrying ``carries``
        takes it (every carry it updates; the constants and scanned operands it reads)."""
        flags = [v in reads for v in body.invars]
        flags[num_consts : num_consts + num_carry] = carries
        return flags

    return _ScanCut(
        first,
        [e for i, e in enumerate(body.eqns) if i in eqns],
        [e for i, e in enumerate(body.eqns) if i in later_eqns],
        saved,
        operands(first_reads, first[:num_carry]),
        operands(later_reads, [not c for c in first[:num_carry]]),
    )


def scan_first_part(op: Op, wanted: Sequence[bool]) -> tuple[list[bool], list[bool]] | None:
    """For a scan ``op`` of whose results only those flagged in ``wanted`` are needed soon (an
    input gradient), the results its first part makes (``wanted`` and the carries they depend
    on) and the operands that part reads; ``None`` when the scan does not split
    (:func:`split_scan`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def f(w, xs):  # the carry needs only xs; the second result also reads w
        ...     return jax.lax.scan(lambda c, x: (c + x, jnp.tanh(c) @ w), jnp.zeros(2), xs)
        >>> graph = to_graph(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((3, 2))))
        >>> scan_first_part(graph.ops[-1], [True, False])
        ([True, False], [False, True, True])
    """
    cut = _scan_cut(op, wanted)
    return None if cut is None else (cut.first_outs, cut.first_operands)


def split_scan(op: Op, wanted: Sequence[bool], graph: Graph) -> tuple[Op, Op] | None:
    """Scan ``op`` as two scans (zero-bubble's split of a backward pass run as a scan, e.g. over
    ``nnx.scan`` layers or chunks): the first makes the ``wanted`` results (and the carries they
    depend on) and saves, per iteration, the values the rest reads from it; the second makes
    the other results (weight gradients) from those. The first's extra results are new values
    of ``graph``. ``None`` when the scan does not split.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def f(w, xs):  # the carry first; then the matmul, from the carries it saved
        ...     return jax.lax.scan(lambda c, x: (c + x, jnp.tanh(c) @ w), jnp.zeros(2), xs)
        >>> graph = to_graph(jax.make_jaxpr(f)(jnp.ones((2, 2)), jnp.ones((3, 2))))
        >>> first, later = split_scan(graph.ops[-1], [True, False], graph)
        >>> [graph.shapes[v] for v in first.outs], [graph.shapes[v] for v in later.outs]
        ([(2,), (3, 2)], [(3, 2)])
    """
    cut = _scan_cut(op, wanted)
    if cut is None:
        return None
    closed = op.params["jaxpr"]
    body = closed.jaxpr
    length = op.params["length"]
    num_consts, num_carry = op.params["num_consts"], op.params["num_carry"]
    first_outs = cut.first_outs
    carry_first = first_outs[:num_carry]

    def scan(ins: list, eqns: list, invars: list, outvars: list, carries: int, consts: int) -> dict:
        """The parameters of a scan running ``eqns`` of the body."""
        part = body.replace(
            invars=invars,
            outvars=outvars,
            eqns=eqns,
            effects=jax_core.join_effects(*(e.effects for e in eqns)),
        )
        params = {
            **op.params,
            "jaxpr": jcore.ClosedJaxpr(part, closed.consts),
            "num_consts": consts,
            "num_carry": carries,
        }
        if "linear" in params:  # older JAX versions
            params["linear"] = (False,) * len(ins)
        return params

    pick = cut.first_operands
    first_invars = [v for v, p in zip(body.invars, pick, strict=True) if p]
    first_ins = [a for a, p in zip(op.ins, pick, strict=True) if p]
    first_outvars = [v for v, w in zip(body.outvars, first_outs, strict=True) if w] + cut.saved
    saved_ids = [
        graph.new_value(_aval_info(jax_core.ShapedArray((length, *v.aval.shape), v.aval.dtype)))
        for v in cut.saved
    ]
    first_params = scan(
        first_ins,
        cut.first_eqns,
        first_invars,
        first_outvars,
        sum(carry_first),
        sum(pick[:num_consts]),
    )
    first = op.derived(
        op.primitive,
        first_params,
        first_ins,
        [v for v, w in zip(op.outs, first_outs, strict=True) if w] + saved_ids,
    )

    keep = cut.later_operands
    later_invars = [v for v, k in zip(body.invars, keep, strict=True) if k] + cut.saved
    later_ins = [a for a, k in zip(op.ins, keep, strict=True) if k] + saved_ids
    later_params = scan(
        later_ins,
        cut.later_eqns,
        later_invars,
        [v for v, w in zip(body.outvars, first_outs, strict=True) if not w],
        num_carry - sum(carry_first),
        sum(keep[:num_consts]),
    )
    later = op.derived(
        op.primitive,
        later_params,
        later_ins,
        [v for v, w in zip(op.outs, first_outs, strict=True) if not w],
    )
    return first, later


# Compiling a program once for every submesh of its shape. The programs of equal pipeline stages
# (the middle blocks of a transformer) differ only in the devices they run on, which XLA takes
# as a compile option, not as part of the program: the first is compiled, the others load its
# executable onto their own devices (JAX's persistent cache does the same on GPU, and only there,
# where it leaves the device assignment out of its key). JAX calls ``compile_or_get_cached``
# through its module, so the wrapper below sees every compilation; it acts only on the threads
# of a ``SharedCompiles`` table, and falls back to compiling where loading fails. Only an
# executable compiled in this process is handed on: one read from JAX's persistent cache
# serializes incompletely on XLA:CPU (its kernels missing: measured 5.7 kB of 10 kB).
_compiling_for = threading.local()


class SharedCompiles:
    """The executables compiled so far in one ``compile`` of a step, by program and device-free
    compile options; ``compile(lowered)`` compiles a ``jax.stages.Lowered`` through it.

    Example:
        >>> shared = SharedCompiles()
        >>> on = lambda d: jax.sharding.SingleDeviceSharding(d)
        >>> one, two = (jax.jit(lambda x: x + 1, in_shardings=on(d)).lower(np.float32(0))
        ...             for d in jax.devices()[:2])
        >>> shared.compile(one)(jax.device_put(1.0, on(jax.devices()[0]))), shared.loaded
        (Array(2., dtype=float32), 0)
        >>> out = shared.compile(two)(jax.device_put(1.0, on(jax.devices()[1])))
        >>> float(out), out.devices() == {jax.devices()[1]}, shared.loaded
        (2.0, True, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[tuple, Any] = {}
        self.loaded = 0
        self.loaded_lowered: set[int] = set()  # ids of the Lowered objects loaded, not compiled
        _install_shared_compiles()

    def compile(self, lowered: Any) -> Any:
        _compiling_for.table = self
        _compiling_for.loaded = False
        try:
            compiled = lowered.compile()
        finally:
            _compiling_for.table = None
        if _compiling_for.loaded:
            with self._lock:
                self.loaded_lowered.add(id(lowered))
        return compiled

    def executable(
        self,
        compile: Callable,
        backend: Any,
        computation: Any,
        devices: np.ndarray,
        options: Any,
        host_callbacks: Sequence,
        executable_devices: Any,
        *rest: Any,
    ) -> Any:
        own = functools.partial(compile, backend, computation, devices, options, host_callbacks,
                                executable_devices, *rest)  # fmt: skip
        if host_callbacks or len({d.process_index for d in devices.flat}) > 1:
            return own()
        key = (backend.platform, devices.shape, mlir.module_to_bytecode(computation),
               _without_devices(options))  # fmt: skip
        with self._lock:
            first = self._first.get(key)
            mine = first is None
            if mine:
                first = self._first[key] = concurrent.futures.Future()
        if mine:
            _compiling_for.fresh = False
            started = time.monotonic()
            try:
                executable = own()
            except BaseException as e:
                first.set_exception(e)
                raise
            took = time.monotonic() - started
            # serialized once, for every program loading it; not one read from JAX's persistent
            # cache, which XLA:CPU serializes without its kernels
            serialized = functools.cache(lambda: backend.serialize_executable(executable))
            first.set_result((serialized, took) if _compiling_for.fresh else None)
            return executable
        try:
            serialized, took = first.result() or (None, 0.0)
            if serialized is None:
                raise LookupError
            executable = backend.deserialize_executable(serialized(), executable_devices, options)
        except Exception:  # the first failed, was read from the cache, or does not serialize here
            return own()
        _persist(backend, computation, devices, options, serialized(), took)
        with self._lock:
            self.loaded += 1
        _compiling_for.loaded = True
        return executable


@dataclasses.dataclass(frozen=True)
class _Serialized:
    """An executable's bytes, as JAX's persistent cache takes an executable to write."""

    data: bytes

    def serialize(self) -> bytes:
        return self.data


def _persist(
    backend: Any, computation: Any, devices: np.ndarray, options: Any, data: bytes, took: float
) -> None:
    """Writes a loaded program to JAX's persistent compilation cache, if one is on, under its
    own key, as JAX writes a program it compiled: a later process then reads it instead of
    compiling it. ``data``: the executable it was loaded from, as compiled (an executable
    loaded from bytes re-serializes without its kernels on XLA:CPU); ``took``: that compile's
    seconds, which JAX's ``persistent_cache_min_compile_time_secs`` is checked against."""
    from jax._src import compiler

    name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
    lowest = min(devices.flat, key=lambda d: d.id).process_index
    try:
        key, _ = compiler._resolve_compilation_strategy(
            computation, devices, options, backend, None, False, name, lowest
        )
        if key is not None:
            compiler._cache_write(key, took, name, backend, _Serialized(data), [])
    except Exception:  # no cache entry: the next process compiles this program, as before
        return


def _without_devices(options: Any) -> bytes:
    """``options`` (an XLA ``CompileOptions``) serialized with the device assignment numbered
    0, 1, ... in place of the devices' ids."""
    from jax._src.lib import xla_client

    stripped = xla_client.CompileOptions.ParseFromString(options.SerializeAsString())
    if stripped.device_assignment is not None:
        assignment = stripped.device_assignment
        shape = (assignment.replica_count(), assignment.computation_count())
        ids = np.arange(math.prod(shape)).reshape(shape)
        stripped.device_assignment = xla_client.DeviceAssignment.create(ids)
    return stripped.SerializeAsString()


@functools.cache
def _install_shared_compiles() -> None:
    from jax._src import compiler

    compile = compiler.compile_or_get_cached

    @functools.wraps(compile)
    def compile_or_share(*args: Any, **kwargs: Any) -> Any:
        table = getattr(_compiling_for, "table", None)
        if table is None or kwargs:
            return compile(*args, **kwargs)
        return table.executable(compile, *args)

    compiler.compile_or_get_cached = compile_or_share
    backend_compile = compiler.backend_compile_and_load

    @functools.wraps(backend_compile)
    def compile_fresh(*args: Any, **kwargs: Any) -> Any:
        _compiling_for.fresh = True
        return backend_compile(*args, **kwargs)

    compiler.backend_compile_and_load = compile_fresh


# A program's launch without JAX's per-call checks (``jax.stages.Compiled.__call__`` checks each
# argument's type, shape and layout, about 0.2 us an argument, and wraps each result). The runner
# uses it only for a step whose every argument was found laid out as its program expects on a
# checked run, and whose inputs are laid out as on that run (so, step by step, is every value).
@dataclasses.dataclass(frozen=True)
class DirectLaunch:
    """``compiled`` (a ``jax.stages.Compiled``) run straight on the runtime: ``launch(args)``
    takes the arguments at positions ``kept`` (``None``: all; JAX drops those the program does
    not read), each laid out as ``shardings`` says, and returns the results as a list.

    Example:
        >>> on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        >>> x = jax.device_put(np.float32(1), on)
        >>> direct = DirectLaunch.of(jax.jit(lambda x, y: [y + 1]).lower(x, x).compile())
        >>> direct.kept, direct.shardings == (on,)
        ((1,), True)
        >>> direct.launch([x])
        [Array(2., dtype=float32)]
    """

    launch: Callable[[list], list]
    kept: tuple[int, ...] | None
    shardings: tuple[Any, ...]

    @classmethod
    def of(cls, compiled: Any) -> DirectLaunch | None:
        """The direct launch of ``compiled``, or ``None`` where JAX's own call is needed: a
        program with effects or host callbacks, constants passed as arguments, or results
        that are not a flat sequence of arrays."""
        executable = getattr(compiled, "_executable", None)
        call = getattr(executable, "unsafe_call", None)
        params = getattr(compiled, "_params", None)
        if (
            type(call) is not pxla.ExecuteReplicated
            or call.ordered_effects
            or call.has_unordered_effects
            or call.has_host_callbacks
            or call.mut is not None
            or call.pgle_profiler is not None
            or params is None
            or params.const_args
            or params.is_high
        ):
            return None
        out_tree = params.out_tree
        if out_tree.num_leaves != out_tree.num_nodes - 1 or out_tree.num_nodes == 1:
            return None  # a flat list or tuple of arrays only
        kept = tuple(sorted(call.kept_var_idx))
        shardings = tuple(executable._in_shardings)  # of the kept arguments
        if len(shardings) != len(kept):
            return None
        runtime, handlers = call.xla_executable, call.out_handler.handlers

        def launch(args: list) -> list:
            return runtime.execute_sharded(args).consume_with_handlers(handlers)

        whole = kept == tuple(range(params.in_tree.num_leaves))
        return cls(launch, None if whole else kept, shardings)


def launchable_as(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is a plain ``jax.Array`` whose per-device arrays a program expecting
    ``sharding`` reads as they are: laid out as ``sharding`` (another name for the same slices
    on the same devices, such as a one-device array for a one-device mesh, counts) and listing
    its devices in the same order.

    Example:
        >>> one = jax.devices()[:1]
        >>> mesh = jax.sharding.Mesh(np.array(one), ("x",))
        >>> x = jax.device_put(np.ones(2), one[0])
        >>> launchable_as(x, NamedSharding(mesh, jax.P())), launchable_as(np.ones(2), x.sharding)
        (True, False)
    """
    if type(x) is not ArrayImpl:
        return False
    have = x.sharding
    return have == sharding or (
        have.is_equivalent_to(sharding, x.ndim)
        and have._addressable_device_assignment == sharding._addressable_device_assignment
    )


def is_plain_array(x: Any) -> bool:
    """Whether ``x`` is JAX's own array type (not a tracer, NumPy array or subclass).

    Example:
        >>> is_plain_array(jax.numpy.ones(2)), is_plain_array(np.ones(2))
        (True, False)
    """
    return type(x) is ArrayImpl


def all_plain_arrays(values: Sequence[Any]) -> bool:
    """Whether every one of ``values`` is JAX's own array type (:func:`is_plain_array`), checked
    at a few hundredths of a microsecond each (``isinstance(x, jax.Array)`` takes ten times as
    long).

    Example:
        >>> all_plain_arrays([jax.numpy.ones(2), jax.numpy.zeros(1)]), all_plain_arrays([1.0])
        (True, False)
    """
    return all(type(x) is ArrayImpl for x in values)


def checks_special_values() -> bool:
    """Whether JAX checks results for NaN or infinity (``jax_debug_nans``/``jax_debug_infs``),
    which only its own call does.

    Example:
        >>> checks_special_values()
        False
    """
    return dispatch.needs_check_special()
