"""Ops of the flat IR as JAX calls: a list of ops evaluated (inside ``jax.jit``, a fragment's
program), and one op pruned to a single result by JAX's dead-code rules."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
from jax.extend import core as jcore

from mmnnx._jax.tracing import (
    ShapedArray,
    current_source_info,
    dce_jaxpr,
    debug_info,
    no_effects,
)
from mmnnx.mpmd.ir import Atom, Const, Graph, Op


def run_ops(ops: Sequence[Op], in_ids: Sequence[int], out_ids: Sequence[int], args) -> list:
    """Evaluates ``ops`` on ``args`` bound to ``in_ids``; returns ``out_ids``' values."""
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


def pruned_to(op: Op, out: int, graph: Graph) -> Op | None:
    """``op`` computing only its result ``out`` by JAX's dead-code rules, reading only what that
    needs; ``None`` if nothing is left to compute."""

    def var(value: Atom) -> jcore.Var:
        if isinstance(value, Const):
            return jcore.Var(jax.typeof(value.value))
        return jcore.Var(ShapedArray(graph.shapes[value], graph.dtypes[value]))

    invars, outvars = [var(a) for a in op.ins], [var(v) for v in op.outs]
    eqn = jcore.new_jaxpr_eqn(
        invars, outvars, op.primitive, op.params, no_effects, current_source_info()
    )
    jaxpr = jcore.Jaxpr([], invars, outvars, [eqn], debug_info=debug_info("mm.jit", op.name))
    kept, _ = dce_jaxpr(jaxpr, [v == out for v in op.outs])
    if len(kept.eqns) != 1:
        return None
    (new,) = kept.eqns
    position = {v: i for i, v in enumerate(invars)}
    ins = [op.ins[position[v]] if isinstance(v, jcore.Var) else Const(v.val) for v in new.invars]
    return dataclasses.replace(
        op.derived(new.primitive, dict(new.params), ins, [out]), index=op.index
    )
