"""gpt-oss (``GptOssForCausalLM``, ``model_type`` ``gpt_oss``): sliding-window and full
attention layers (``layer_types``) with biases and attention sinks, YaRN RoPE, and a mixture
of experts in every layer (a biased router; experts with biases and a clamped SwiGLU, stored
fused as transformers 5 writes them, or in MXFP4 as published: :mod:`..mxfp4`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.base import FULL, SLIDING, T, hf_keys, kinds_of, outer
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import read_config
from mmnnx.models.pretrained.names import TensorRule
from mmnnx.modules import AttentionConfig, BlockConfig, ClampedMoEConfig, NormConfig, RopeConfig

DEFAULT_ROPE = {  # transformers' GptOssConfig's, where config.json gives no RoPE parameters
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

DEFAULT_WINDOW = 128  # transformers' GptOssConfig's sliding_window

_P = "model.layers.{layer}"
_A, _E = f"{_P}.self_attn", f"{_P}.mlp.experts"
_LAYER = (
    TensorRule(f"{_P}.input_layernorm.weight", "blocks/{layer}/norm1/scale"),
    *(
        rule
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj"))
        for rule in (
            TensorRule(f"{_A}.{theirs}.weight", f"blocks/{{layer}}/attn/{ours}/kernel", T),
            TensorRule(f"{_A}.{theirs}.bias", f"blocks/{{layer}}/attn/{ours}/bias"),
        )
    ),
    TensorRule(f"{_A}.sinks", "blocks/{layer}/attn/sinks"),
    TensorRule(f"{_P}.post_attention_layernorm.weight", "blocks/{layer}/norm2/scale"),
    TensorRule(f"{_P}.mlp.router.weight", "blocks/{layer}/mlp/router/kernel", T),
    TensorRule(f"{_P}.mlp.router.bias", "blocks/{layer}/mlp/router/bias"),
    TensorRule(f"{_E}.gate_up_proj", "blocks/{layer}/mlp/experts/gate_up"),  # (E, in, out)
    TensorRule(f"{_E}.gate_up_proj_bias", "blocks/{layer}/mlp/experts/gate_up_bias"),
    TensorRule(f"{_E}.down_proj", "blocks/{layer}/mlp/experts/down"),
    TensorRule(f"{_E}.down_proj_bias", "blocks/{layer}/mlp/experts/down_bias"),
)


def standard_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """``hf`` with transformers' ``GptOssConfig`` defaults for what it leaves out:
    ``layer_types`` (sliding, full, sliding, ...) and YaRN's RoPE parameters.

    Example:
        >>> out = standard_keys({"num_hidden_layers": 3})
        >>> out["layer_types"], out["rope_parameters"]["factor"]
        (['sliding_attention', 'full_attention', 'sliding_attention'], 32.0)
    """
    out = dict(hf)
    layers = hf.get("num_hidden_layers")
    if hf.get("layer_types") is None and type(layers) is int and layers > 0:
        out["layer_types"] = [FULL if (i + 1) % 2 == 0 else SLIDING for i in range(layers)]
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        out["rope_parameters"] = dict(DEFAULT_ROPE)
    return out


@dataclasses.dataclass(frozen=True)
class GptOssFamily:
    """``GptOssForCausalLM``: a ``GPTConfig`` of one ``BlockConfig`` per layer, each with an
    ``AttentionConfig`` of biases and sinks (``sliding_window`` in ``sliding_attention``
    layers) and a ``ClampedMoEConfig`` of ``num_local_experts`` experts of
    ``intermediate_size`` features, ``num_experts_per_tok`` a token.

    Example:
        >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...           num_key_value_heads=2, head_dim=8, intermediate_size=32,
        ...           num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
        >>> blocks = GPT_OSS.gpt_config(hf).block_configs
        >>> [(b.attention.sliding_window, b.attention.sinks) for b in blocks]
        [(4, True), (None, True)]
        >>> blocks[0].feed_forward
        ClampedMoEConfig(hidden=32, num_experts=4, top_k=2, norm_topk_prob=True, \
capacity_factor=None, alpha=1.702, limit=7.0)
    """

    architecture: str = "GptOssForCausalLM"
    model_type: str = "gpt_oss"

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig:
        """The ``GPTConfig`` of a ``config.json`` in directory ``where``, with ``overrides``.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1,
            ...           num_attention_heads=4, num_key_value_heads=4, attention_bias=False)
            >>> GPT_OSS.gpt_config(hf, "ckpt")
            Traceback (most recent call last):
            ...
            mmnnx.models.pretrained.files.CheckpointError: ckpt/config.json \
(GptOssForCausalLM): attention_bias: false is not supported; gpt-oss's projections have biases
        """
        file = f"{where}/config.json ({self.architecture})"
        standard = standard_keys(hf) if isinstance(hf, dict) else hf
        c = read_config(standard, file, self.model_type)  # checked, both dialects, defaults
        if not c.own["attention_bias"]:
            raise CheckpointError(
                f"{file}: attention_bias: false is not supported; gpt-oss's projections have biases"
            )
        window = c.own["sliding_window"]
        kinds = kinds_of(standard["layer_types"], window, file)
        if c.intermediate_size is None:
            raise CheckpointError(f"{file}: no 'intermediate_size' (every expert's hidden size)")
        try:
            moe = ClampedMoEConfig(
                c.intermediate_size,
                c.own["num_local_experts"],
                c.own["num_experts_per_tok"],
                alpha=float(c.own["swiglu_alpha"]),
                limit=float(c.own["swiglu_limit"]),
            )
            attention = AttentionConfig(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                rope=RopeConfig(c.rope_theta, c.rope_scaling),
                bias=True,
                sinks=True,
            )
            each = {FULL: attention, SLIDING: dataclasses.replace(attention, sliding_window=window)}
            norm = NormConfig("rms", c.rms_norm_eps)
            layers = tuple(BlockConfig(each[kind], moe, norm) for kind in kinds)
            return c.gpt_config(
                layers, overrides, router_aux_loss_coef=c.own["router_aux_loss_coef"]
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: {e}") from None

    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A ``config.json``'s keys for ``config`` (a ``GPTConfig`` this family can hold; no
        ``quantization_config``: ``save_pretrained`` adds it when asked to write MXFP4).

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2,
            ...           num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
            ...           num_local_experts=4, num_experts_per_tok=2, sliding_window=4, head_dim=8)
            >>> out = GPT_OSS.hf_config(GPT_OSS.gpt_config(hf), "bfloat16")
            >>> out["layer_types"], out["rope_parameters"]["rope_type"], out["swiglu_limit"]
            (['sliding_attention', 'full_attention'], 'yarn', 7.0)
        """
        blocks = config.block_configs
        moe = blocks[0].feed_forward
        out = hf_keys(self, config, torch_dtype) | {
            "intermediate_size": moe.hidden,
            "attention_bias": True,
            "layer_types": [SLIDING if b.attention.sliding_window else FULL for b in blocks],
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "swiglu_alpha": moe.alpha,
            "swiglu_limit": moe.limit,
            "router_aux_loss_coef": config.router_aux_loss_coef,
        }
        windows = {b.attention.sliding_window for b in blocks} - {None}
        # transformers' gpt-oss builds a sliding mask even where no layer slides: a window is
        # written always (the loaded file's, else GptOssConfig's default)
        unused = (loaded or {}).get("sliding_window") or DEFAULT_WINDOW
        out["sliding_window"] = windows.pop() if windows else unused
        return out

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        """What of ``config`` a gpt-oss checkpoint cannot hold (nothing: ``[]``).

        Example:
            >>> GPT_OSS.cannot_hold(GPTConfig(experts=4))[:2]
            ['an attention without biases and sinks (GptOssForCausalLM: both)', \
'a feed-forward other than ClampedMoEConfig experts (GptOssForCausalLM: in every layer)']
        """
        name, blocks = self.architecture, config.block_configs
        attention = [b.attention for b in blocks]
        plain = all(isinstance(a, AttentionConfig) for a in attention)
        ffs = {b.feed_forward for b in blocks}
        norms = {b.norm for b in blocks} | {config.output_norm}
        shapes = {dataclasses.replace(a, sliding_window=None) for a in attention} if plain else ()
        checks = (
            (not plain or not all(a.bias and a.sinks for a in attention),
             f"an attention without biases and sinks ({name}: both)"),
            (not all(isinstance(f, ClampedMoEConfig) for f in ffs),
             f"a feed-forward other than ClampedMoEConfig experts ({name}: in every layer)"),
            (len(ffs) > 1, "layers of different experts"),
            (plain and len(shapes) > 1, "layers of different attention shapes or RoPE"),
            (plain and any(a.rope is None or a.qk_norm or a.query_pre_attn_scalar
                           for a in attention),
             f"attention without RoPE, with query/key norms or another score scale ({name})"),
            (plain and len({a.sliding_window for a in attention} - {None}) > 1,
             "sliding layers of different windows"),
            (not all(n.kind == "rms" and not n.scale_offset for n in norms),
             f"norms other than RMSNorm ({name})"),
            (any(b.post_norms for b in blocks), f"norms after attention ({name}: none)"),
            (config.embed_scale is not None, f"scaled embeddings ({name}: none)"),
        )  # fmt: skip
        return [what for failed, what in checks if failed]

    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]:
        """Which checkpoint tensor fills which Variable of ``GPT(config)`` (the experts'
        ``*_blocks`` / ``*_scales`` of an MXFP4 checkpoint read as the fused tensors they
        dequantize to).

        Example:
            >>> rules = GPT_OSS.tensor_rules(GPTConfig())
            >>> [r.variable for r in rules if r.tensor.endswith("gate_up_proj")]
            ['blocks/{layer}/mlp/experts/gate_up']
        """
        return outer(_LAYER, config)


GPT_OSS = GptOssFamily()
