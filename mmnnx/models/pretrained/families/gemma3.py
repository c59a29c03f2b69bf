"""Gemma 3's text model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): local
sliding-window and global layers (``layer_types``), each kind with its own RoPE, four
``(1 + weight)`` RMSNorms per block, GeGLU, query/key norms, scores scaled by
``query_pre_attn_scalar``, embeddings scaled by ``sqrt(hidden_size)`` and a tied head."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.base import (
    ATTENTION,
    FULL,
    MLP,
    QK_NORM,
    SLIDING,
    hf_keys,
    kinds_of,
    outer,
    refuse,
)
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import read_config, rope_parameters
from mmnnx.models.pretrained.names import TensorRule
from mmnnx.modules import AttentionConfig, BlockConfig, MLPConfig, NormConfig, RopeConfig
from mmnnx.modules.mlp import ACTIVATIONS

DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}  # transformers' Gemma3TextConfig's
"""RoPE's base of each layer type where ``config.json`` gives none."""

_P = "model.layers.{layer}"
_LAYER = (
    TensorRule(f"{_P}.input_layernorm.weight", "blocks/{layer}/norm1/scale"),
    *ATTENTION,
    *QK_NORM,
    TensorRule(f"{_P}.post_attention_layernorm.weight", "blocks/{layer}/post_attn_norm/scale"),
    TensorRule(f"{_P}.pre_feedforward_layernorm.weight", "blocks/{layer}/norm2/scale"),
    TensorRule(f"{_P}.post_feedforward_layernorm.weight", "blocks/{layer}/post_mlp_norm/scale"),
    *MLP,
)

_UNSUPPORTED = (  # config.json keys whose non-default values mmnnx's GPT does not compute
    ("attn_logit_softcapping", lambda v: v is not None, "no attention logit soft-capping (null)"),
    ("final_logit_softcapping", lambda v: v is not None, "no final logit soft-capping (null)"),
    ("use_bidirectional_attention", bool, "causal attention (false)"),
    ("attention_bias", bool, "attention projections without biases (false)"),
)


def standard_keys(hf: dict[str, Any], file: str) -> dict[str, Any]:
    """``hf`` with ``layer_types`` and per-layer-type ``rope_parameters`` filled in from older
    Gemma 3 keys as transformers' ``Gemma3TextConfig`` does: ``sliding_window_pattern``
    (default 6: every 6th layer global), ``rope_theta`` and ``rope_scaling`` (global layers;
    theta default 1e6), ``rope_local_base_freq`` (sliding layers; default 1e4).

    Example:
        >>> old = {"num_hidden_layers": 3, "sliding_window_pattern": 3, "rope_theta": 1e6,
        ...        "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear",
        ...                                                      "factor": 8.0}}
        >>> new = standard_keys(old, "config.json")
        >>> new["layer_types"]
        ['sliding_attention', 'sliding_attention', 'full_attention']
        >>> new["rope_parameters"]["full_attention"]
        {'rope_type': 'linear', 'factor': 8.0, 'rope_theta': 1000000.0}
    """
    out = {k: v for k, v in hf.items() if k != "rope_scaling"}
    pattern, layers = hf.get("sliding_window_pattern", 6), hf.get("num_hidden_layers")
    if hf.get("layer_types") is None and all(type(n) is int and n > 0 for n in (pattern, layers)):
        out["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    params = hf.get("rope_parameters")
    if not isinstance(params, dict | None):
        return out  # read_config names it
    if params and not {FULL, SLIDING} & set(params):
        raise CheckpointError(
            f"{file}: rope_parameters: {sorted(params)} are not per layer type; Gemma 3 reads "
            f'{{"{FULL}": {{...}}, "{SLIDING}": {{...}}}}'
        )
    params = {t: dict(p) if isinstance(p, dict) else p for t, p in (params or {}).items()}
    for kind, older in ((FULL, "rope_theta"), (SLIDING, "rope_local_base_freq")):
        if params.get(kind) is None:
            params[kind] = {"rope_type": "default"}
        if not isinstance(params[kind], dict):
            continue  # read_config names it
        if kind == FULL and isinstance(hf.get("rope_scaling"), dict):
            params[kind].update(hf["rope_scaling"])
        theta = hf.get(older)
        params[kind].setdefault("rope_theta", DEFAULT_THETA[kind] if theta is None else theta)
    out["rope_parameters"] = params
    return out


@dataclasses.dataclass(frozen=True)
class Gemma3Family:
    """``Gemma3ForCausalLM``: a ``GPTConfig`` of one ``BlockConfig`` per layer, global layers
    (``full_attention``) with full causal attention and the global RoPE, sliding layers
    (``sliding_attention``) with ``sliding_window`` and the local RoPE.

    Example:
        >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...           num_key_value_heads=2, head_dim=16, intermediate_size=64,
        ...           sliding_window=4, sliding_window_pattern=2)
        >>> blocks = GEMMA3.gpt_config(hf).block_configs
        >>> [(b.attention.sliding_window, b.attention.rope.theta) for b in blocks]
        [(4, 10000.0), (None, 1000000.0)]
    """

    architecture: str = "Gemma3ForCausalLM"
    model_type: str = "gemma3_text"

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig:
        """The ``GPTConfig`` of a ``config.json`` in directory ``where``, with ``overrides``.

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1,
            ...           num_attention_heads=4, intermediate_size=64,
            ...           final_logit_softcapping=30.0)
            >>> GEMMA3.gpt_config(hf, "ckpt")
            Traceback (most recent call last):
            ...
            mmnnx.models.pretrained.files.CheckpointError: ckpt/config.json \
(Gemma3ForCausalLM): final_logit_softcapping=30.0 is not supported; mmnnx's GPT has no final \
logit soft-capping (null)
        """
        file = f"{where}/config.json ({self.architecture})"
        standard = standard_keys(hf, file) if isinstance(hf, dict) else hf
        c = read_config(standard, file, self.model_type)  # checked, both dialects, defaults
        refuse(hf, _UNSUPPORTED, file)
        window, activation = c.own["sliding_window"], c.own["hidden_activation"]
        kinds = kinds_of(standard["layer_types"], window, file)
        if activation not in ACTIVATIONS:
            raise CheckpointError(
                f"{file}: hidden_activation: {activation!r} is not supported; mmnnx computes "
                f"{', '.join(map(repr, ACTIVATIONS))}"
            )
        try:
            norm = NormConfig("rms", c.rms_norm_eps, scale_offset=1.0)
            mlp = MLPConfig(c.intermediate_size, gated=True, bias=False, activation=activation)

            def block(kind: str) -> BlockConfig:
                attention = AttentionConfig(
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    c.head_dim,
                    qk_norm=True,
                    qk_norm_eps=c.rms_norm_eps,
                    qk_norm_offset=1.0,
                    rope=RopeConfig(*c.ropes[kind]),
                    sliding_window=window if kind == SLIDING else None,
                    query_pre_attn_scalar=c.own["query_pre_attn_scalar"],
                )
                return BlockConfig(attention, mlp, norm, post_norms=True)

            layers = tuple(block(kind) for kind in kinds)
            return c.gpt_config(layers, overrides, final_norm=norm, embed_scale=c.hidden_size**0.5)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: {e}") from None

    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """A ``config.json``'s keys for ``config`` (a ``GPTConfig`` this family can hold).

        Example:
            >>> hf = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2,
            ...           num_attention_heads=4, intermediate_size=64, sliding_window=4,
            ...           sliding_window_pattern=2, head_dim=8)
            >>> out = GEMMA3.hf_config(GEMMA3.gpt_config(hf), "bfloat16")
            >>> out["layer_types"], out["rope_parameters"]["sliding_attention"]
            (['sliding_attention', 'full_attention'], {'rope_theta': 10000.0, \
'rope_type': 'default'})
        """
        blocks = config.block_configs
        attention = blocks[0].attention
        kinds = [SLIDING if b.attention.sliding_window else FULL for b in blocks]
        ropes = {kinds[i]: b.attention.rope for i, b in enumerate(blocks)}
        written = (loaded or {}).get("rope_parameters") or {}
        params = {k: rope_parameters(r.theta, r.scaling) for k, r in ropes.items()}
        for kind in (FULL, SLIDING):  # transformers writes both, whatever the layers
            params.setdefault(kind, written.get(kind) or rope_parameters(DEFAULT_THETA[kind], None))
        mlp, out = blocks[0].feed_forward, hf_keys(self, config, torch_dtype)
        out |= {
            "intermediate_size": mlp.hidden,
            "rope_parameters": dict(sorted(params.items())),
            "hidden_activation": mlp.activation or "silu",
            "attention_bias": False,
            "query_pre_attn_scalar": attention.query_pre_attn_scalar or out["head_dim"],
            "layer_types": kinds,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "use_bidirectional_attention": False,
        }
        windows = {b.attention.sliding_window for b in blocks} - {None}
        if windows:
            out["sliding_window"] = windows.pop()
        return out

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        """What of ``config`` a Gemma 3 checkpoint cannot hold (nothing: ``[]``).

        Example:
            >>> GEMMA3.cannot_hold(GPTConfig(gated_mlp=True, mlp_bias=False, qk_norm=True))[:3]
            ['RMSNorms without the (1 + weight) scale (Gemma3ForCausalLM: 1 + weight)', \
'no norms after attention and feed-forward (Gemma3ForCausalLM: four norms a block)', \
'no (1 + weight) query/key norms (Gemma3ForCausalLM: RMSNorm on both)']
        """
        name, blocks = self.architecture, config.block_configs
        attention = [b.attention for b in blocks]
        mlps = {b.feed_forward for b in blocks}
        norms = {b.norm for b in blocks} | {config.final_norm}
        plain = all(isinstance(a, AttentionConfig) for a in attention)
        kinds = {
            sliding: {a.rope for a in attention if bool(a.sliding_window) == sliding}
            for sliding in (True, False)
        } if plain else {}  # fmt: skip
        shapes = (
            {dataclasses.replace(a, rope=None, sliding_window=None) for a in attention}
            if plain
            else ()
        )
        scale = config.embed_scale
        checks = (
            (not all(isinstance(n, NormConfig) and n.kind == "rms" and n.scale_offset == 1
                     for n in norms), f"RMSNorms without the (1 + weight) scale ({name}: "
                                      "1 + weight)"),
            (not all(b.post_norms for b in blocks),
             f"no norms after attention and feed-forward ({name}: four norms a block)"),
            (not plain, f"an attention other than AttentionConfig ({name})"),
            (plain and not all(a.qk_norm and a.qk_norm_offset == 1 for a in attention),
             f"no (1 + weight) query/key norms ({name}: RMSNorm on both)"),
            (not all(isinstance(f, MLPConfig) and f.gated and not f.bias for f in mlps),
             f"a feed-forward other than a gated MLP without biases ({name}: GeGLU)"),
            (len(mlps) > 1, "feed-forwards of different sizes"),
            (plain and len(shapes) > 1, "layers of different attention shapes"),
            (plain and any(a.rope is None for a in attention), f"attention without RoPE ({name})"),
            (plain and any(len(r) > 1 for r in kinds.values()),
             "layers of one kind (sliding or global) with different RoPE"),
            (plain and len({a.sliding_window for a in attention} - {None}) > 1,
             "sliding layers of different windows"),
            (scale is None or not math.isclose(scale, config.dim**0.5, rel_tol=1e-12),
             f"embeddings not scaled by sqrt(dim) ({name}: {config.dim**0.5:.6g})"),
        )  # fmt: skip
        return [what for failed, what in checks if failed]

    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]:
        """Which checkpoint tensor fills which Variable of ``GPT(config)``.

        Example:
            >>> rules = GEMMA3.tensor_rules(GPTConfig(tie_embeddings=True))
            >>> [r.variable for r in rules if "feedforward" in r.tensor]
            ['blocks/{layer}/norm2/scale', 'blocks/{layer}/post_mlp_norm/scale']
        """
        return outer(_LAYER, config)


GEMMA3 = Gemma3Family()
