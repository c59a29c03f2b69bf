"""``LatentAttention``: DeepSeek's multi-head latent attention (MLA), whose keys and values are
expanded from a small per-token latent, so that a decoder caches the latent alone."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_int, is_positive
from mmnnx.modules.linear import Linear
from mmnnx.modules.masks import causal_mask
from mmnnx.modules.norms import RMSNorm
from mmnnx.modules.packing import Packing
from mmnnx.modules.rope import RopeConfig, YarnScaling, apply_rope


@dataclasses.dataclass(frozen=True)
class LatentAttentionConfig:
    """A ``LatentAttention`` (as transformers' ``DeepseekV3Attention``): ``num_heads`` heads with
    ``qk_nope_head_dim`` position-free and ``qk_rope_head_dim`` rotated query/key features and
    ``v_head_dim`` value ones; queries through a ``q_lora_rank`` bottleneck (``None``: none), keys
    and values from a ``kv_lora_rank`` latent; ``rope_interleave``: DeepSeek's pair layout.

    Example:
        >>> LatentAttentionConfig(4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=3,
        ...                       v_head_dim=8)
        Traceback (most recent call last):
        ...
        ValueError: LatentAttentionConfig.qk_rope_head_dim must be an even int >= 2, got 3
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope: RopeConfig = RopeConfig()
    rope_interleave: bool = True
    latent_norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            check(is_int(value, minimum=1), f"LatentAttentionConfig.{name}", "an int >= 1", value)
        rope_dim = self.qk_rope_head_dim
        ok = is_int(rope_dim, minimum=2) and rope_dim % 2 == 0
        check(ok, "LatentAttentionConfig.qk_rope_head_dim", "an even int >= 2", rope_dim)
        q_rank = self.q_lora_rank
        ok = q_rank is None or is_int(q_rank, minimum=1)
        check(ok, "LatentAttentionConfig.q_lora_rank", "None or an int >= 1", q_rank)
        ok = isinstance(self.rope, RopeConfig)
        check(ok, "LatentAttentionConfig.rope", "a RopeConfig", self.rope)
        ok = isinstance(self.rope_interleave, bool)
        check(ok, "LatentAttentionConfig.rope_interleave", "a bool", self.rope_interleave)
        eps = self.latent_norm_eps
        check(is_positive(eps), "LatentAttentionConfig.latent_norm_eps", "a number > 0", eps)

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's ``mscale_all_dim`` factor
        squared where set.

        Example:
            >>> LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=12, qk_rope_head_dim=4,
            ...                       v_head_dim=8).softmax_scale
            0.25
        """
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        yarn = self.rope.scaling
        if isinstance(yarn, YarnScaling) and yarn.mscale_all_dim and yarn.factor > 1:
            mscale = 0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    def cache_bytes_per_token(self, itemsize: int = 2) -> tuple[int, int]:
        """Bytes a decoder caches per token and layer: the latent's, and the expanded keys and
        values'.

        Example:
            >>> LatentAttentionConfig(128, kv_lora_rank=512, qk_nope_head_dim=128,
            ...                       qk_rope_head_dim=64, v_head_dim=128).cache_bytes_per_token()
            (1152, 81920)
        """
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        full = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return latent * itemsize, full * itemsize

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> LatentAttention:
        """The ``LatentAttention`` of width ``dim``, its Variables in ``param_dtype``."""
        return LatentAttention(dim, self, param_dtype=param_dtype, rngs=rngs)


class LatentAttention(nnx.Module):
    """Causal multi-head latent attention: queries ``q`` (or ``q_b(q_norm(q_a(x)))``); ``kv_a``
    projects each token to a latent (``kv_norm``) and one rotated key shared by every head, which
    ``kv_b`` expands into each head's key part and value. ``project`` returns what a decoder caches
    (queries, latent, shared key); ``attend`` expands them.

    Example:
        >>> config = LatentAttentionConfig(4, kv_lora_rank=16, qk_nope_head_dim=8,
        ...                                qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)
        >>> with nnx.use_eager_sharding(False):
        ...     attn = config.build(32, rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((2, 5, 32))).shape, [a.shape for a in attn.project(jnp.ones((1, 3, 32)))]
        ((2, 5, 32), [(1, 3, 4, 12), (1, 3, 1, 16), (1, 3, 1, 4)])
    """

    def __init__(
        self,
        dim: int,
        config: LatentAttentionConfig,
        *,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        c = self.config = config
        self.dim, self.num_heads = dim, c.num_heads
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        linear = dict(use_bias=False, param_dtype=param_dtype, rngs=rngs)
        norm = dict(eps=c.latent_norm_eps, axis=None, param_dtype=param_dtype)
        queries = c.num_heads * self.qk_head_dim
        if c.q_lora_rank is None:
            self.q = Linear(dim, queries, axes=("embed", "heads"), **linear)
        else:
            self.q_a = Linear(dim, c.q_lora_rank, axes=("embed", None), **linear)
            self.q_norm = RMSNorm(c.q_lora_rank, **norm)
            self.q_b = Linear(c.q_lora_rank, queries, axes=(None, "heads"), **linear)
        self.kv_a = Linear(dim, c.kv_lora_rank + c.qk_rope_head_dim, axes=("embed", None), **linear)
        self.kv_norm = RMSNorm(c.kv_lora_rank, **norm)
        kv = c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
        self.kv_b = Linear(c.kv_lora_rank, kv, axes=(None, "heads"), **linear)
        self.out = Linear(c.num_heads * c.v_head_dim, dim, axes=("heads", "embed"), **linear)

    def __call__(self, x: jax.Array, packing: Packing | None = None) -> jax.Array:
        if packing is not None:
            return self.attend(*self.project(x, packing.positions), packing.visible())
        positions = jnp.arange(x.shape[-2])
        return self.attend(*self.project(x), self.visible(positions, positions))

    def visible(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """Which keys each query sees, bool ``(..., q, k)``: the earlier ones."""
        return causal_mask(query_positions, key_positions, None)

    def project(
        self, x: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``(..., seq, heads, nope + rope)``, the latent ``(..., seq, 1, kv_lora_rank)``
        and the shared key ``(..., seq, 1, rope)`` of ``x``, rotated by ``positions`` (default
        ``0 .. seq-1``)."""
        c = self.config
        *lead, seq, _ = x.shape
        q = self.q(x) if c.q_lora_rank is None else self.q_b(self.q_norm(self.q_a(x)))
        q = q.reshape(*lead, seq, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q[..., : c.qk_nope_head_dim], q[..., c.qk_nope_head_dim :]
        compressed = self.kv_a(x)
        latent = self.kv_norm(compressed[..., : c.kv_lora_rank])[..., None, :]
        k_rope = compressed[..., None, c.kv_lora_rank :]
        q_rope, k_rope = self._rotate(q_rope, positions), self._rotate(k_rope, positions)
        return jnp.concatenate([q_nope, q_rope], axis=-1), latent, k_rope

    def _rotate(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        if self.config.rope_interleave:  # pairs (x0, x1), (x2, x3)..: as halves, the same dots
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        rope = self.config.rope
        return apply_rope(x, positions, base=rope.theta, scaling=rope.scaling)

    def attend(
        self, q: jax.Array, latent: jax.Array, k_rope: jax.Array, visible: jax.Array
    ) -> jax.Array:
        """``out`` of the values expanded from ``latent`` mixed by a float32 softmax over the keys
        ``visible`` allows; ``(..., q_seq, dim)``.

        Example:
            >>> config = LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=4,
            ...                                qk_rope_head_dim=2, v_head_dim=4)
            >>> with nnx.use_eager_sharding(False):
            ...     attn = config.build(16, rngs=nnx.Rngs(0))
            >>> q, latent, k_rope = attn.project(jnp.ones((1, 3, 16)))
            >>> attn.attend(q[:, -1:], latent, k_rope, jnp.ones((1, 3), bool)).shape
            (1, 1, 16)
        """
        c = self.config
        *lead, seq, _, _ = q.shape
        kv = self.kv_b(latent[..., 0, :])
        kv = kv.reshape(*kv.shape[:-1], self.num_heads, c.qk_nope_head_dim + c.v_head_dim)
        k_nope, v = kv[..., : c.qk_nope_head_dim], kv[..., c.qk_nope_head_dim :]
        shared = jnp.broadcast_to(k_rope, (*k_nope.shape[:-1], c.qk_rope_head_dim))
        k = jnp.concatenate([k_nope, shared], axis=-1)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * c.softmax_scale
        scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
        y = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.out(y.reshape(*lead, seq, self.num_heads * c.v_head_dim))
