"""``config.json`` as transformers 4 (top-level ``rope_theta``, ``rope_scaling``,
``torch_dtype``, ``num_experts``) and 5 (``rope_parameters``, ``dtype``, ``num_local_experts``,
``layer_types``) write it, read into one checked form and written as transformers 5 does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.files import TORCH_DTYPES, CheckpointError
from mmnnx.modules.checks import is_positive
from mmnnx.modules.rope import LinearScaling, RopeScaling, Scaling, YarnScaling

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The ``rope_type`` values mmnnx computes (as transformers' ``ROPE_INIT_FUNCTIONS`` do)."""

REQUIRED = object()
"""A default meaning: ``config.json`` must have the key."""

# Keys whose default transformers' config classes set differently per model type (absent key).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "head_dim": None, "num_key_value_heads": None},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32},
    "qwen3_moe": {"max_position_embeddings": 32768, "head_dim": None, "num_key_value_heads": 4},
    "mistral": dict(max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
    "mixtral": dict(
        max_position_embeddings=131072, num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1e6
    ),
    "gemma3_text": dict(
        max_position_embeddings=131072, head_dim=256, num_key_value_heads=4, intermediate_size=9216
    )
    | {"tie_word_embeddings": True},
    "gpt_oss": dict(max_position_embeddings=131072, head_dim=64, num_key_value_heads=8)
    | dict(intermediate_size=2880, rms_norm_eps=1e-5, rope_theta=150000.0),
    # head_dim: transformers writes qk_rope_head_dim there; the family reads its own
    "deepseek_v3": dict(max_position_embeddings=4096, head_dim=None, num_key_value_heads=None)
    | {"intermediate_size": 18432},
}


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked(value: Any, check: tuple[Callable[[Any], bool], str], where: str) -> Any:
    if not check[0](value):
        raise CheckpointError(f"{where}: {_show(value)} is not {check[1]}")
    return value


class _Key(NamedTuple):
    name: str
    check: Callable[[Any], bool]
    what: str
    default: Any = REQUIRED
    aliases: tuple[str, ...] = ()
    nullable: bool = False  # ``null`` means None (transformers' ``int | None``), not absent


def _int(minimum: int) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: type(v) is int and v >= minimum), f"an int >= {minimum}"


_POSITIVE = is_positive, "a finite number > 0"
_NONNEGATIVE = (
    (lambda v: is_positive(v) or (type(v) in (int, float) and v == 0)),
    "a finite number >= 0",
)
_BOOL = (lambda v: isinstance(v, bool)), "true or false"
_STR = (lambda v: isinstance(v, str)), "a string"
_STRS = (
    lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
    "a list of strings",
)
_INTS = (lambda v: isinstance(v, list) and all(type(i) is int for i in v), "a list of ints")
_OBJECT = (lambda v: isinstance(v, dict)), "an object"
_DTYPE = (lambda v: v in TORCH_DTYPES), f"one of {', '.join(map(json.dumps, TORCH_DTYPES))}"

_COMMON = (
    _Key("vocab_size", *_int(1)),
    _Key("hidden_size", *_int(1)),
    _Key("num_hidden_layers", *_int(1)),
    _Key("num_attention_heads", *_int(1)),
    _Key("num_key_value_heads", *_int(1), default=None, nullable=True),
    _Key("head_dim", *_int(2), default=None, nullable=True),
    _Key("intermediate_size", *_int(1), default=None, nullable=True),  # a dense layer's
    _Key("max_position_embeddings", *_int(1), default=2048),
    _Key("tie_word_embeddings", *_BOOL, default=False),
    _Key("rms_norm_eps", *_POSITIVE, default=1e-6),
    _Key("dtype", *_DTYPE, default=None, aliases=("torch_dtype",)),
    _Key("layer_types", *_STRS, default=None),
    _Key("hidden_act", *_STR, default="silu"),
    _Key("attention_bias", *_BOOL, default=False),
    _Key("mlp_bias", *_BOOL, default=False),
    _Key("use_sliding_window", *_BOOL, default=False),
    _Key("rope_theta", *_POSITIVE, default=10000.0),
    _Key("partial_rotary_factor", *_POSITIVE, default=1.0),
    _Key("original_max_position_embeddings", *_int(1), default=None),
)
_MOE = (  # Qwen3-MoE's own keys, named as transformers 5 writes them
    _Key("num_local_experts", *_int(1), aliases=("num_experts",)),
    _Key("num_experts_per_tok", *_int(1)),
    _Key("moe_intermediate_size", *_int(1)),
    _Key("norm_topk_prob", *_BOOL, default=False),
    _Key("decoder_sparse_step", *_int(1), default=1),
    _Key("mlp_only_layers", *_INTS, default=[]),
    _Key("router_aux_loss_coef", *_NONNEGATIVE, default=0.001),
    _Key("output_router_logits", *_BOOL, default=False),
)
_SLIDING = (  # Mistral's and Mixtral's: every layer's window, null for none
    _Key("sliding_window", _int(1)[0], "an int >= 1 or null", default=None, nullable=True),
)
_ROUTER_LOSS = _MOE[-2:]  # router_aux_loss_coef, output_router_logits
_MIXTRAL = (*_SLIDING, *_MOE[:2], *_ROUTER_LOSS)  # Qwen3-MoE's counts; experts intermediate_size
_GEMMA3 = (  # Gemma 3's own keys (its family reads its older RoPE and layer keys)
    _Key("query_pre_attn_scalar", *_POSITIVE, default=256),
    _Key("rope_local_base_freq", *_POSITIVE, default=10000.0),
    _Key("sliding_window_pattern", *_int(1), default=6),
    _Key("sliding_window", *_int(1), default=4096, nullable=True),
    _Key("hidden_activation", *_STR, default="gelu_pytorch_tanh"),
    _Key("use_bidirectional_attention", *_BOOL, default=False, nullable=True),
)
_GPT_OSS = (  # gpt-oss's own keys: its experts' size is intermediate_size
    _Key("sliding_window", *_int(1), default=128, nullable=True),
    _Key("attention_bias", *_BOOL, default=True),
    _Key("num_local_experts", *_int(1), default=128, aliases=("num_experts",)),
    _Key("num_experts_per_tok", *_int(1), default=4, aliases=("experts_per_token",)),
    _Key("swiglu_alpha", *_POSITIVE, default=1.702),
    _Key("swiglu_limit", *_POSITIVE, default=7.0),
    _Key("quantization_config", *_OBJECT, default=None),
    *_ROUTER_LOSS,
)
_DEEPSEEK = (  # DeepSeek-V3's own keys, their defaults DeepseekV3Config's
    _Key("moe_intermediate_size", *_int(1), default=2048),
    _Key("n_shared_experts", *_int(0), default=1, nullable=True),
    _Key("n_routed_experts", *_int(1), default=256),
    _Key("routed_scaling_factor", *_POSITIVE, default=2.5),
    _Key("kv_lora_rank", *_int(1), default=512),
    _Key("q_lora_rank", *_int(1), default=1536, nullable=True),
    _Key("qk_rope_head_dim", *_int(2), default=64),
    _Key("v_head_dim", *_int(1), default=128),
    _Key("qk_nope_head_dim", *_int(1), default=128),
    _Key("n_group", *_int(1), default=8),
    _Key("topk_group", *_int(1), default=4),
    _Key("num_experts_per_tok", *_int(1), default=8),
    _Key("first_k_dense_replace", *_int(0), default=3),
    _Key("norm_topk_prob", *_BOOL, default=True),
    _Key("rope_interleave", *_BOOL, default=True),
    _Key("num_nextn_predict_layers", *_int(0), default=1),
    _Key("quantization_config", *_OBJECT, default=None),
)
_OWN: dict[str, tuple[_Key, ...]] = {
    "qwen3_moe": _MOE,
    "mistral": _SLIDING,
    "mixtral": _MIXTRAL,
    "gemma3_text": _GEMMA3,
    "gpt_oss": _GPT_OSS,
    "deepseek_v3": _DEEPSEEK,
}

STALE = {
    "torch_dtype": "dtype",
    "rope_theta": "rope_parameters",
    "rope_scaling": "rope_parameters",
    "rope_local_base_freq": "rope_parameters",  # Gemma 3's sliding layers' theta
    "sliding_window_pattern": "layer_types",  # Gemma 3's every n-th layer global
    "quantization_config": "dtype",  # read quantized, written in dtype
}
"""Older keys and the transformers 5 key that replaces them (``save_pretrained`` drops them)."""


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A ``config.json`` read and checked; ``own``: the family's own keys; ``rope_theta`` and
    ``rope_scaling``: RoPE's (the ``full_attention`` layers' where ``rope_parameters`` is given
    per layer type, and then ``ropes``: each layer type's ``(theta, scaling)``).

    Example:
        >>> c = read_config({"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        ...                  "num_attention_heads": 4, "intermediate_size": 64,
        ...                  "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        ...                 "c.json", "llama")
        >>> c.head_dim, c.num_key_value_heads, c.rope_theta, c.rope_scaling
        (8, 4, 500000.0, None)
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Scaling | None
    own: Mapping[str, Any]
    ropes: Mapping[str, tuple[float, Scaling | None]] = dataclasses.field(default_factory=dict)

    def gpt_config(self, layers: tuple, overrides: Mapping[str, Any], **fields: Any) -> GPTConfig:
        """The ``GPTConfig`` every family builds: these sizes with RMSNorm of ``rms_norm_eps``,
        the family's ``layers`` (``BlockConfig``s) and ``fields``, then the ``overrides`` given
        (not ``None``).

        Example:
            >>> c = read_config({"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
            ...                  "num_attention_heads": 4, "intermediate_size": 64}, "c", "llama")
            >>> from mmnnx.modules import AttentionConfig, BlockConfig, MLPConfig
            >>> layers = (BlockConfig(AttentionConfig(4), MLPConfig(64)),)
            >>> config = c.gpt_config(layers, {"max_seq_len": 16, "dtype": None}, norm_eps=1e-5)
            >>> config.max_seq_len, config.norm_eps, config.dim
            (16, 1e-05, 32)
        """
        base = dict(
            vocab_size=self.vocab_size,
            dim=self.hidden_size,
            depth=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            max_seq_len=self.max_position_embeddings,
            tie_embeddings=self.tie_word_embeddings,
            norm="rms",
            norm_eps=self.rms_norm_eps,
            layers=layers,
        )
        given = {k: v for k, v in overrides.items() if v is not None}
        return GPTConfig(**base | fields | given)


def read_config(hf: Any, file: str, model_type: str) -> HFConfig:
    """Reads ``hf`` (a parsed ``config.json``; ``file`` names it in errors) for ``model_type``.

    Example:
        >>> try:
        ...     read_config({"vocab_size": 64, "hidden_size": "32"}, "ckpt/config.json", "llama")
        ... except CheckpointError as e:
        ...     print(e)
        ckpt/config.json: hidden_size: "32" is not an int >= 1
    """
    _check_object(hf, file)
    defaults = _DEFAULTS.get(model_type, {})
    v = {k.name: _value(hf, k, file, defaults) for k in _COMMON}
    own = {k.name: _value(hf, k, file, defaults) for k in _OWN.get(model_type, ())}
    heads = v["num_attention_heads"]
    kv = v["num_key_value_heads"] or heads
    if heads % kv:
        raise CheckpointError(
            f"{file}: num_attention_heads: {heads} is not a multiple of num_key_value_heads {kv}"
        )
    head_dim = v["head_dim"]
    if head_dim is None:
        if v["hidden_size"] % heads:
            raise CheckpointError(
                f"{file}: hidden_size: {v['hidden_size']} is not a multiple of "
                f"num_attention_heads {heads} (and no head_dim is given)"
            )
        head_dim = v["hidden_size"] // heads
    layers = v["num_hidden_layers"]
    if v["layer_types"] is not None and len(v["layer_types"]) != layers:
        raise CheckpointError(
            f"{file}: layer_types: {len(v['layer_types'])} entries, not one per layer "
            f"(num_hidden_layers {layers})"
        )
    if "mlp_only_layers" in own and not all(0 <= i < layers for i in own["mlp_only_layers"]):
        raise CheckpointError(
            f"{file}: mlp_only_layers: {_show(own['mlp_only_layers'])} are not all layer "
            f"indices in 0..{layers - 1}"
        )
    if own.get("num_experts_per_tok", 0) > own.get("num_local_experts", 1 << 62):
        raise CheckpointError(
            f"{file}: num_experts_per_tok: {own['num_experts_per_tok']} is more than "
            f"num_local_experts {own['num_local_experts']}"
        )
    if "output_router_logits" in own and not own["output_router_logits"]:
        own["router_aux_loss_coef"] = 0.0
    (theta, scaling), ropes = _rope(hf, v, file)
    v |= dict(
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=float(v["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        own={k: tuple(x) if isinstance(x, list) else x for k, x in own.items()},
        ropes=ropes,
    )
    return HFConfig(**{f.name: v[f.name] for f in dataclasses.fields(HFConfig)})


def _check_object(hf: Any, file: str) -> None:
    if not isinstance(hf, dict):
        raise CheckpointError(
            f"{file}: holds a JSON {type(hf).__name__}, not an object of config keys"
        )


def _value(hf: dict[str, Any], key: _Key, file: str, defaults: Mapping[str, Any]) -> Any:
    """``key``'s checked value in ``hf`` (newest name first), or its default."""
    for name in (key.name, *key.aliases):
        value = hf.get(name)
        if value is None and key.nullable and name in hf:
            return None
        if value is not None:
            return _checked(value, (key.check, key.what), f"{file}: {name}")
    default = defaults.get(key.name, key.default)
    if default is REQUIRED:
        also = "".join(f" (or {a!r})" for a in key.aliases)
        raise CheckpointError(f"{file}: no {key.name!r}{also}")
    return default


Rope = tuple[float, Scaling | None]


def _rope(hf: dict[str, Any], v: dict[str, Any], file: str) -> tuple[Rope, dict[str, Rope]]:
    """RoPE's base and scaling, as transformers' ``standardize_rope_params`` resolves them, and
    where ``rope_parameters`` holds one set per layer type (``layer_types``' names), each
    type's (the first one: ``full_attention``'s, else the first type's)."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = _checked(hf.get(key) or {}, _OBJECT, f"{file}: {key}")
    nested = [t for t in params if t in (v["layer_types"] or ())]
    if not nested:
        return _rope_of(params, key, v, file), {}
    ropes = {}
    for kind in nested:
        where = f"{key}.{kind}"
        ropes[kind] = _rope_of(
            _checked(params[kind] or {}, _OBJECT, f"{file}: {where}"), where, v, file
        )
    return ropes.get("full_attention", ropes[nested[0]]), ropes


def _rope_of(params: dict[str, Any], key: str, v: dict[str, Any], file: str) -> Rope:
    """The base and scaling of one set of RoPE parameters, ``params`` (``key`` in ``file``)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(
            f"{file}: {key}: rope_type {_show(kind)} is not supported; mmnnx computes "
            f"{', '.join(map(repr, ROPE_TYPES))} RoPE"
        )

    def number(name: str, check: tuple[Callable[[Any], bool], str], default: Any) -> Any:
        value = params.get(name)
        if value is None:
            if default is REQUIRED:
                raise CheckpointError(f"{file}: {key}: no {name!r} (rope_type {kind!r} needs it)")
            return default
        return _checked(value, check, f"{file}: {key}.{name}")

    theta = float(number("rope_theta", _POSITIVE, v["rope_theta"]))
    partial = number("partial_rotary_factor", _POSITIVE, v["partial_rotary_factor"])
    if partial != 1:
        raise CheckpointError(
            f"{file}: partial_rotary_factor: {_show(partial)} is not supported; mmnnx rotates "
            "the whole head (1.0)"
        )
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, LinearScaling(float(number("factor", _POSITIVE, REQUIRED)))
    original = v["original_max_position_embeddings"] or number(
        "original_max_position_embeddings", _int(1), v["max_position_embeddings"]
    )
    if kind == "yarn":
        optional = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")  # 0: absent, as there
        given = {k: float(number(k, _POSITIVE, None)) for k in optional if params.get(k)}
        if params.get("attention_factor") is not None:  # transformers scales by a 0 as well
            given["attention_factor"] = float(number("attention_factor", _POSITIVE, None))
        factor = float(number("factor", _POSITIVE, v["max_position_embeddings"] / original))
        truncate = params.get("truncate")
        if truncate is not None and not isinstance(truncate, bool):
            raise CheckpointError(f"{file}: {key}.truncate: {_show(truncate)} is not a bool")
        return theta, YarnScaling(factor, original, truncate=truncate, **given)
    low = float(number("low_freq_factor", _POSITIVE, REQUIRED))
    high = float(number("high_freq_factor", _POSITIVE, REQUIRED))
    if high <= low:
        raise CheckpointError(
            f"{file}: {key}.high_freq_factor: {_show(high)} is not greater than "
            f"low_freq_factor {_show(low)}"
        )
    return theta, RopeScaling(
        factor=float(number("factor", _POSITIVE, REQUIRED)),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=original,
    )


def rope_parameters(theta: float, scaling: Scaling | None) -> dict[str, Any]:
    """``rope_parameters`` as transformers 5 writes it (one set; a model with one per layer
    type writes ``{type: rope_parameters(...), ...}``).

    Example:
        >>> rope_parameters(1e6, None)
        {'rope_theta': 1000000.0, 'rope_type': 'default'}
        >>> rope_parameters(1e6, LinearScaling(8.0))
        {'factor': 8.0, 'rope_theta': 1000000.0, 'rope_type': 'linear'}
    """
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": "default"}
    if scaling is not None:
        kinds = {YarnScaling: "yarn", RopeScaling: "llama3", LinearScaling: "linear"}
        kind = kinds[type(scaling)]
        fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
        out.update(rope_type=kind, **fields)
    return dict(sorted(out.items()))


def architectures(hf: Any, where: Any) -> list[str]:
    """``config.json``'s ``architectures``, checked (``[]`` when absent).

    Example:
        >>> architectures({"architectures": ["LlamaForCausalLM"]}, "ckpt")
        ['LlamaForCausalLM']
    """
    file = f"{where}/config.json"
    _check_object(hf, file)
    return _checked(hf.get("architectures") or [], _STRS, f"{file}: architectures")


def written(fresh: Mapping[str, Any], loaded: Mapping[str, Any] | None) -> dict[str, Any]:
    """``fresh`` over ``loaded`` but its older keys; its context length kept.

    Example:
        >>> old = {"rope_theta": 1e4, "torch_dtype": "float32", "bos_token_id": 1,
        ...        "hidden_size": 64}
        >>> fresh = {"hidden_size": 32, "dtype": "bfloat16",
        ...          "rope_parameters": rope_parameters(5e5, None)}
        >>> out = written(fresh, old)
        >>> sorted(out), out["rope_parameters"]["rope_theta"]
        (['bos_token_id', 'dtype', 'hidden_size', 'rope_parameters'], 500000.0)
    """
    loaded = dict(loaded or {})
    stale = set(STALE) | {a for keys in _OWN.values() for k in keys for a in k.aliases}
    out = {k: x for k, x in loaded.items() if k not in stale} | fresh
    if isinstance(loaded.get("max_position_embeddings"), int):
        out["max_position_embeddings"] = loaded["max_position_embeddings"]
    if "router_aux_loss_coef" in fresh:
        coef = fresh["router_aux_loss_coef"]
        out["output_router_logits"] = coef > 0
        if coef == 0:
            out["router_aux_loss_coef"] = loaded.get("router_aux_loss_coef", 0.0)
    return dict(sorted(out.items()))
