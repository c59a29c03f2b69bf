"""The engine's own primitives, recorded while mm.jit traces a step: the logical sharding constraint
and the markers of an ``mm.microbatch`` call traced once, with their tests."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from mmnnx._jax.tracing import user_line
from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.sharding.specs import itemsize

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
    where = user_line(ctx.traceback)
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
