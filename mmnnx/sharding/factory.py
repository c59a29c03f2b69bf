"""Tracing a model factory once (``mm.init``): the model built abstractly, and the computation
of the arrays it holds, whatever attributes hold them (Variables of any type, arrays kept as
``nnx.data``, in lists and dicts, or in modules held in lists and dicts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.extend import core as jcore

from mmnnx._jax.tracing import JaxprTracer, fast_sharding_probes
from mmnnx._nnx import is_variable, outside_state_error, taken_as_data
from mmnnx.sharding.rules import Path, path_str


class TracedFactory(NamedTuple):
    """A factory traced once."""

    model: Any  # built abstractly: each computed array is a jax.ShapeDtypeStruct
    jaxpr: jcore.ClosedJaxpr  # no inputs; one output per computed array
    outputs: list[Path]  # the computed arrays' paths in the model, in output order


def trace_factory(factory: Callable[[], Any]) -> TracedFactory:
    """``factory()`` traced once: the arrays it makes are computed later from the trace, the rest
    kept as made."""
    made = []

    def build():
        with nnx.use_eager_sharding(False):
            built = factory()
        graphdef, state = nnx.split(built)
        flat = list(nnx.to_flat_state(state))
        made.append((graphdef, flat))
        return [value for _, value in _computed(flat)]

    try:
        with fast_sharding_probes(), taken_as_data(JaxprTracer):
            jaxpr, shapes = jax.make_jaxpr(build, return_shape=True)()
    except Exception as e:
        what = outside_state_error(e)
        if what is None:
            raise
        raise ValueError(
            f"mm.init: the factory changes {what} created outside it; mm.init traces "
            "the factory once and computes it from that trace, so it must create its own "
            "state: build the nnx.Rngs inside it, e.g. mm.init(lambda: Model(rngs=nnx.Rngs(0)), "
            "rules), not mm.init(lambda: Model(rngs=rngs), rules)"
        ) from e
    graphdef, flat = made[-1]
    outputs = [path for path, _ in _computed(flat)]
    shape_at = dict(zip(outputs, shapes, strict=True))
    state = nnx.from_flat_state([(p, _abstract(leaf, shape_at.get(p))) for p, leaf in flat])
    return TracedFactory(model=nnx.merge(graphdef, state), jaxpr=jaxpr, outputs=outputs)


def _computed(flat: list[tuple[Path, Any]]) -> list[tuple[Path, jax.Array]]:
    """The leaves of a traced model's flat state whose value is a (traced) jax array."""
    found = []
    for path, leaf in flat:
        value = leaf.get_value() if is_variable(leaf) else leaf
        if isinstance(value, jax.Array):
            found.append((path, value))
        elif any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(value)):
            raise TypeError(
                f"mm.init: Variable {path_str(path)!r} holds a {type(value).__name__} of traced "
                "arrays; mm.init builds Variables that hold one array (or a value made without "
                "jax): give each array a Variable of its own"
            )
    return found


def _abstract(leaf: Any, shape: jax.ShapeDtypeStruct | None) -> Any:
    """A flat-state leaf, its value replaced by ``shape`` (``None``: kept), out of the trace."""
    if is_variable(leaf):
        return leaf.replace() if shape is None else leaf.replace(shape)
    return leaf if shape is None else shape
