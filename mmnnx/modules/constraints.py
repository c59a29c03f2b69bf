"""``constrain``: a logical sharding constraint that is active only inside ``mm.jit``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from mmnnx.mpmd.trace.annotations import with_sharding_constraint
from mmnnx.mpmd.trace.trace_state import current_trace

T = TypeVar("T")


def constrain(x: T, names: Sequence[str | None]) -> T:
    """Constrains ``x`` to logical axis ``names`` inside ``mm.jit``; returns it unchanged elsewhere.

    Inside an ``mm.jit`` trace this is ``mm.with_sharding_constraint(x, names)``: each name is
    translated by the ``logical_axes`` of the task that runs the op (``"batch"`` -> ``"data"``, a
    name no rule maps is replicated). Outside ``mm.jit`` (eagerly, under ``nnx.jit`` or
    ``jax.jit``, on one device) there are no tasks to translate the names, so ``x`` is returned
    as is; modules that call it run anywhere.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((2, 3, 4))
        >>> constrain(x, ("batch", "seq", "embed")) is x
        True
    """
    return x if current_trace() is None else with_sharding_constraint(x, tuple(names))
