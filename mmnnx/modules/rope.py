"""Rotary position embeddings (RoPE), half-split layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(
    x: jax.Array, positions: jax.Array | None = None, *, base: float = 10000.0
) -> jax.Array:
    """Rotates ``x`` of shape ``(..., seq, heads, head_dim)`` by its positions (RoPE).

    Feature ``i`` and feature ``i + head_dim // 2`` form a pair that is rotated by the angle
    ``position * base ** (-2 * i / head_dim)``. The dot product of a rotated query and key then
    depends only on their position difference. ``positions`` (shape ``(seq,)`` or broadcastable
    to ``x.shape[:-2]``) defaults to ``0 .. seq - 1``.

    Example:
        >>> x = jnp.ones((1, 3, 2, 4))  # batch, seq, heads, head_dim
        >>> y = apply_rope(x)
        >>> y.shape, bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0 is not rotated
        ((1, 3, 2, 4), True)
    """
    seq, head_dim = x.shape[-3], x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim must be even, got {head_dim}")
    half = head_dim // 2
    if positions is None:
        positions = jnp.arange(seq)
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # (..., seq, half)
    cos = jnp.cos(angles)[..., None, :].astype(x.dtype)  # broadcast over heads
    sin = jnp.sin(angles)[..., None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
