"""Transformer layers whose parameters carry logical axis names for ``mm.place``.

Plain ``nnx.Module`` classes, small enough to read and subclass: ``Linear``, ``Embed``, ``MLP``,
``Attention`` (causal, RoPE with Llama 3's optional ``RopeScaling``, grouped KV heads, optional
per-head q/k norms), ``RMSNorm``, ``LayerNorm``, ``MoE`` (a mixture of SwiGLU ``Experts``, routed
as Qwen3-MoE routes, expert-parallel where placed so; its ``RouterStats``) and
``TransformerBlock``. ``constrain`` adds a
logical sharding constraint inside ``mm.jit`` only.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mmnnx import modules
    >>> with nnx.use_eager_sharding(False):
    ...     block = modules.TransformerBlock(16, 2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 4, 16))).shape
    (1, 4, 16)
"""

from mmnnx.modules.attention import Attention
from mmnnx.modules.constraints import constrain
from mmnnx.modules.embed import Embed
from mmnnx.modules.experts import Experts
from mmnnx.modules.linear import Linear
from mmnnx.modules.lora import LoRA, add_lora
from mmnnx.modules.mlp import MLP
from mmnnx.modules.moe import MoE
from mmnnx.modules.norms import LayerNorm, RMSNorm
from mmnnx.modules.rope import RopeScaling, apply_rope, rope_frequencies
from mmnnx.modules.routing import RouterStats
from mmnnx.modules.transformer import TransformerBlock, make_norm

__all__ = [
    "MLP",
    "Attention",
    "Embed",
    "Experts",
    "LayerNorm",
    "Linear",
    "LoRA",
    "MoE",
    "RMSNorm",
    "RopeScaling",
    "RouterStats",
    "TransformerBlock",
    "add_lora",
    "apply_rope",
    "constrain",
    "make_norm",
    "rope_frequencies",
]
