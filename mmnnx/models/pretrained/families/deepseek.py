"""DeepSeek-V3 (and Kimi K2, which ships as ``DeepseekV3ForCausalLM``): multi-head latent
attention in every layer, dense SiLU-gated MLPs in the first ``first_k_dense_replace`` layers
and DeepSeek's mixture of experts after them."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.base import MLP, MOE, T, hf_keys, outer
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import read_config
from mmnnx.models.pretrained.names import TensorRule
from mmnnx.modules import (
    BlockConfig,
    DeepSeekMoEConfig,
    LatentAttentionConfig,
    MLPConfig,
    NormConfig,
    RopeConfig,
    YarnScaling,
)

_L = "model.layers.{layer}"
_B = "blocks/{layer}"

_ATTENTION = (
    TensorRule(f"{_L}.input_layernorm.weight", f"{_B}/norm1/scale"),
    TensorRule(f"{_L}.post_attention_layernorm.weight", f"{_B}/norm2/scale"),
    TensorRule(f"{_L}.self_attn.kv_a_proj_with_mqa.weight", f"{_B}/attn/kv_a/kernel", T),
    TensorRule(f"{_L}.self_attn.kv_a_layernorm.weight", f"{_B}/attn/kv_norm/scale"),
    TensorRule(f"{_L}.self_attn.kv_b_proj.weight", f"{_B}/attn/kv_b/kernel", T),
    TensorRule(f"{_L}.self_attn.o_proj.weight", f"{_B}/attn/out/kernel", T),
    TensorRule(f"{_L}.self_attn.rotary_emb.inv_freq", None),  # a buffer, recomputed
)
_LOW_RANK_QUERY = (
    TensorRule(f"{_L}.self_attn.q_a_proj.weight", f"{_B}/attn/q_a/kernel", T),
    TensorRule(f"{_L}.self_attn.q_a_layernorm.weight", f"{_B}/attn/q_norm/scale"),
    TensorRule(f"{_L}.self_attn.q_b_proj.weight", f"{_B}/attn/q_b/kernel", T),
)
_QUERY = (TensorRule(f"{_L}.self_attn.q_proj.weight", f"{_B}/attn/q/kernel", T),)
_MOE = (*MOE, TensorRule(f"{_L}.mlp.gate.e_score_correction_bias", f"{_B}/mlp/correction_bias"))
_SHARED = tuple(
    TensorRule(f"{_L}.mlp.shared_experts.{n}_proj.weight", f"{_B}/mlp/shared/{n}/kernel", T)
    for n in ("gate", "up", "down")
)
_MTP_OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_OWN += ("shared_head.norm.weight", "shared_head.head.weight")
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
"""``config.json`` ``model_type``s read as DeepSeek-V3 (Kimi K2 names its own)."""


@dataclasses.dataclass(frozen=True)
class DeepSeekFamily:
    """``DeepseekV3ForCausalLM``: a :class:`~mmnnx.models.pretrained.families.PretrainedFamily`.

    Example:
        >>> DEEPSEEK_V3.architecture, DEEPSEEK_V3.model_type
        ('DeepseekV3ForCausalLM', 'deepseek_v3')
    """

    architecture: str = "DeepseekV3ForCausalLM"
    model_type: str = "deepseek_v3"

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig:
        """The ``GPTConfig`` of a ``config.json`` in directory ``where``, with ``overrides``.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            ...           intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
            ...           num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=None,
            ...           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
            ...           first_k_dense_replace=1)
            >>> blocks = DEEPSEEK_V3.gpt_config(hf).block_configs
            >>> type(blocks[0].feed_forward).__name__, blocks[1].feed_forward.shared_hidden
            ('MLPConfig', 16)
        """
        file = f"{where}/config.json ({self.architecture})"
        c = read_config(hf, file, self.model_type)  # checked, both dialects, defaults filled
        kind = hf.get("model_type", self.model_type)
        if kind not in MODEL_TYPES:
            raise CheckpointError(
                f"{file}: model_type {kind!r} is not one mmnnx reads as DeepSeek-V3 "
                f"({', '.join(MODEL_TYPES)})"
            )
        o = c.own
        if hf.get("attention_bias"):
            raise CheckpointError(
                f"{file}: attention_bias=true is not supported; mmnnx's LatentAttention has "
                "no biases"
            )
        key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
        rope = hf.get(key) or {}  # read_config checked it is an object
        scaled = c.rope_scaling is not None and not isinstance(c.rope_scaling, YarnScaling)
        if scaled and rope.get("mscale_all_dim"):  # transformers squares its factor into the scale
            raise CheckpointError(
                f"{file}: {key}.mscale_all_dim: {rope['mscale_all_dim']!r} with rope_type "
                f"{rope.get('rope_type', rope.get('type'))!r} is not supported; mmnnx scales "
                "latent attention's scores by mscale_all_dim with YaRN RoPE only"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise CheckpointError(
                f"{file}: hidden_act={hf['hidden_act']!r} is not supported; mmnnx's GPT has "
                "only SiLU-gated MLPs ('silu')"
            )
        if c.num_key_value_heads != c.num_attention_heads:
            raise CheckpointError(
                f"{file}: num_key_value_heads {c.num_key_value_heads} is not "
                f"num_attention_heads {c.num_attention_heads}; latent attention expands one "
                "key and value per head"
            )
        try:
            attention = LatentAttentionConfig(
                c.num_attention_heads,
                kv_lora_rank=o["kv_lora_rank"],
                qk_nope_head_dim=o["qk_nope_head_dim"],
                qk_rope_head_dim=o["qk_rope_head_dim"],
                v_head_dim=o["v_head_dim"],
                q_lora_rank=o["q_lora_rank"],
                rope=RopeConfig(c.rope_theta, c.rope_scaling),
                rope_interleave=o["rope_interleave"],
            )
            moe = DeepSeekMoEConfig(
                o["moe_intermediate_size"],
                o["n_routed_experts"],
                o["num_experts_per_tok"],
                norm_topk_prob=o["norm_topk_prob"],
                n_group=o["n_group"],
                topk_group=o["topk_group"],
                routed_scaling_factor=float(o["routed_scaling_factor"]),
                shared_hidden=(o["n_shared_experts"] or 0) * o["moe_intermediate_size"] or None,
            )
            dense = MLPConfig(c.intermediate_size, gated=True, bias=False)
            norm = NormConfig("rms", c.rms_norm_eps)
            first = o["first_k_dense_replace"]
            layers = tuple(
                BlockConfig(attention, dense if i < first else moe, norm)
                for i in range(c.num_hidden_layers)
            )
            # latent attention: no key/value heads; transformers adds no router loss
            return c.gpt_config(layers, overrides, num_kv_heads=None, router_aux_loss_coef=0.0)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: {e}") from None

    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A ``config.json``'s keys for ``config``, as transformers 5 writes DeepSeek-V3's.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            ...           intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
            ...           num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
            ...           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=8,
            ...           first_k_dense_replace=1)
            >>> out = DEEPSEEK_V3.hf_config(DEEPSEEK_V3.gpt_config(hf), "float32")
            >>> out["first_k_dense_replace"], out["n_shared_experts"], out["q_lora_rank"]
            (1, 1, 8)
        """
        blocks = config.block_configs
        a: LatentAttentionConfig = blocks[0].attention
        dense = [b.feed_forward for b in blocks if isinstance(b.feed_forward, MLPConfig)]
        moes = [b.feed_forward for b in blocks if isinstance(b.feed_forward, DeepSeekMoEConfig)]
        kind = (loaded or {}).get("model_type")
        out = hf_keys(self, config, torch_dtype) | {
            "model_type": kind if kind in MODEL_TYPES else self.model_type,
            "num_key_value_heads": a.num_heads,
            "head_dim": a.qk_rope_head_dim,
            "qk_head_dim": a.qk_nope_head_dim + a.qk_rope_head_dim,
            "kv_lora_rank": a.kv_lora_rank,
            "q_lora_rank": a.q_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "rope_interleave": a.rope_interleave,
            "first_k_dense_replace": len(dense),
            "hidden_act": "silu",
            "attention_bias": False,
            "num_nextn_predict_layers": 0,  # mmnnx's GPT has no multi-token prediction layers
        }
        if dense:
            out["intermediate_size"] = dense[0].hidden
        if moes:
            m = moes[0]
            out |= {
                "moe_intermediate_size": m.hidden,
                "n_routed_experts": m.num_experts,
                "num_experts_per_tok": m.top_k,
                "n_shared_experts": (m.shared_hidden or 0) // m.hidden,
                "n_group": m.n_group,
                "topk_group": m.topk_group,
                "norm_topk_prob": m.norm_topk_prob,
                "routed_scaling_factor": m.routed_scaling_factor,
            }
        return out

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        """What of ``config`` a DeepSeek-V3 checkpoint cannot hold (nothing: ``[]``).

        Example:
            >>> DEEPSEEK_V3.cannot_hold(GPTConfig(gated_mlp=True, mlp_bias=False))
            ['attention other than latent attention (DeepseekV3ForCausalLM: MLA)']
        """
        name, blocks = self.architecture, config.block_configs
        attention = {b.attention for b in blocks}
        feed = [b.feed_forward for b in blocks]
        first = next((i for i, f in enumerate(feed) if not isinstance(f, MLPConfig)), len(feed))
        dense, moes = set(feed[:first]), set(feed[first:])
        shared = {getattr(m, "shared_hidden", None) for m in moes}
        hidden = {getattr(m, "hidden", None) for m in moes}
        checks = (
            (not all(isinstance(a, LatentAttentionConfig) for a in attention),
             f"attention other than latent attention ({name}: MLA)"),
            (len(attention) > 1, "layers of different attention"),
            (any(not f.gated or f.bias for f in dense),
             f"an ungated or biased MLP ({name}: SiLU-gated, no biases)"),
            (not all(isinstance(m, DeepSeekMoEConfig) for m in moes),
             f"dense layers after mixture-of-experts ones, or another router ({name}: "
             "first_k_dense_replace dense layers, then DeepSeekMoE)"),
            (len(dense) > 1 or len(moes) > 1, "feed-forwards of different sizes"),
            (any(s is not None and h and s % h for s in shared for h in hidden),
             f"shared experts whose size is not a multiple of the experts' ({name})"),
            ({config.norm} | {b.norm.kind for b in blocks} != {"rms"}, f"LayerNorm ({name})"),
            (any(f.activation not in (None, "silu") for f in dense), f"a non-SiLU MLP ({name})"),
            (any(b.norm.scale_offset for b in blocks)
             or getattr(config.final_norm, "scale_offset", 0),
             f"Gemma's (1 + weight) norms ({name}: none)"),
            (any(b.post_norms for b in blocks), f"norms after attention and MLP ({name}: none)"),
            (config.embed_scale is not None, f"scaled embeddings ({name}: unscaled)"),
        )  # fmt: skip
        return [what for failed, what in checks if failed]

    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]:
        """Which checkpoint tensor fills which Variable of ``GPT(config)``; the tensors of
        multi-token prediction layers (``model.layers.{depth}..``, as published) fill none.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            ...           intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
            ...           num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16,
            ...           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=8,
            ...           first_k_dense_replace=1)
            >>> rules = DEEPSEEK_V3.tensor_rules(DEEPSEEK_V3.gpt_config(hf))
            >>> [r.variable for r in rules if r.tensor.endswith("e_score_correction_bias")]
            [None, 'blocks/{layer}/mlp/correction_bias']
        """
        blocks = config.block_configs
        attention = blocks[0].attention
        query = _QUERY if getattr(attention, "q_lora_rank", None) is None else _LOW_RANK_QUERY
        moe = any(isinstance(b.feed_forward, DeepSeekMoEConfig) for b in blocks)
        shared = any(getattr(b.feed_forward, "shared_hidden", None) for b in blocks)
        layer = _ATTENTION + query + MLP + (_MOE if moe else ()) + (_SHARED if shared else ())
        every = _ATTENTION + _LOW_RANK_QUERY + _QUERY + MLP + _MOE + _SHARED
        mtp = tuple(  # published checkpoints' next-token prediction layer after the last
            TensorRule(r.tensor.replace("{layer}", str(config.depth)), None)
            for r in every + tuple(TensorRule(f"{_L}.{n}", None) for n in _MTP_OWN)
        )
        return mtp + outer(layer, config)


DEEPSEEK_V3 = DeepSeekFamily()
