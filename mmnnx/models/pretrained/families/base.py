"""What the families share: the tensors around the layers, the ``config.json`` keys every
causal LM writes, and the checks of ``layer_types`` and of keys mmnnx does not compute."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import rope_parameters
from mmnnx.models.pretrained.names import TensorRule
from mmnnx.models.pretrained.scanned import layer_rules
from mmnnx.modules.norms import RMS_EPS

T = (1, 0)  # Linear weights are (out, in) on disk and (in, out) as kernels
SLIDING, FULL = "sliding_attention", "full_attention"
OUTER = (
    TensorRule("model.embed_tokens.weight", "embed/embedding"),
    TensorRule("model.norm.weight", "norm/scale"),
)
_L = "model.layers.{layer}"
ATTENTION = tuple(
    TensorRule(f"{_L}.self_attn.{t}.weight", f"blocks/{{layer}}/attn/{v}/kernel", T)
    for v, t in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("out", "o_proj"))
)
QK_NORM = tuple(
    TensorRule(f"{_L}.self_attn.{n}.weight", f"blocks/{{layer}}/attn/{n}/scale")
    for n in ("q_norm", "k_norm")
)
MLP = tuple(  # a SiLU- or GELU-gated MLP's
    TensorRule(f"{_L}.mlp.{n}_proj.weight", f"blocks/{{layer}}/mlp/{n}/kernel", T)
    for n in ("gate", "up", "down")
)
MOE = (  # a mixture's router and experts (Qwen3-MoE's, DeepSeek-V3's), stacked over the experts
    TensorRule(f"{_L}.mlp.gate.weight", "blocks/{layer}/mlp/router/kernel", T),
    *(
        TensorRule(
            f"{_L}.mlp.experts.{{expert}}.{n}_proj.weight", f"blocks/{{layer}}/mlp/experts/{n}", T
        )
        for n in ("gate", "up", "down")
    ),
)
Unsupported = tuple[tuple[str, Callable[[Any], bool], str], ...]


def outer(layer: tuple[TensorRule, ...], config: GPTConfig) -> tuple[TensorRule, ...]:
    """``layer``'s rules (scanned: onto the stacked segments) with the embedding's, the final
    norm's and the head's (a tied checkpoint's ``lm_head.weight``, where stored, fills nothing).

    Example:
        >>> [r.variable for r in outer((), GPTConfig(tie_embeddings=True))]
        ['embed/embedding', 'norm/scale', None]
    """
    head = TensorRule("lm_head.weight", None if config.tie_embeddings else "head/kernel", T)
    return OUTER + layer_rules(layer, config) + (head,)


def norm_epsilons(config: GPTConfig) -> set[float]:
    """The epsilons of ``config``'s norms that a ``config.json`` holds as one ``rms_norm_eps``:
    every layer's, the output's and the query/key norms' (``None``: RMSNorm's default).

    Example:
        >>> norm_epsilons(GPTConfig(qk_norm=True)), norm_epsilons(GPTConfig(norm_eps=1e-5))
        ({1e-06}, {1e-05})
    """
    blocks = config.block_configs
    norms = [*(b.norm.eps for b in blocks), config.output_norm.eps]
    qk = [b.attention.qk_norm_eps for b in blocks if getattr(b.attention, "qk_norm", False)]
    return {RMS_EPS if e is None else e for e in (*norms, *qk)}


def hf_keys(family: Any, config: GPTConfig, torch_dtype: str) -> dict[str, Any]:
    """The ``config.json`` keys every family writes for ``config`` (its first layer's
    attention and RoPE; the epsilon its norms use, :func:`norm_epsilons`).

    Example:
        >>> from mmnnx.models.pretrained.families import LLAMA
        >>> keys = hf_keys(LLAMA, GPTConfig(dim=32, num_heads=4), "float32")
        >>> keys["head_dim"], keys["num_key_value_heads"], keys["model_type"]
        (8, 4, 'llama')
    """
    attention = config.block_configs[0].attention
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.depth,
        "num_attention_heads": attention.num_heads,
        "num_key_value_heads": getattr(attention, "num_kv_heads", None) or attention.num_heads,
        "head_dim": getattr(attention, "head_dim", None) or config.dim // attention.num_heads,
        "max_position_embeddings": config.max_seq_len,
        "tie_word_embeddings": config.tie_embeddings,
        "rms_norm_eps": max(norm_epsilons(config)),  # one, or refused by save_pretrained
        "rope_parameters": rope_parameters(attention.rope.theta, attention.rope.scaling),
        "dtype": torch_dtype,
    }


def refuse(hf: dict[str, Any], unsupported: Unsupported, file: str) -> None:
    """Raises on the first ``(key, refused, supported)`` whose ``refused(hf[key])`` holds.

    Example:
        >>> refuse({"mlp_bias": True}, (("mlp_bias", bool, "no MLP biases"),), "c.json")
        Traceback (most recent call last):
        ...
        mmnnx.models.pretrained.files.CheckpointError: c.json: mlp_bias=True is not \
supported; mmnnx's GPT has no MLP biases
    """
    for key, refused, supported in unsupported:
        if refused(hf.get(key)):
            raise CheckpointError(
                f"{file}: {key}={hf[key]!r} is not supported; mmnnx's GPT has {supported}"
            )


def kinds_of(kinds: Sequence[str], window: int | None, file: str) -> Sequence[str]:
    """``layer_types`` checked: sliding and full layers only, a window for the sliding ones.

    Example:
        >>> kinds_of(["sliding_attention"], None, "c.json")
        Traceback (most recent call last):
        ...
        mmnnx.models.pretrained.files.CheckpointError: c.json: sliding_window: null, but \
layer_types has 'sliding_attention' layers
    """
    if other := sorted({t for t in kinds if t not in (SLIDING, FULL)}):
        raise CheckpointError(
            f"{file}: layer_types: {other} are not supported; mmnnx builds '{SLIDING}' and "
            f"'{FULL}' layers"
        )
    if window is None and SLIDING in kinds:
        raise CheckpointError(
            f"{file}: sliding_window: null, but layer_types has '{SLIDING}' layers"
        )
    return kinds
