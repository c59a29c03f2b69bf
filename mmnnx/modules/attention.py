"""``Attention``: causal multi-head self-attention with RoPE and grouped key/value heads."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_int, is_positive
from mmnnx.modules.linear import Linear
from mmnnx.modules.masks import causal_mask
from mmnnx.modules.norms import RMSNorm
from mmnnx.modules.packing import Packing
from mmnnx.modules.rope import RopeConfig, apply_rope


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """An ``Attention``: ``num_heads`` query heads of ``head_dim`` (``None``: ``dim // num_heads``),
    ``num_kv_heads`` key/value heads (``None``: ``num_heads``), per-head ``qk_norm`` (Gemma's
    ``qk_norm_offset``), ``rope`` (``None``: no positions), ``sliding_window`` (a query at ``i``
    sees keys ``i - w < j <= i``), ``query_pre_attn_scalar`` (scores times its ``** -0.5``), and
    gpt-oss's ``bias`` on the projections and ``sinks`` (a learned logit per head in each softmax).

    Example:
        >>> AttentionConfig(num_heads=4, num_kv_heads=3)
        Traceback (most recent call last):
        ...
        ValueError: AttentionConfig.num_kv_heads must be None or a divisor of num_heads (4), got 3
    """

    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    rope: RopeConfig | None = RopeConfig()
    sliding_window: int | None = None
    qk_norm_offset: float = 0.0
    query_pre_attn_scalar: float | None = None
    bias: bool = False
    sinks: bool = False

    def __post_init__(self):
        heads, kv, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        check(is_int(heads, minimum=1), "AttentionConfig.num_heads", "an int >= 1", heads)
        ok = kv is None or (is_int(kv, minimum=1) and heads % kv == 0)
        check(ok, "AttentionConfig.num_kv_heads", f"None or a divisor of num_heads ({heads})", kv)
        ok = head_dim is None or is_int(head_dim, minimum=1)
        check(ok, "AttentionConfig.head_dim", "None or an int >= 1", head_dim)
        ok = head_dim is None or self.rope is None or head_dim % 2 == 0
        check(ok, "AttentionConfig.head_dim", "even (RoPE rotates pairs of features)", head_dim)
        check(isinstance(self.qk_norm, bool), "AttentionConfig.qk_norm", "a bool", self.qk_norm)
        eps = self.qk_norm_eps
        check(is_positive(eps), "AttentionConfig.qk_norm_eps", "a finite number > 0", eps)
        ok = self.rope is None or isinstance(self.rope, RopeConfig)
        check(ok, "AttentionConfig.rope", "None or a RopeConfig", self.rope)
        window = self.sliding_window
        ok = window is None or is_int(window, minimum=1)
        check(ok, "AttentionConfig.sliding_window", "None or an int >= 1", window)
        offset = self.qk_norm_offset
        ok = isinstance(offset, numbers.Real) and math.isfinite(offset)
        check(ok, "AttentionConfig.qk_norm_offset", "a finite number", offset)
        scalar = self.query_pre_attn_scalar
        ok = scalar is None or is_positive(scalar)
        check(ok, "AttentionConfig.query_pre_attn_scalar", "None or a number > 0", scalar)
        check(isinstance(self.bias, bool), "AttentionConfig.bias", "a bool", self.bias)
        check(isinstance(self.sinks, bool), "AttentionConfig.sinks", "a bool", self.sinks)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> Attention:
        """The ``Attention`` of width ``dim``, its Variables in ``param_dtype``."""
        return Attention(dim, self, param_dtype=param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """Causal self-attention ``out(softmax(q k^T * score_scale + mask) v)`` as ``config`` says, with
    grouped key/value heads; kernels named ``("embed", "heads")`` (``out``: ``("heads", "embed")``),
    so mapping ``heads`` to a mesh axis splits the heads. ``__call__`` is ``attend(*project(x),
    mask)``, which a decoder with a key/value cache reuses.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     attn = Attention(16, AttentionConfig(4, num_kv_heads=2), rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((2, 5, 16))).shape, attn.k.kernel.shape
        ((2, 5, 16), (16, 8))
    """

    def __init__(
        self,
        dim: int,
        config: AttentionConfig,
        *,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        heads, head_dim = config.num_heads, config.head_dim or dim // config.num_heads
        if config.head_dim is None and dim % heads:
            raise ValueError(f"Attention: dim {dim} is not divisible by num_heads {heads}")
        if config.rope and head_dim % 2:
            raise ValueError(f"Attention: RoPE needs an even head_dim, got {head_dim}")
        self.dim, self.num_heads, self.head_dim, self.rope = dim, heads, head_dim, config.rope
        self.sliding_window = config.sliding_window
        self.score_scale = (config.query_pre_attn_scalar or head_dim) ** -0.5
        self.num_kv_heads = config.num_kv_heads or heads
        inner, kv_features = heads * head_dim, self.num_kv_heads * head_dim
        linear = dict(use_bias=config.bias, param_dtype=param_dtype, rngs=rngs)
        self.q = Linear(dim, inner, axes=("embed", "heads"), **linear)
        self.k = Linear(dim, kv_features, axes=("embed", "heads"), **linear)
        self.v = Linear(dim, kv_features, axes=("embed", "heads"), **linear)
        self.out = Linear(inner, dim, axes=("heads", "embed"), **linear)
        norm = dict(
            eps=config.qk_norm_eps,
            axis=None,
            param_dtype=param_dtype,
            scale_offset=config.qk_norm_offset,
        )
        self.q_norm = RMSNorm(head_dim, **norm) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norm) if config.qk_norm else None
        sinks = nnx.with_partitioning(nnx.initializers.zeros_init(), ("heads",))
        self.sinks = (
            nnx.Param(sinks(rngs.params(), (heads,), param_dtype)) if config.sinks else None
        )

    def __call__(self, x: jax.Array, packing: Packing | None = None) -> jax.Array:
        if packing is not None:
            visible = packing.visible(self.sliding_window)
            return self.attend(*self.project(x, packing.positions), visible)
        positions = jnp.arange(x.shape[-2])
        return self.attend(*self.project(x), self.visible(positions, positions))

    def visible(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """Which keys each query sees, bool ``(..., q, k)`` (``causal_mask`` with
        ``sliding_window``).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     attn = Attention(16, AttentionConfig(4, sliding_window=2), rngs=nnx.Rngs(0))
            >>> attn.visible(jnp.arange(2, 4), jnp.arange(4)).astype(int).tolist()
            [[0, 1, 1, 0], [0, 0, 1, 1]]
        """
        return causal_mask(query_positions, key_positions, self.sliding_window)

    def project(
        self, x: jax.Array, positions: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``(..., seq, num_heads, head_dim)``, keys and values ``(..., seq, num_kv_heads,
        head_dim)`` of ``x``, normalised per head and rotated by ``positions`` (default ``0 ..
        seq-1``).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     config = AttentionConfig(4, num_kv_heads=2, head_dim=6)
            ...     attn = Attention(16, config, rngs=nnx.Rngs(0))
            >>> [a.shape for a in attn.project(jnp.ones((1, 3, 16)), jnp.arange(5, 8))]
            [(1, 3, 4, 6), (1, 3, 2, 6), (1, 3, 2, 6)]
        """
        *lead, seq, _ = x.shape
        q = self.q(x).reshape(*lead, seq, self.num_heads, self.head_dim)
        k = self.k(x).reshape(*lead, seq, self.num_kv_heads, self.head_dim)
        v = self.v(x).reshape(*lead, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q = apply_rope(q, positions, base=self.rope.theta, scaling=self.rope.scaling)
            k = apply_rope(k, positions, base=self.rope.theta, scaling=self.rope.scaling)
        return q, k, v

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
        """``out`` of the values mixed by a float32 softmax of the scores over the keys ``visible``
        allows (bool, broadcastable to ``(..., heads, q_seq, k_seq)``); ``(..., q_seq, dim)``.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     attn = Attention(16, AttentionConfig(4), rngs=nnx.Rngs(0))
            >>> q, k, v = attn.project(jnp.ones((1, 3, 16)))
            >>> attn.attend(q[:, -1:], k, v, jnp.ones((1, 3), bool)).shape  # the last query
            (1, 1, 16)
        """
        *lead, seq, _, _ = q.shape
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:  # query head h reads key/value head h // groups
            k = jnp.repeat(k, groups, axis=-2)
            v = jnp.repeat(v, groups, axis=-2)
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) * self.score_scale
        scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
        weights = self._softmax(scores.astype(jnp.float32)).astype(v.dtype)
        y = jnp.einsum("...hqk,...khd->...qhd", weights, v)
        return self.out(y.reshape(*lead, seq, self.num_heads * self.head_dim))

    def _softmax(self, scores: jax.Array) -> jax.Array:
        """Softmax over the keys; with ``sinks``, over the keys and the head's sink, whose share
        is dropped."""
        if self.sinks is None:
            return jax.nn.softmax(scores, axis=-1)
        sink = self.sinks[...].astype(scores.dtype)[:, None, None]
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
