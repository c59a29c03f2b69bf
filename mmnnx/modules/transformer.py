"""``TransformerBlock``: pre-norm attention and MLP with residuals, constrained at its edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.attention import Attention
from mmnnx.modules.constraints import constrain
from mmnnx.modules.mlp import MLP
from mmnnx.modules.moe import MoE
from mmnnx.modules.norms import LayerNorm, RMSNorm
from mmnnx.modules.rope import RopeScaling
from mmnnx.modules.routing import RouterStats

ACTIVATION_NAMES = ("batch", "seq", "embed")


def make_norm(
    kind: str,
    dim: int,
    *,
    eps: float | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
) -> RMSNorm | LayerNorm:
    """The norm named ``kind``: ``"rms"`` (``RMSNorm``) or ``"layer"`` (``LayerNorm``), with
    epsilon ``eps`` (default: the norm's own, 1e-6 and 1e-5) and Variables in ``param_dtype``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     type(make_norm("layer", 4)).__name__, make_norm("rms", 4, eps=1e-5).eps
        ('LayerNorm', 1e-05)
    """
    options = {} if eps is None else {"eps": eps}
    if kind == "rms":
        return RMSNorm(dim, param_dtype=param_dtype, **options)
    if kind == "layer":
        return LayerNorm(dim, param_dtype=param_dtype, **options)
    raise ValueError(f"unknown norm {kind!r}: expected 'rms' or 'layer'")


class TransformerBlock(nnx.Module):
    """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (pre-norm residual block).

    Its input and output are constrained to the logical names ``("batch", "seq", "embed")``
    (``constrain``), so inside ``mm.jit`` activations between blocks are sharded as each task's
    rules say (e.g. batch over ``data``). The MLP's hidden size is ``mlp_hidden`` (default
    ``int(mlp_ratio * dim)``), with biases unless ``mlp_bias=False``. ``head_dim``, ``qk_norm``,
    ``rope_base`` and ``rope_scaling`` go to ``Attention``; ``norm_eps`` (default: each norm's
    own) to both norms and to the attention's per-head norms; Variables are created in
    ``param_dtype``. With ``experts > 0`` the feed-forward is a ``MoE`` (still at ``mlp``) of
    that many SwiGLU experts of hidden size ``expert_hidden`` (default: the MLP's), each token
    routed to ``experts_per_token`` of them (``norm_topk_prob`` and ``capacity_factor`` as
    ``MoE`` takes them); ``block.forward(x)`` then returns the router's ``RouterStats`` too.
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
        head_dim: int | None = None,
        mlp_ratio: float = 4,
        mlp_hidden: int | None = None,
        mlp_bias: bool = True,
        gated_mlp: bool = False,
        norm: str = "rms",
        norm_eps: float | None = None,
        rope: bool = True,
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        qk_norm: bool = False,
        dropout: float = 0.0,
        experts: int = 0,
        experts_per_token: int = 2,
        expert_hidden: int | None = None,
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dim = dim
        self.norm1 = make_norm(norm, dim, eps=norm_eps, param_dtype=param_dtype)
        self.attn = Attention(
            dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope=rope,
            rope_base=rope_base,
            rope_scaling=rope_scaling,
            qk_norm=qk_norm,
            norm_eps=1e-6 if norm_eps is None else norm_eps,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.norm2 = make_norm(norm, dim, eps=norm_eps, param_dtype=param_dtype)
        hidden = int(mlp_ratio * dim) if mlp_hidden is None else mlp_hidden
        if experts:
            self.mlp = MoE(
                dim,
                hidden if expert_hidden is None else expert_hidden,
                experts,
                experts_per_token,
                norm_topk_prob=norm_topk_prob,
                capacity_factor=capacity_factor,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(
                dim, hidden, gated=gated_mlp, use_bias=mlp_bias, param_dtype=param_dtype, rngs=rngs
            )
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward(x)[0]

    def forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats | None]:
        """The block's output and its ``MoE``'s ``RouterStats`` (``None`` with a dense MLP)."""
        x = constrain(x, ACTIVATION_NAMES)
        x = x + self._drop(self.attn(self.norm1(x)))
        stats = None
        if isinstance(self.mlp, MoE):
            h, stats = self.mlp.forward(self.norm2(x))
        else:
            h = self.mlp(self.norm2(x))
        x = x + self._drop(h)
        return constrain(x, ACTIVATION_NAMES), stats

    def _drop(self, x: jax.Array) -> jax.Array:
        return x if self.dropout is None else self.dropout(x)
