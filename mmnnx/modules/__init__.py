"""Transformer layers whose parameters carry logical axis names for ``mm.place``.

Plain ``nnx.Module`` classes, small enough to read and subclass (attention, latent attention,
MLP, norms, mixtures of experts, the transformer block), each built from its frozen config by
``config.build(dim, ...)``; ``constrain`` adds a logical sharding constraint inside ``mm.jit``.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mmnnx import modules
    >>> config = modules.BlockConfig(modules.AttentionConfig(2), modules.MLPConfig(64))
    >>> with nnx.use_eager_sharding(False):
    ...     block = config.build(16, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((1, 4, 16))).shape
    (1, 4, 16)
"""

from mmnnx.modules.attention import Attention, AttentionConfig
from mmnnx.modules.constraints import constrain
from mmnnx.modules.deepseek_moe import (
    DeepSeekMoE,
    DeepSeekMoEConfig,
    RouterBias,
    balance_router_biases,
)
from mmnnx.modules.embed import Embed
from mmnnx.modules.experts import ClampedExperts, Experts
from mmnnx.modules.latent_attention import LatentAttention, LatentAttentionConfig
from mmnnx.modules.linear import Linear
from mmnnx.modules.lora import LoRA, add_lora
from mmnnx.modules.masks import causal_mask
from mmnnx.modules.mlp import MLP, MLPConfig
from mmnnx.modules.moe import ClampedMoEConfig, MoE, MoEConfig
from mmnnx.modules.norms import LayerNorm, NormConfig, RMSNorm
from mmnnx.modules.packing import Packing
from mmnnx.modules.rope import (
    LinearScaling,
    RopeConfig,
    RopeScaling,
    YarnScaling,
    apply_rope,
    rope_frequencies,
)
from mmnnx.modules.routing import RouterStats
from mmnnx.modules.transformer import BlockConfig, TransformerBlock

__all__ = [
    "MLP",
    "Attention",
    "AttentionConfig",
    "BlockConfig",
    "ClampedExperts",
    "ClampedMoEConfig",
    "DeepSeekMoE",
    "DeepSeekMoEConfig",
    "Embed",
    "Experts",
    "LatentAttention",
    "LatentAttentionConfig",
    "LayerNorm",
    "Linear",
    "LinearScaling",
    "LoRA",
    "MLPConfig",
    "MoE",
    "MoEConfig",
    "NormConfig",
    "Packing",
    "RMSNorm",
    "RopeConfig",
    "RopeScaling",
    "RouterBias",
    "RouterStats",
    "TransformerBlock",
    "YarnScaling",
    "add_lora",
    "apply_rope",
    "balance_router_biases",
    "causal_mask",
    "constrain",
    "rope_frequencies",
]
