"""``RMSNorm`` and ``LayerNorm`` over the last axis, with parameters named ``("embed",)``."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x**2) + eps) * scale`` over the last axis; ``scale`` starts at ones.

    Computed in float32 whatever ``x``'s dtype (Hugging Face's ``LlamaRMSNorm``), the result cast
    back to ``x``'s. ``scale`` is created in ``param_dtype`` and named ``(axis,)`` (``"embed"``;
    ``None`` for a norm over another axis, e.g. one attention head's features).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = RMSNorm(4)
        >>> norm(jnp.array([[3.0, -3.0, 3.0, -3.0]])).round(3)
        Array([[ 1., -1.,  1., -1.]], dtype=float32)
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        axis: str | None = "embed",
        param_dtype: jax.typing.DTypeLike = jnp.float32,
    ):
        _check_eps("RMSNorm", eps)
        self.dim = dim
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)  # statistics in float32 whatever x's dtype; out in x's
        ms = jnp.mean(jnp.square(y), axis=-1, keepdims=True)
        return (y * jax.lax.rsqrt(ms + self.eps) * self.scale[...]).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis.

    Computed in float32 whatever ``x``'s dtype; ``scale`` and ``bias`` are created in
    ``param_dtype``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = LayerNorm(2)
        >>> norm(jnp.array([[1.0, 3.0]])).round(3)
        Array([[-1.,  1.]], dtype=float32)
    """

    def __init__(
        self, dim: int, *, eps: float = 1e-5, param_dtype: jax.typing.DTypeLike = jnp.float32
    ):
        _check_eps("LayerNorm", eps)
        self.dim = dim
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("embed",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)  # statistics in float32 whatever x's dtype; out in x's
        mean = jnp.mean(y, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
        out = (y - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return out.astype(x.dtype)


def _check_eps(name: str, eps: float) -> None:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 < eps < math.inf:
        raise ValueError(f"{name}: eps must be a finite number > 0, got {eps!r}")
