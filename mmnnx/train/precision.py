"""Low-precision parameters and optimizer state, as optax transformations around any optimizer:
:func:`master_weights` keeps float32 copies of bfloat16 parameters for the updates to land on;
:func:`cast_state` stores an optimizer's state (Adam's moments) in bfloat16 between steps.
Both work with any model and ``nnx.Optimizer``; ``make_optimizer`` composes them from a
``TrainConfig`` (``param_dtype``, ``optimizer_dtype``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

DTYPES = ("float32", "bfloat16")
"""The dtypes ``TrainConfig.param_dtype`` and ``optimizer_dtype`` take."""


class MasterState(NamedTuple):
    """The state of :func:`master_weights`: the parameters' wide copies, and the state of the
    optimizer that updates them.

    Example:
        >>> state = master_weights(optax.sgd(0.1)).init({"w": jnp.ones(2, jnp.bfloat16)})
        >>> state.master["w"].dtype
        dtype('float32')
    """

    master: Any  # the parameters in the master dtype (float32), what the updates land on
    inner: Any  # the wrapped optimizer's state, for the master copies


def _floating(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating leaves in ``dtype`` (the others as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if _floating(x) else x, tree)


def master_weights(
    tx: optax.GradientTransformation, dtype: Any = jnp.float32
) -> optax.GradientTransformation:
    """``tx`` run on ``dtype`` (float32) master copies of the parameters, for parameters kept
    in a narrower dtype (bfloat16): the forward and backward read the narrow parameters, the
    gradients are widened, ``tx`` updates the master copies (its state, e.g. Adam's moments,
    made for them: float32 unless :func:`cast_state` says otherwise), and each parameter
    becomes its master rounded to its own dtype. An update below half of a bfloat16
    parameter's spacing (1e-3 on a weight of 1, where bfloat16's spacing is 2**-7) is lost when
    added to the parameter itself; the master accumulates it.

    The returned updates are ``round(master) - param``, in ``dtype``, so that
    ``optax.apply_updates`` (as ``nnx.Optimizer.update`` calls it) makes each parameter exactly
    its rounded master (exactly, unless a parameter shrinks by more than 2**14 in one update).
    A parameter that no longer rounds from its master (set outside the optimizer, e.g. loaded
    from a checkpoint of other weights) restarts its master from its own value. The state
    (:class:`MasterState`) holds the master copies: a checkpoint of the optimizer saves them.
    Parameters already in ``dtype`` get a master too (a copy): wrap only the optimizer of
    narrow parameters.

    Example:
        >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> tx = master_weights(optax.sgd(1e-3))
        >>> state = tx.init(params)
        >>> for _ in range(10):  # each step's 1e-3 is below bfloat16's spacing at 1 (2**-7)
        ...     updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"].dtype, float(params["w"][0]), round(float(state.master["w"][0]), 4)
        (dtype(bfloat16), 0.98828125, 0.99)
        >>> lost = optax.sgd(1e-3)  # without masters, every update rounds away
        >>> float(optax.apply_updates({"w": jnp.ones(2, jnp.bfloat16)},
        ...     lost.update({"w": jnp.ones(2, jnp.bfloat16)}, lost.init(params))[0])["w"][0])
        1.0
    """
    dtype = jnp.dtype(dtype)

    def init(params: Any) -> MasterState:
        master = _cast(params, dtype)
        return MasterState(master, tx.init(master))

    def update(grads: Any, state: MasterState, params: Any = None) -> tuple[Any, MasterState]:
        if params is None:
            raise ValueError(
                "master_weights: update needs the parameters (tx.update(grads, state, params); "
                "nnx.Optimizer passes them)"
            )
        master = jax.tree.map(_resync, state.master, params)
        steps, inner = tx.update(_cast(grads, dtype), state.inner, master)
        master = optax.apply_updates(master, steps)
        updates = jax.tree.map(_to_rounded, master, params)
        return updates, MasterState(master, inner)

    def _resync(master: jax.Array, param: jax.Array) -> jax.Array:
        if not _floating(param):
            return master
        rounds_to_param = master.astype(param.dtype) == param
        return jnp.where(rounds_to_param, master, param.astype(dtype))

    def _to_rounded(master: jax.Array, param: jax.Array) -> jax.Array:
        if not _floating(param):
            return jnp.zeros_like(param)
        return master.astype(param.dtype).astype(dtype) - param.astype(dtype)

    return optax.GradientTransformation(init, update)


def cast_state(tx: optax.GradientTransformation, dtype: Any) -> optax.GradientTransformation:
    """``tx`` with the floating leaves of its state (Adam's moments) stored in ``dtype``
    (bfloat16: half the bytes) between steps: each update widens them to the dtypes ``tx``
    makes them in, runs ``tx``, and stores the new state narrow again. Counts and other integer
    state are kept as they are.

    Example:
        >>> tx = cast_state(optax.adam(1e-3), jnp.bfloat16)
        >>> params = {"w": jnp.zeros(3)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
        >>> state[0].mu["w"].dtype, state[0].count.dtype, updates["w"].dtype
        (dtype(bfloat16), dtype('int32'), dtype('float32'))
    """
    dtype = jnp.dtype(dtype)

    def init(params: Any) -> Any:
        return _cast(tx.init(params), dtype)

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        made = jax.eval_shape(tx.init, updates if params is None else params)
        wide = jax.tree.map(lambda s, m: s.astype(m.dtype), state, made)
        updates, state = tx.update(updates, wide, params)
        return updates, _cast(state, dtype)

    return optax.GradientTransformation(init, update)
