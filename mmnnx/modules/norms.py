"""``RMSNorm`` and ``LayerNorm`` over the last axis, with parameters named ``("embed",)``."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_positive

RMS_EPS = 1e-6
"""An ``RMSNorm``'s epsilon where none is given."""


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x**2) + eps) * (scale_offset + scale)`` over the last axis, in float32 (as
    ``LlamaRMSNorm``), cast back to ``x``'s dtype; ``scale`` is named ``(axis,)`` and starts so that
    the factor is one. ``scale_offset=1.0`` is Gemma's ``(1 + weight)`` norm, ``scale`` holding the
    checkpoint's weight as stored.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = RMSNorm(4)
        ...     gemma = RMSNorm(4, scale_offset=1.0)
        >>> norm(jnp.array([[3.0, -3.0, 3.0, -3.0]])).round(3)
        Array([[ 1., -1.,  1., -1.]], dtype=float32)
        >>> gemma.scale[...], gemma(jnp.array([[3.0, -3.0, 3.0, -3.0]])).round(3)
        (Array([0., 0., 0., 0.], dtype=float32), Array([[ 1., -1.,  1., -1.]], dtype=float32))
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = RMS_EPS,
        axis: str | None = "embed",
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        scale_offset: float = 0.0,
    ):
        check(is_positive(eps), "RMSNorm: eps", "a finite number > 0", eps)
        ok = isinstance(scale_offset, numbers.Real) and math.isfinite(scale_offset)
        check(ok, "RMSNorm: scale_offset", "a finite number", scale_offset)
        self.dim, self.eps, self.scale_offset = dim, eps, scale_offset
        start = jnp.full((dim,), 1 - scale_offset, param_dtype)
        self.scale = nnx.Param(start, out_sharding=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)  # statistics in float32 whatever x's dtype; out in x's
        ms = jnp.mean(jnp.square(y), axis=-1, keepdims=True)
        scale = self.scale[...]
        if self.scale_offset:  # Gemma's 1 + weight, in float32 as transformers adds it
            scale = self.scale_offset + scale.astype(jnp.float32)
        return (y * jax.lax.rsqrt(ms + self.eps) * scale).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis, in float32.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = LayerNorm(2)
        >>> norm(jnp.array([[1.0, 3.0]])).round(3)
        Array([[-1.,  1.]], dtype=float32)
    """

    def __init__(
        self, dim: int, *, eps: float = 1e-5, param_dtype: jax.typing.DTypeLike = jnp.float32
    ):
        check(is_positive(eps), "LayerNorm: eps", "a finite number > 0", eps)
        self.dim, self.eps = dim, eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("embed",))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype), out_sharding=("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32)  # statistics in float32 whatever x's dtype; out in x's
        mean = jnp.mean(y, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(y - mean), axis=-1, keepdims=True)
        out = (y - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return out.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """A norm over the model width: ``kind`` ``"rms"`` or ``"layer"``, ``eps`` (``None``: the norm's
    own) and an RMS norm's ``scale_offset``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = NormConfig("layer", eps=1e-6).build(4)
        ...     gemma = NormConfig(scale_offset=1.0).build(4)
        >>> type(norm).__name__, norm.eps, gemma.scale_offset
        ('LayerNorm', 1e-06, 1.0)
    """

    kind: str = "rms"
    eps: float | None = None
    scale_offset: float = 0.0

    def __post_init__(self):
        check(self.kind in ("rms", "layer"), "NormConfig.kind", "'rms' or 'layer'", self.kind)
        ok = self.eps is None or is_positive(self.eps)
        check(ok, "NormConfig.eps", "None or a finite number > 0", self.eps)
        offset = self.scale_offset
        ok = isinstance(offset, numbers.Real) and math.isfinite(offset)
        ok = ok and (offset == 0 or self.kind == "rms")
        check(ok, "NormConfig.scale_offset", "a finite number (0 for a LayerNorm)", offset)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32
    ) -> RMSNorm | LayerNorm:
        """The norm over ``dim`` features, its Variables in ``param_dtype``."""
        options = {} if self.eps is None else {"eps": self.eps}
        if self.kind == "layer":
            return LayerNorm(dim, param_dtype=param_dtype, **options)
        return RMSNorm(dim, param_dtype=param_dtype, scale_offset=self.scale_offset, **options)
