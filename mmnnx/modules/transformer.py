"""``TransformerBlock``: pre-norm attention and a feed-forward with residuals, constrained at
its edges, built from a ``BlockConfig`` of component configs."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.attention import AttentionConfig
from mmnnx.modules.checks import check
from mmnnx.modules.constraints import constrain
from mmnnx.modules.mlp import MLPConfig
from mmnnx.modules.moe import MoEConfig
from mmnnx.modules.norms import NormConfig
from mmnnx.modules.packing import Packing
from mmnnx.modules.routing import RouterStats

ACTIVATION_NAMES = ("batch", "seq", "embed")


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """A ``TransformerBlock`` as nested component configs: ``attention`` (an
    ``AttentionConfig``), ``feed_forward`` (an ``MLPConfig`` or a ``MoEConfig``), ``norm`` (a
    ``NormConfig``, every norm of the block), the residual ``dropout`` rate, and
    ``post_norms``: a norm also on the attention's and the feed-forward's outputs, before each
    residual add (Gemma 2 and 3's four norms per block). The block builds each
    component by its ``build(dim, *, param_dtype, rngs)``, knowing none of its fields: a new
    attention kind or router is a new component config, not a new block argument.

    Example:
        >>> config = BlockConfig(AttentionConfig(4), MLPConfig(64, gated=True, bias=False))
        >>> with nnx.use_eager_sharding(False):
        ...     block = config.build(16, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((2, 5, 16))).shape, block.mlp.hidden
        ((2, 5, 16), 64)
    """

    attention: AttentionConfig
    feed_forward: MLPConfig | MoEConfig
    norm: NormConfig = NormConfig()
    dropout: float = 0.0
    post_norms: bool = False

    def __post_init__(self):
        for name in ("attention", "feed_forward"):
            value = getattr(self, name)
            check(hasattr(value, "build"), f"BlockConfig.{name}", "a component config", value)
        check(isinstance(self.norm, NormConfig), "BlockConfig.norm", "a NormConfig", self.norm)
        ok = isinstance(self.dropout, numbers.Real) and 0 <= self.dropout < 1
        check(ok, "BlockConfig.dropout", "a number in [0, 1)", self.dropout)
        post = self.post_norms
        check(isinstance(post, bool), "BlockConfig.post_norms", "a bool", post)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> TransformerBlock:
        """The ``TransformerBlock`` of width ``dim``, its Variables in ``param_dtype``."""
        return TransformerBlock(dim, self, param_dtype=param_dtype, rngs=rngs)


class TransformerBlock(nnx.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (pre-norm residual block); with
    ``config.post_norms``, ``x + post_attn_norm(attn(norm1(x)))``, then
    ``x + post_mlp_norm(mlp(norm2(x)))`` (Gemma's sandwich norms).

    Its input and output are constrained to the logical names ``("batch", "seq", "embed")``
    (``constrain``), so inside ``mm.jit`` activations between blocks are sharded as each task's
    rules say (e.g. batch over ``data``). ``config`` (a ``BlockConfig``) builds ``norm1``,
    ``attn``, ``norm2`` and ``mlp`` (the feed-forward: an ``MLP``, or a ``MoE``, whose
    ``RouterStats`` ``block.forward(x)`` returns too), in that order, then ``post_attn_norm``
    and ``post_mlp_norm`` (``None`` without ``post_norms``), their Variables in
    ``param_dtype``. With ``config.dropout > 0``, the attention and feed-forward outputs go
    through ``nnx.Dropout`` before each residual add (drawing from the block's own RNG stream;
    ``model.eval()`` turns it off).

    Example:
        >>> import jax.numpy as jnp
        >>> config = BlockConfig(AttentionConfig(num_heads=4), MLPConfig(64))
        >>> with nnx.use_eager_sharding(False):
        ...     block = TransformerBlock(16, config, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((2, 5, 16))).shape, type(block.norm1).__name__
        ((2, 5, 16), 'RMSNorm')
    """

    def __init__(
        self,
        dim: int,
        config: BlockConfig,
        *,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dim = dim
        self.norm1 = config.norm.build(dim, param_dtype=param_dtype)
        self.attn = config.attention.build(dim, param_dtype=param_dtype, rngs=rngs)
        self.norm2 = config.norm.build(dim, param_dtype=param_dtype)
        self.mlp = config.feed_forward.build(dim, param_dtype=param_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs) if config.dropout else None
        post = config.post_norms
        self.post_attn_norm = config.norm.build(dim, param_dtype=param_dtype) if post else None
        self.post_mlp_norm = config.norm.build(dim, param_dtype=param_dtype) if post else None

    def __call__(self, x: jax.Array, packing: Packing | None = None) -> jax.Array:
        return self.forward(x, packing)[0]

    def forward(
        self, x: jax.Array, packing: Packing | None = None
    ) -> tuple[jax.Array, RouterStats | None]:
        """The block's output and its feed-forward's ``RouterStats``: those of a feed-forward
        with a ``forward`` method (``MoE``), ``None`` for a dense ``MLP``. ``packing``: the
        rows hold several examples (attention stays within each)."""
        x = constrain(x, ACTIVATION_NAMES)
        x = x + self._drop(self.attention_out(self.attn(self.norm1(x), packing)))
        h, stats = self.feed_forward(x)
        x = x + self._drop(h)
        return constrain(x, ACTIVATION_NAMES), stats

    def attention_out(self, h: jax.Array) -> jax.Array:
        """What the block adds to its input for the attention's output ``h``: ``h``, or
        ``post_attn_norm(h)`` with ``post_norms`` (a decoder computing ``h`` itself uses it).

        Example:
            >>> config = BlockConfig(AttentionConfig(2), MLPConfig(8), post_norms=True)
            >>> with nnx.use_eager_sharding(False):
            ...     block = config.build(4, rngs=nnx.Rngs(0))
            >>> block.attention_out(jnp.array([2.0, -2.0, 2.0, -2.0])).round(3)
            Array([ 1., -1.,  1., -1.], dtype=float32)
        """
        return h if self.post_attn_norm is None else self.post_attn_norm(h)

    def feed_forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats | None]:
        """What the block adds to ``x`` (the input plus the attention's part) for its
        feed-forward: ``mlp(norm2(x))``, through ``post_mlp_norm`` with ``post_norms``; and the
        feed-forward's ``RouterStats`` (``None`` for a dense ``MLP``).

        Example:
            >>> config = BlockConfig(AttentionConfig(2), MLPConfig(8))
            >>> with nnx.use_eager_sharding(False):
            ...     block = config.build(4, rngs=nnx.Rngs(0))
            >>> h, stats = block.feed_forward(jnp.ones((1, 3, 4)))
            >>> h.shape, stats
            ((1, 3, 4), None)
        """
        routed = getattr(self.mlp, "forward", None)
        h, stats = routed(self.norm2(x)) if routed else (self.mlp(self.norm2(x)), None)
        return (h if self.post_mlp_norm is None else self.post_mlp_norm(h)), stats

    def _drop(self, x: jax.Array) -> jax.Array:
        return x if self.dropout is None else self.dropout(x)
