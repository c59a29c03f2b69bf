"""Llama, Qwen3 and Qwen3-MoE: one attention in every layer, a SiLU-gated MLP or Qwen3-MoE's
experts, RMSNorm. Qwen3-MoE's experts are read in the published per-expert layout
(``mlp.experts.{e}.gate_proj``..., the names mmnnx writes) or in the fused layout transformers 5
holds in memory and also loads (``mlp.experts.gate_up_proj`` ``(experts, 2 * moe_intermediate,
hidden)``: gate's rows then up's, ``mlp.experts.down_proj`` ``(experts, hidden,
moe_intermediate)``)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.base import (
    ATTENTION,
    MLP,
    MOE,
    QK_NORM,
    Unsupported,
    hf_keys,
    outer,
    refuse,
)
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import read_config
from mmnnx.models.pretrained.names import Part, TensorRule
from mmnnx.modules import AttentionConfig, BlockConfig, MLPConfig, MoEConfig, NormConfig, RopeConfig

_LAYER = (
    TensorRule("model.layers.{layer}.input_layernorm.weight", "blocks/{layer}/norm1/scale"),
    *ATTENTION,
    TensorRule(
        "model.layers.{layer}.post_attention_layernorm.weight", "blocks/{layer}/norm2/scale"
    ),
    *MLP,
    TensorRule("model.layers.{layer}.self_attn.rotary_emb.inv_freq", None),  # a buffer, recomputed
)
_FUSED = (0, 2, 1)  # (experts, out, in) on disk, (experts, in, out) as the stacked kernels
FUSED_EXPERTS = (  # read only: transformers 5's in-memory layout, every expert in one
    *(
        TensorRule(
            "model.layers.{layer}.mlp.experts.gate_up_proj",
            f"blocks/{{layer}}/mlp/experts/{name}",
            _FUSED,
            part=Part(axis=1, index=i, count=2),  # gate's rows, then up's
        )
        for i, name in enumerate(("gate", "up"))
    ),
    TensorRule(
        "model.layers.{layer}.mlp.experts.down_proj", "blocks/{layer}/mlp/experts/down", _FUSED
    ),
)


FeedForward = MLPConfig | MoEConfig


@dataclasses.dataclass(frozen=True)
class DenseFeedForward:
    """Llama's and Qwen3's feed-forward: how ``config.json`` reads and writes it, its tensors.

    Example:
        >>> DenseFeedForward().read({"intermediate_size": 64}, 2)[1]
        MLPConfig(hidden=64, gated=True, bias=False, activation=None)
    """

    rules: ClassVar[tuple[TensorRule, ...]] = ()
    experts: ClassVar[bool] = False

    def read(self, keys: dict[str, Any], depth: int) -> tuple[FeedForward, ...]:
        return (_mlp(keys),) * depth

    def write(self, config: GPTConfig, loaded: dict[str, Any]) -> dict[str, Any]:
        """The ``config.json`` keys of ``config``'s feed-forwards (``loaded``'s spelling kept)."""
        dense = [f for b in config.block_configs if isinstance(f := b.feed_forward, MLPConfig)]
        return {"intermediate_size": dense[0].hidden} if dense else {}


@dataclasses.dataclass(frozen=True)
class Qwen3MoeFeedForward(DenseFeedForward):
    """Qwen3-MoE's: a ``MoEConfig`` in layer ``i`` when ``(i + 1) % decoder_sparse_step == 0``
    and ``i`` is not in ``mlp_only_layers``, else the dense MLP.

    Example:
        >>> keys = dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        ...             norm_topk_prob=True, intermediate_size=64, decoder_sparse_step=2,
        ...             mlp_only_layers=())
        >>> [type(f).__name__ for f in Qwen3MoeFeedForward().read(keys, 2)]
        ['MLPConfig', 'MoEConfig']
    """

    rules: ClassVar[tuple[TensorRule, ...]] = MOE + FUSED_EXPERTS
    experts: ClassVar[bool] = True

    def read(self, keys: dict[str, Any], depth: int) -> tuple[FeedForward, ...]:
        moe = MoEConfig(
            keys["moe_intermediate_size"],
            keys["num_local_experts"],
            keys["num_experts_per_tok"],
            norm_topk_prob=keys["norm_topk_prob"],
        )
        step, dense = keys["decoder_sparse_step"], keys["mlp_only_layers"]
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(depth)]
        return tuple(moe if s else _mlp(keys) for s in sparse)

    def write(self, config: GPTConfig, loaded: dict[str, Any]) -> dict[str, Any]:
        layers = [b.feed_forward for b in config.block_configs]
        moe = [i for i, f in enumerate(layers) if isinstance(f, MoEConfig)]
        if not moe:
            return super().write(config, loaded)
        steps = [n for n in range(1, len(layers) + 1) if all((i + 1) % n == 0 for i in moe)]
        dense = {n: [i for i in range(n - 1, len(layers), n) if i not in moe] for n in steps}
        step, first = min(steps, key=lambda n: len(dense[n])), layers[moe[0]]
        was = loaded.get("decoder_sparse_step"), loaded.get("mlp_only_layers") or []
        if was[0] in dense and sorted(was[1]) == dense[was[0]]:  # the file's own spelling
            step = was[0]
        return super().write(config, loaded) | {
            "num_local_experts": first.num_experts,
            "num_experts_per_tok": first.top_k,
            "moe_intermediate_size": first.hidden,
            "norm_topk_prob": first.norm_topk_prob,
            "decoder_sparse_step": step,
            "mlp_only_layers": dense[step],
            "router_aux_loss_coef": config.router_aux_loss_coef,
        }


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture of ``config.json``'s ``architectures``."""

    architecture: str
    model_type: str
    qk_norm: bool
    feed_forward: DenseFeedForward = DenseFeedForward()
    sliding_window: bool = False  # its config.json can give the attention a window

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig:
        """The ``GPTConfig`` of a ``config.json`` in directory ``where``, with ``overrides``.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            ...           num_key_value_heads=4, head_dim=8, intermediate_size=64, rope_theta=1e6)
            >>> config = QWEN3.gpt_config(hf)
            >>> config.block_configs[0].attention.rope, config.block_configs[0].attention.qk_norm
            (RopeConfig(theta=1000000.0, scaling=None), True)
        """
        file = f"{where}/config.json ({self.architecture})"
        c = read_config(hf, file, self.model_type)  # checked, both dialects, defaults filled
        refuse(hf, _UNSUPPORTED, file)
        keys = {"intermediate_size": c.intermediate_size, **c.own}
        try:
            attention = AttentionConfig(
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
                qk_norm=self.qk_norm,
                qk_norm_eps=c.rms_norm_eps,
                rope=RopeConfig(c.rope_theta, c.rope_scaling),
                sliding_window=c.own.get("sliding_window"),  # Mistral's, Mixtral's
            )
            norm = NormConfig("rms", c.rms_norm_eps)
            layers = self.feed_forward.read(keys, c.num_hidden_layers)
            layers = tuple(BlockConfig(attention, ff, norm) for ff in layers)
            own_coef = c.own.get("router_aux_loss_coef", 0.001)
            return c.gpt_config(layers, overrides, router_aux_loss_coef=own_coef)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: {e}") from None

    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A ``config.json``'s keys for ``config``, spelled as in ``loaded`` where equivalent.

        Example:
            >>> LLAMA.hf_config(GPTConfig(), "float32")["hidden_size"]
            128
        """
        out = hf_keys(self, config, torch_dtype) | {
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if self.model_type == "qwen3":  # transformers 5 writes Qwen3's (not Llama's)
            out["layer_types"] = ["full_attention"] * config.depth
        return {**out, **self.feed_forward.write(config, loaded or {})}

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        """What of ``config`` this family's checkpoints cannot hold (nothing: ``[]``).

        Example:
            >>> LLAMA.cannot_hold(GPTConfig())
            ['an ungated GELU MLP (LlamaForCausalLM: SiLU-gated)', 'MLP biases']
            >>> QWEN3.cannot_hold(GPTConfig(gated_mlp=True))
            ['MLP biases', 'no query/key norms (Qwen3ForCausalLM: RMSNorm on both)']
        """
        name, blocks = self.architecture, config.block_configs
        dense = [b.feed_forward for b in blocks if isinstance(b.feed_forward, MLPConfig)]
        qk_norm = {getattr(b.attention, "qk_norm", None) for b in blocks}
        norms = {config.norm} | {b.norm.kind for b in blocks}
        own = self.feed_forward.experts
        moes = {b.feed_forward for b in blocks if isinstance(b.feed_forward, MoEConfig)}
        no_rope = any(getattr(b.attention, "rope", 0) is None for b in blocks)
        windowed = any(getattr(b.attention, "sliding_window", None) for b in blocks)
        offsets = {b.norm.scale_offset for b in blocks} | {
            getattr(config.final_norm, "scale_offset", 0)
        }
        gemma_attention = any(
            getattr(b.attention, "qk_norm_offset", 0)
            or getattr(b.attention, "query_pre_attn_scalar", None)
            for b in blocks
        )
        checks = (  # config.json holds one attention, one dense MLP and one mixture for every layer
            (any(not f.gated for f in dense), f"an ungated GELU MLP ({name}: SiLU-gated)"),
            (any(f.bias for f in dense), "MLP biases"),
            (norms != {"rms"}, f"LayerNorm ({name}: RMSNorm)"),
            (
                not all(isinstance(b.attention, AttentionConfig) for b in blocks),
                f"an attention other than AttentionConfig ({name})",
            ),
            (True in qk_norm and not self.qk_norm, f"query/key norms ({name}: none)"),
            (False in qk_norm and self.qk_norm, f"no query/key norms ({name}: RMSNorm on both)"),
            (moes and not own, f"mixture-of-experts blocks ({name}: dense)"),
            (not moes and own, f"no mixture-of-experts blocks ({name})"),
            (len({b.attention for b in blocks}) > 1, "layers of different attention"),
            (no_rope, f"attention without RoPE ({name}: RoPE)"),
            (windowed and not self.sliding_window, f"a sliding window ({name}: full attention)"),
            (len(set(dense)) > 1 or len(moes) > 1, "feed-forwards of different sizes"),
            (any(f.activation not in (None, "silu") for f in dense), f"a non-SiLU MLP ({name})"),
            (any(b.post_norms for b in blocks), f"norms after attention and MLP ({name}: none)"),
            (offsets != {0} or gemma_attention, f"Gemma's norms or score scale ({name}: none)"),
            (config.embed_scale is not None, f"scaled embeddings ({name}: unscaled)"),
        )
        return [what for failed, what in checks if failed]

    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]:
        """Which checkpoint tensor fills which Variable of ``GPT(config)``.

        Example:
            >>> rules = QWEN3.tensor_rules(GPTConfig(qk_norm=True))
            >>> [r.variable for r in rules if "q_norm" in r.tensor]
            ['blocks/{layer}/attn/q_norm/scale']
            >>> moe = GPTConfig(qk_norm=True, experts=8, scan_layers=True)
            >>> down = [r for r in QWEN3_MOE.tensor_rules(moe) if "experts/down" in str(r.variable)]
            >>> [r.stacked for r in down]  # every layer's experts in one: per expert, or fused
            [('layer', 'expert'), ('layer',)]
        """
        qk_norm = any(getattr(b.attention, "qk_norm", False) for b in config.block_configs)
        return outer(_LAYER + (QK_NORM if qk_norm else ()) + self.feed_forward.rules, config)


LLAMA = Family(architecture="LlamaForCausalLM", model_type="llama", qk_norm=False)
QWEN3 = Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True)
QWEN3_MOE = Family(
    architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    qk_norm=True,
    feed_forward=Qwen3MoeFeedForward(),
)


def _mlp(keys: dict[str, Any]) -> MLPConfig:
    if keys["intermediate_size"] is None:
        raise ValueError("no 'intermediate_size' (the hidden size of its dense MLP layers)")
    return MLPConfig(keys["intermediate_size"], gated=True, bias=False)


_UNSUPPORTED: Unsupported = (
    ("hidden_act", lambda v: v not in (None, "silu"), "only SiLU-gated MLPs ('silu')"),
    ("attention_bias", bool, "attention projections without biases"),
    ("mlp_bias", bool, "MLP projections without biases"),
    ("use_sliding_window", bool, "full attention in every layer (no sliding window)"),
    (
        "layer_types",
        lambda v: v is not None and any(t != "full_attention" for t in v),
        "full attention in every layer",
    ),
)
