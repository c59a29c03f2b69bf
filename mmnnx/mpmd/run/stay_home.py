"""State on no task (metrics, an ``nnx.Rngs`` passed in, a step counter) goes back to the
devices it was on before the step, wherever the step computed its new value: values of one
object (a key and its count, a metric's total and count) stay together for eager code."""

from __future__ import annotations

from typing import Any

import jax

from mmnnx._jax.arrays import move_to, shards_by_device


def stay_home(old: Any, new: Any) -> Any:
    """``new`` (a step's result) on the devices and layout of ``old`` (the value it replaces).

    Example:
        >>> import jax.numpy as jnp
        >>> old = jax.device_put(jnp.zeros(2), jax.devices()[1])
        >>> new = jax.device_put(jnp.ones(2), jax.devices()[0])
        >>> [d.id for d in stay_home(old, new).devices()]
        [1]
    """
    if not isinstance(old, jax.Array) or new is old or new.sharding == old.sharding:
        return new
    home = old.sharding.device_set
    if len(home) == 1 and new.sharding.is_fully_replicated and home <= new.sharding.device_set:
        (device,) = home  # a replica is already there: take it, no copy
        return shards_by_device(new)[device]
    return move_to(new, old.sharding)
