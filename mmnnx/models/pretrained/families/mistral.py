"""Mistral and Mixtral: Llama's layers with every attention within ``config.json``'s
``sliding_window`` (``null``: none); Mixtral's feed-forward a mixture of experts in every layer,
its tensors in the published per-expert layout (``block_sparse_moe.experts.{e}.w1/w2/w3``, the
names transformers 5's ``save_pretrained`` and mmnnx write) or in Qwen3-MoE's fused layout
(``llama.FUSED_EXPERTS``, the router ``mlp.gate``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.base import T
from mmnnx.models.pretrained.families.llama import (
    FUSED_EXPERTS,
    DenseFeedForward,
    Family,
    FeedForward,
)
from mmnnx.models.pretrained.names import TensorRule
from mmnnx.modules import MLPConfig, MoEConfig

_MIXTRAL_LAYER = (  # the router and the experts, stacked over the experts
    TensorRule(
        "model.layers.{layer}.block_sparse_moe.gate.weight", "blocks/{layer}/mlp/router/kernel", T
    ),
    *(
        TensorRule(
            f"model.layers.{{layer}}.block_sparse_moe.experts.{{expert}}.{w}.weight",
            f"blocks/{{layer}}/mlp/experts/{name}",
            T,
        )
        for w, name in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
    ),
)
_MIXTRAL_FUSED_LAYER = (  # read only: transformers 5's in-memory layout (llama.FUSED_EXPERTS)
    TensorRule("model.layers.{layer}.mlp.gate.weight", "blocks/{layer}/mlp/router/kernel", T),
    *FUSED_EXPERTS,
)


@dataclasses.dataclass(frozen=True)
class MixtralFeedForward(DenseFeedForward):
    """Mixtral's: ``num_local_experts`` SwiGLU experts of ``intermediate_size`` features in
    every layer, each token to ``num_experts_per_tok`` of them (softmax over the experts, top-k,
    renormalised: ``norm_topk_prob``).

    Example:
        >>> keys = dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)
        >>> MixtralFeedForward().read(keys, 2)[1]
        MoEConfig(hidden=64, num_experts=8, top_k=2, norm_topk_prob=True, capacity_factor=None)
    """

    rules: ClassVar[tuple[TensorRule, ...]] = _MIXTRAL_LAYER + _MIXTRAL_FUSED_LAYER
    experts: ClassVar[bool] = True

    def read(self, keys: dict[str, Any], depth: int) -> tuple[FeedForward, ...]:
        if keys["intermediate_size"] is None:
            raise ValueError("no 'intermediate_size' (the hidden size of every expert)")
        moe = MoEConfig(
            keys["intermediate_size"], keys["num_local_experts"], keys["num_experts_per_tok"]
        )
        return (moe,) * depth

    def write(self, config: GPTConfig, loaded: dict[str, Any]) -> dict[str, Any]:
        """The ``config.json`` keys of ``config``'s mixtures (``{}`` without one)."""
        moe = [f for b in config.block_configs if isinstance(f := b.feed_forward, MoEConfig)]
        if not moe:
            return {}
        return {
            "intermediate_size": moe[0].hidden,
            "num_local_experts": moe[0].num_experts,
            "num_experts_per_tok": moe[0].top_k,
            "router_aux_loss_coef": config.router_aux_loss_coef,
        }


@dataclasses.dataclass(frozen=True)
class MistralFamily(Family):
    """A Llama whose every attention sees ``sliding_window`` positions (``AttentionConfig``'s;
    ``null``: every earlier one), read from and written to ``config.json``.

    Example:
        >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...           num_key_value_heads=2, intermediate_size=64, sliding_window=4)
        >>> MISTRAL.gpt_config(hf).block_configs[1].attention.sliding_window
        4
        >>> MISTRAL.hf_config(MISTRAL.gpt_config(hf), "float32")["sliding_window"]
        4
    """

    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        out = super().hf_config(config, torch_dtype, loaded)
        del out["attention_bias"]  # not a Mistral key: its projections have none
        out["sliding_window"] = config.block_configs[0].attention.sliding_window
        implied = out["head_dim"] * out["num_attention_heads"] == config.dim
        if implied and (loaded or {}).get("head_dim", 0) is None:  # the file's spelling: null
            out["head_dim"] = None
        return out


@dataclasses.dataclass(frozen=True)
class MixtralFamily(MistralFamily):
    """Mistral with Mixtral's experts in every layer (:class:`MixtralFeedForward`).

    Example:
        >>> MIXTRAL.cannot_hold(GPTConfig(gated_mlp=True, mlp_bias=False, experts=4, moe_every=2))
        ['dense feed-forward layers (MixtralForCausalLM: experts in every layer)']
    """

    feed_forward: DenseFeedForward = MixtralFeedForward()

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        name, blocks = self.architecture, config.block_configs
        moe = [b.feed_forward for b in blocks if isinstance(b.feed_forward, MoEConfig)]
        checks = (
            (
                moe and any(isinstance(b.feed_forward, MLPConfig) for b in blocks),
                f"dense feed-forward layers ({name}: experts in every layer)",
            ),
            (
                any(not f.norm_topk_prob for f in moe),
                f"top-k weights not renormalised ({name} renormalises them)",
            ),
        )
        return super().cannot_hold(config) + [what for failed, what in checks if failed]


MISTRAL = MistralFamily(
    architecture="MistralForCausalLM", model_type="mistral", qk_norm=False, sliding_window=True
)
MIXTRAL = MixtralFamily(
    architecture="MixtralForCausalLM", model_type="mixtral", qk_norm=False, sliding_window=True
)
