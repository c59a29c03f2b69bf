"""``RMSNorm`` and ``LayerNorm`` over the last axis, with parameters named ``("embed",)``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_positive


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
        check(is_positive(eps), "RMSNorm: eps", "a finite number > 0", eps)
        self.dim, self.eps = dim, eps
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
    """A norm over the model width: ``kind`` ``"rms"`` (``RMSNorm``) or ``"layer"``
    (``LayerNorm``), with epsilon ``eps`` (``None``: the norm's own, 1e-6 and 1e-5).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     norm = NormConfig("layer", eps=1e-6).build(4)
        >>> type(norm).__name__, norm.eps
        ('LayerNorm', 1e-06)
    """

    kind: str = "rms"
    eps: float | None = None

    def __post_init__(self):
        check(self.kind in ("rms", "layer"), "NormConfig.kind", "'rms' or 'layer'", self.kind)
        ok = self.eps is None or is_positive(self.eps)
        check(ok, "NormConfig.eps", "None or a finite number > 0", self.eps)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32
    ) -> RMSNorm | LayerNorm:
        """The norm over ``dim`` features, its Variables in ``param_dtype``."""
        options = {} if self.eps is None else {"eps": self.eps}
        norm = RMSNorm if self.kind == "rms" else LayerNorm
        return norm(dim, param_dtype=param_dtype, **options)
