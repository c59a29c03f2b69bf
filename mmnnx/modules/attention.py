"""``Attention``: causal multi-head self-attention with RoPE and grouped key/value heads."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.linear import Linear
from mmnnx.modules.rope import apply_rope


class Attention(nnx.Module):
    """Causal self-attention: ``out(softmax(q k^T / sqrt(head_dim) + causal mask) v)``.

    ``q`` has ``num_heads`` heads of ``head_dim = dim // num_heads``; ``k`` and ``v`` have
    ``num_kv_heads`` (default ``num_heads``), each shared by ``num_heads // num_kv_heads`` query
    heads (grouped-query attention; 1 is multi-query). ``q``, ``k`` and ``v`` kernels are named
    ``("embed", "heads")`` and ``out`` ``("heads", "embed")``: mapping ``heads`` to a mesh axis
    splits the heads across it. With ``rope``, queries and keys are rotated by ``apply_rope``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     attn = Attention(16, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((2, 5, 16))).shape, attn.k.kernel.shape
        ((2, 5, 16), (16, 8))
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        rope: bool = True,
        rope_base: float = 10000.0,
        use_bias: bool = False,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if dim % num_heads:
            raise ValueError(f"Attention: dim {dim} is not divisible by num_heads {num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(
                f"Attention: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.dim = dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = dim // num_heads
        if rope and self.head_dim % 2:
            raise ValueError(f"Attention: RoPE needs an even head_dim, got {self.head_dim}")
        self.rope = rope
        self.rope_base = rope_base
        kv_features = num_kv_heads * self.head_dim
        qkv = dict(axes=("embed", "heads"), use_bias=use_bias, rngs=rngs)
        self.q = Linear(dim, dim, **qkv)
        self.k = Linear(dim, kv_features, **qkv)
        self.v = Linear(dim, kv_features, **qkv)
        self.out = Linear(dim, dim, axes=("heads", "embed"), use_bias=use_bias, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        *lead, seq, _ = x.shape
        q = self.q(x).reshape(*lead, seq, self.num_heads, self.head_dim)
        k = self.k(x).reshape(*lead, seq, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(*lead, seq, self.num_kv_heads, self.head_dim)
        if self.rope:
            q = apply_rope(q, base=self.rope_base)
            k = apply_rope(k, base=self.rope_base)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # query head h reads key/value head h // groups
            k = jnp.repeat(k, groups, axis=-2)
            v = jnp.repeat(v, groups, axis=-2)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        y = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.out(y.reshape(*lead, seq, self.dim))
