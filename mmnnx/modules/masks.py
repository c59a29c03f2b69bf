"""``causal_mask``: which keys each query sees, by positions, with an optional sliding window."""

from __future__ import annotations

import jax


def causal_mask(
    query_positions: jax.Array, key_positions: jax.Array, sliding_window: int | None = None
) -> jax.Array:
    """Bool ``(..., q, k)``: query ``i`` sees key ``j`` when ``j <= i`` and, with a
    ``sliding_window`` ``w``, ``i - w < j`` (as transformers); positions broadcast.

    Example:
        >>> import jax.numpy as jnp
        >>> causal_mask(jnp.arange(4), jnp.arange(4), sliding_window=2).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    """
    queries, keys = query_positions[..., :, None], key_positions[..., None, :]
    visible = keys <= queries
    if sliding_window is not None:
        visible = visible & (keys > queries - sliding_window)
    return visible
