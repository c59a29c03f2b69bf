"""``constrain``: a logical sharding constraint that is active only inside ``mm.jit``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from mmnnx.mpmd.trace.annotations import with_sharding_constraint
from mmnnx.mpmd.trace.trace_state import current_trace

T = TypeVar("T")


def constrain(x: T, names: Sequence[str | None]) -> T:
    """``mm.with_sharding_constraint(x, names)`` inside ``mm.jit`` (the names translated by the
    running task's rules); ``x`` unchanged elsewhere, so modules calling it run anywhere.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.ones((2, 3, 4))
        >>> constrain(x, ("batch", "seq", "embed")) is x
        True
    """
    return x if current_trace() is None else with_sharding_constraint(x, tuple(names))
