"""The model families ``from_pretrained`` knows: how a ``config.json`` becomes a ``GPTConfig``
and back, and which checkpoint tensor fills which ``GPT`` Variable (torchtitan's state-dict
adapters, as data)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import architectures, read_config, rope_parameters, written
from mmnnx.models.pretrained.names import TensorRule

T = (1, 0)  # Linear weights are (out, in) on disk and (in, out) as kernels

_LAYER = (
    TensorRule("model.layers.{layer}.input_layernorm.weight", "blocks/{layer}/norm1/scale"),
    TensorRule("model.layers.{layer}.self_attn.q_proj.weight", "blocks/{layer}/attn/q/kernel", T),
    TensorRule("model.layers.{layer}.self_attn.k_proj.weight", "blocks/{layer}/attn/k/kernel", T),
    TensorRule("model.layers.{layer}.self_attn.v_proj.weight", "blocks/{layer}/attn/v/kernel", T),
    TensorRule("model.layers.{layer}.self_attn.o_proj.weight", "blocks/{layer}/attn/out/kernel", T),
    TensorRule(
        "model.layers.{layer}.post_attention_layernorm.weight", "blocks/{layer}/norm2/scale"
    ),
    TensorRule("model.layers.{layer}.mlp.gate_proj.weight", "blocks/{layer}/mlp/gate/kernel", T),
    TensorRule("model.layers.{layer}.mlp.up_proj.weight", "blocks/{layer}/mlp/up/kernel", T),
    TensorRule("model.layers.{layer}.mlp.down_proj.weight", "blocks/{layer}/mlp/down/kernel", T),
    TensorRule("model.layers.{layer}.self_attn.rotary_emb.inv_freq", None),  # a buffer, recomputed
)
_QK_NORM = (
    TensorRule("model.layers.{layer}.self_attn.q_norm.weight", "blocks/{layer}/attn/q_norm/scale"),
    TensorRule("model.layers.{layer}.self_attn.k_norm.weight", "blocks/{layer}/attn/k_norm/scale"),
)
_OUTER = (
    TensorRule("model.embed_tokens.weight", "embed/embedding"),
    TensorRule("model.norm.weight", "norm/scale"),
)
_MOE_LAYER = (  # a MoE layer's router and experts (Qwen3-MoE), stacked over the experts
    TensorRule("model.layers.{layer}.mlp.gate.weight", "blocks/{layer}/mlp/router/kernel", T),
    TensorRule(
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        "blocks/{layer}/mlp/experts/gate",
        T,
    ),
    TensorRule(
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        "blocks/{layer}/mlp/experts/up",
        T,
    ),
    TensorRule(
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        "blocks/{layer}/mlp/experts/down",
        T,
    ),
)
_HEAD = TensorRule("lm_head.weight", "head/kernel", T)
_TIED_HEAD = TensorRule("lm_head.weight", None)  # some tied checkpoints store the table twice


REQUIRED = object()
"""A :class:`ConfigKey` default: ``config.json`` must have the key."""


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """A ``config.json`` key of a family's own that sets the ``GPTConfig`` field ``field``, as
    it is (a list as a tuple); ``default`` (transformers' own) when the file lacks it or has
    ``null``, or :data:`REQUIRED`.

    Example:
        >>> ConfigKey("mlp_only_layers", "dense_layers", ()).read({"mlp_only_layers": [0]}, "c")
        (0,)
    """

    key: str
    field: str
    default: Any = REQUIRED

    def read(self, hf: dict[str, Any], file: str) -> Any:
        """The field's value in the ``config.json`` ``hf`` (read from ``file``).

        Raises:
            CheckpointError: a required key the file lacks.
        """
        value = hf.get(self.key)
        if value is None:
            if self.default is REQUIRED:
                raise CheckpointError(f"{file}: no {self.key!r}")
            value = self.default
        return tuple(value) if isinstance(value, list) else value

    def write(self, config: GPTConfig) -> Any:
        """The key's value for ``config`` (a tuple as a list)."""
        value = getattr(config, self.field)
        return list(value) if isinstance(value, tuple) else value


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture of ``config.json``'s ``architectures``: its ``model_type``, whether its
    attention normalises queries and keys (Qwen3), the config keys of its own (``config_keys``: a
    mixture of experts' sizes and routing) and the tensors of its own in each layer
    (``layer_rules``: a MoE layer's router and experts). The config keys no family honours are
    refused."""

    architecture: str
    model_type: str
    qk_norm: bool
    config_keys: tuple[ConfigKey, ...] = ()
    layer_rules: tuple[TensorRule, ...] = ()

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig:
        """The ``GPTConfig`` of a ``config.json`` (in directory ``where``; ``overrides``:
        ``param_dtype``, ``dtype``, ``scan_layers``, ``max_seq_len``, ...).

        Raises:
            CheckpointError: a missing key or a setting this family's GPT cannot reproduce.
        """
        file = f"{where}/config.json ({self.architecture})"
        c = read_config(hf, file, self.model_type)  # checked, both dialects, defaults filled
        _refuse_unsupported(file, hf)
        fields = dict(
            vocab_size=c.vocab_size,
            dim=c.hidden_size,
            depth=c.num_hidden_layers,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            qk_norm=self.qk_norm,
            mlp_hidden=c.intermediate_size,
            gated_mlp=True,
            mlp_bias=False,
            max_seq_len=c.max_position_embeddings,
            tie_embeddings=c.tie_word_embeddings,
            norm="rms",
            norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta,
            rope_scaling=c.rope_scaling,
        )
        fields.update({k.field: k.read(dict(c.own), file) for k in self.config_keys})
        fields.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return GPTConfig(**fields)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: {e}") from None

    def hf_config(self, config: GPTConfig, torch_dtype: str) -> dict[str, Any]:
        """A ``config.json`` for ``config`` (written by ``save_pretrained`` for a model that was
        not loaded from one).

        Example:
            >>> FAMILIES["LlamaForCausalLM"].hf_config(GPTConfig(), "float32")["hidden_size"]
            128
        """
        out = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": config.vocab_size,
            "hidden_size": config.dim,
            "num_hidden_layers": config.depth,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads or config.num_heads,
            "head_dim": config.head_dim or config.dim // config.num_heads,
            "intermediate_size": config.mlp_hidden or int(config.mlp_ratio * config.dim),
            "max_position_embeddings": config.max_seq_len,
            "tie_word_embeddings": config.tie_embeddings,
            "rms_norm_eps": 1e-6 if config.norm_eps is None else config.norm_eps,
            "rope_parameters": rope_parameters(config.rope_theta, config.rope_scaling),
            "hidden_act": "silu",
            "attention_bias": False,
            "dtype": torch_dtype,
        }
        if self.model_type == "qwen3":  # transformers 5 writes Qwen3's (not Llama's)
            out["layer_types"] = ["full_attention"] * config.depth
        out.update({k.key: k.write(config) for k in self.config_keys})
        return written(out, None, set())

    def cannot_hold(self, config: GPTConfig) -> list[str]:
        """What of ``config`` this family's checkpoints cannot hold (nothing: ``[]``).

        Example:
            >>> FAMILIES["LlamaForCausalLM"].cannot_hold(GPTConfig())
            ['an ungated GELU MLP (LlamaForCausalLM: SiLU-gated)', 'MLP biases']
            >>> FAMILIES["Qwen3ForCausalLM"].cannot_hold(GPTConfig(gated_mlp=True))
            ['MLP biases', 'no query/key norms (Qwen3ForCausalLM: RMSNorm on both)']
        """
        own = {k.field for k in self.config_keys}
        name = self.architecture
        checks = (
            (not config.gated_mlp, f"an ungated GELU MLP ({name}: SiLU-gated)"),
            (config.mlp_bias, "MLP biases"),
            (config.norm != "rms", f"LayerNorm ({name}: RMSNorm)"),
            (config.qk_norm and not self.qk_norm, f"query/key norms ({name}: none)"),
            (not config.qk_norm and self.qk_norm, f"no query/key norms ({name}: RMSNorm on both)"),
            (config.experts and "experts" not in own, f"mixture-of-experts blocks ({name}: dense)"),
            (not config.experts and "experts" in own, f"no mixture-of-experts blocks ({name})"),
        )
        return [what for failed, what in checks if failed]

    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]:
        """Which checkpoint tensor fills which Variable of ``GPT(config)``.

        Example:
            >>> rules = FAMILIES["Qwen3ForCausalLM"].tensor_rules(GPTConfig(qk_norm=True))
            >>> [r.variable for r in rules if "q_norm" in r.tensor]
            ['blocks/{layer}/attn/q_norm/scale']
            >>> moe = GPTConfig(qk_norm=True, experts=8, scan_layers=True)
            >>> rule = FAMILIES["Qwen3MoeForCausalLM"].tensor_rules(moe)[-2]
            >>> rule.variable, rule.stacked  # every layer's experts in one Variable
            ('blocks/mlp/experts/down', ('layer', 'expert'))
        """
        layer = _LAYER + (_QK_NORM if config.qk_norm else ()) + self.layer_rules
        if config.scan_layers:  # one stacked module: every layer's tensor in one Variable
            layer = tuple(
                dataclasses.replace(r, variable=r.variable.replace("/{layer}", ""))
                if r.variable
                else r
                for r in layer
            )
        return _OUTER + layer + ((_TIED_HEAD,) if config.tie_embeddings else (_HEAD,))


FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        Family(architecture="LlamaForCausalLM", model_type="llama", qk_norm=False),
        Family(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True),
        Family(
            architecture="Qwen3MoeForCausalLM",
            model_type="qwen3_moe",
            qk_norm=True,
            config_keys=(
                ConfigKey("num_local_experts", "experts"),
                ConfigKey("num_experts_per_tok", "experts_per_token"),
                ConfigKey("moe_intermediate_size", "expert_hidden"),
                ConfigKey("norm_topk_prob", "norm_topk_prob", False),
                ConfigKey("decoder_sparse_step", "moe_every", 1),
                ConfigKey("mlp_only_layers", "dense_layers", ()),
                ConfigKey("router_aux_loss_coef", "router_aux_loss_coef", 0.001),
            ),
            layer_rules=_MOE_LAYER,
        ),
    )
}
"""The architectures ``from_pretrained`` builds, by their ``config.json`` name."""


def family_of(hf: dict[str, Any] | None, where: Any) -> Family:
    """The family a ``config.json`` names in ``architectures``.

    Raises:
        CheckpointError: no config, or an architecture not in :data:`FAMILIES` (naming those
            that are).

    Example:
        >>> family_of({"architectures": ["Qwen3ForCausalLM"]}, "ckpt").model_type
        'qwen3'
    """
    if hf is None:
        raise CheckpointError(f"{where}: no config.json (it names the model's architecture)")
    names = architectures(hf, where)
    for name in names:
        if name in FAMILIES:
            return FAMILIES[name]
    raise CheckpointError(
        f"{where}/config.json: architecture {', '.join(names) or '(none given)'} is not "
        f"supported; mmnnx builds {', '.join(FAMILIES)}"
    )


_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
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


def _refuse_unsupported(file: str, hf: dict[str, Any]) -> None:
    for key, refused, supported in _UNSUPPORTED:
        if refused(hf.get(key)):
            raise CheckpointError(
                f"{file}: {key}={hf[key]!r} is not supported; mmnnx's GPT has {supported}"
            )
