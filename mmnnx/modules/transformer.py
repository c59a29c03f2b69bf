"""``TransformerBlock``: pre-norm attention and MLP with residuals, constrained at its edges."""

from __future__ import annotations

import jax
from flax import nnx

from mmnnx.modules.attention import Attention
from mmnnx.modules.constraints import constrain
from mmnnx.modules.mlp import MLP
from mmnnx.modules.norms import LayerNorm, RMSNorm

ACTIVATION_NAMES = ("batch", "seq", "embed")


def make_norm(kind: str, dim: int) -> RMSNorm | LayerNorm:
    """The norm named ``kind``: ``"rms"`` (``RMSNorm``) or ``"layer"`` (``LayerNorm``).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     type(make_norm("layer", 4)).__name__
        'LayerNorm'
    """
    if kind == "rms":
        return RMSNorm(dim)
    if kind == "layer":
        return LayerNorm(dim)
    raise ValueError(f"unknown norm {kind!r}: expected 'rms' or 'layer'")


class TransformerBlock(nnx.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (pre-norm residual block).

    Its input and output are constrained to the logical names ``("batch", "seq", "embed")``
    (``constrain``), so inside ``mm.jit`` activations between blocks are sharded as each task's
    rules say (e.g. batch over ``data``). The MLP's hidden size is ``int(mlp_ratio * dim)``.
    With ``dropout > 0``, the attention and MLP outputs go through ``nnx.Dropout`` before each
    residual add (drawing from the block's own RNG stream; ``model.eval()`` turns it off).

    Example:
        >>> import jax.numpy as jnp
        >>> with nnx.use_eager_sharding(False):
        ...     block = TransformerBlock(16, 4, num_kv_heads=2, gated_mlp=True, rngs=nnx.Rngs(0))
        >>> block(jnp.ones((2, 5, 16))).shape, block.mlp.hidden
        ((2, 5, 16), 64)
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        mlp_ratio: float = 4,
        gated_mlp: bool = False,
        norm: str = "rms",
        rope: bool = True,
        dropout: float = 0.0,
        rngs: nnx.Rngs,
    ):
        self.dim = dim
        self.norm1 = make_norm(norm, dim)
        self.attn = Attention(dim, num_heads, num_kv_heads=num_kv_heads, rope=rope, rngs=rngs)
        self.norm2 = make_norm(norm, dim)
        self.mlp = MLP(dim, int(mlp_ratio * dim), gated=gated_mlp, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, ACTIVATION_NAMES)
        x = x + self._drop(self.attn(self.norm1(x)))
        x = x + self._drop(self.mlp(self.norm2(x)))
        return constrain(x, ACTIVATION_NAMES)

    def _drop(self, x: jax.Array) -> jax.Array:
        return x if self.dropout is None else self.dropout(x)
