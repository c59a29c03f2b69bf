"""JAX's tracing, as far as JAX does not export it: whether a trace is in progress, the debug
info that names a traced function in JAX's errors, the user's line of a source location, an
equation's ordered effects, dead-code elimination of a jaxpr, and a cheap ``sharding`` probe
on tracers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import api_util, config, effects, source_info_util
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe

ShapedArray = jax_core.ShapedArray
"""JAX's abstract array (shape, dtype, weak type, sharding)."""

no_effects = effects.no_effects
"""The effects of an equation that has none."""

join_effects = jax_core.join_effects
"""The union of several equations' effects."""

JaxprTracer = pe.DynamicJaxprTracer
"""The type of the values a jaxpr trace (``jax.make_jaxpr``, ``jax.jit``) makes."""


def trace_context() -> Any:
    """The configuration a trace and its lowering depend on, as JAX keys its own caches."""
    return config.trace_context()


def tracing() -> bool:
    """Whether a JAX trace (``jit``, ``grad``, ``vmap``, ``make_jaxpr``, ...) is in progress."""
    return not jax_core.trace_state_clean()


def name_trace_as(
    fun: Callable, name_as: Callable, traced_for: str, arg_names: Sequence[str] | None
) -> None:
    """Makes JAX's tracing errors describe a trace of ``fun`` as one of ``name_as`` (its name and
    line) for ``traced_for`` (``"mm.jit"``), with inputs named ``arg_names``."""
    names = None if arg_names is None else tuple(arg_names)
    info = jax_core.DebugInfo(
        traced_for, api_util.fun_sourceinfo(name_as), names, jax_core.initial_result_paths
    )
    api_util.save_wrapped_fun_debug_info(fun, info)


def debug_info(traced_for: str, what: str) -> Any:
    """The debug info of a jaxpr built by hand, naming it ``what`` for ``traced_for`` in JAX's
    messages (no argument or result names)."""
    return jax_core.DebugInfo(traced_for, what, None, None)


def current_source_info() -> Any:
    """The source info JAX gives an equation made now (the current name stack and frame)."""
    return source_info_util.current()


def source_line(source_info: Any) -> str:
    """``file:line (function)`` of the user's frame where an equation was traced."""
    return user_line(source_info.traceback)


def user_line(traceback: Any) -> str:
    """``file:line (function)`` of the innermost user frame of a traceback, or ``"<unknown>"``."""
    frame = source_info_util.user_frame(traceback)
    if frame is None:
        return "<unknown>"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def ordered_effects(eqn: Any) -> list:
    """The effects of ``eqn`` that JAX keeps in program order."""
    return [e for e in eqn.effects if effects.ordered_effects.contains(e)]


def dce_jaxpr(
    jaxpr: Any, used_outputs: Sequence[bool], instantiate: bool | Sequence[bool] = False
) -> tuple[Any, list[bool]]:
    """JAX's ``dce_jaxpr``: ``jaxpr`` with only what ``used_outputs`` need, and the inputs it
    reads."""
    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate=instantiate)


CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
"""Call-like primitives, whose bodies a caller may splice in."""


def inline_calls(closed: Any) -> Any:
    """``closed`` (a ``ClosedJaxpr``) with its nested calls (:data:`CALLS`) spliced in, at any
    depth, retraced; ``closed`` itself when it makes no call or does not retrace. JAX 0.11
    keeps the ``jit`` of a function called while tracing (optax's ``tree_bias_correction``) as
    one equation, where 0.10 spliced it in.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(1.0)
        >>> [e.primitive.name for e in inline_calls(closed).eqns]
        ['sin', 'mul']
    """
    if not any(e.primitive.name in CALLS for e in closed.jaxpr.eqns):
        return closed

    def run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env |= dict(zip(jaxpr.invars, args, strict=True))
        read = lambda v: v.val if isinstance(v, jax_core.Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name in CALLS and "jaxpr" in eqn.params:
                inner = eqn.params["jaxpr"]
                outs = run(inner.jaxpr, inner.consts, ins)
            else:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
            env |= dict(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    avals = [v.aval for v in closed.jaxpr.invars]
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    try:
        return jax.make_jaxpr(lambda *args: run(closed.jaxpr, closed.consts, args))(*shapes)
    except Exception:  # a primitive that does not bind again as traced: the calls stay
        return closed


def _no_sharding(tracer: Any) -> Any:
    raise AttributeError(f"The 'sharding' attribute is not available on {type(tracer).__name__}")


@contextlib.contextmanager
def fast_sharding_probes():
    """Makes ``getattr(tracer, "sharding", None)`` cheap while tracing: Flax probes every value set
    into a Variable so, and JAX's ``AttributeError`` walks the whole trace to say where the tracer
    came from, quadratic in a model's size (benchmarks/init.py)."""
    original = jax_core.Tracer.sharding
    jax_core.Tracer.sharding = property(_no_sharding)
    try:
        yield
    finally:
        jax_core.Tracer.sharding = original
