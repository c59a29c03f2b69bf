"""jax-ml/bonsai's gpt-oss (`vendored/bonsai_gpt_oss_modeling.py`) built small with random weights.

bonsai's `GptOssExperts` makes its expert weights and biases, and `GptOssAttention` its `sinks`,
as zeros for its checkpoint loader to fill; `tiny_gpt_oss` draws them instead, so that every
expert computes something and routing matters. bonsai's attention holds `sinks` without reading
them (their gradient is zero) and ignores `sliding_window`; its router's top-k is a
scatter into a dense ``(tokens, experts)`` score matrix, and every expert runs on every token.

bonsai shards nothing in this model (no `PartitionSpec`, no logical names on its Variables):
`expert_spec` gives its expert-stacked Variables an expert-parallel spec for placement rules:
their leading (expert) axis on a mesh axis ``expert``, optionally their hidden axis on another.
"""

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.outside import quiet
from tests.outside.vendored import bonsai_gpt_oss_modeling as modeling

EXPERT_WEIGHTS = {"gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}
"""The Variables of bonsai's `GptOssExperts`, each with the experts on its leading axis, and
which of their axes is the experts' hidden one (``intermediate_size``; twice it, gate and up
interleaved, in ``gate_up_proj``), if any."""


def tiny_config(*, layers: int = 4, experts: int = 4) -> modeling.GptOssConfig:
    """bonsai's own config class at test sizes: hidden 16, 4 query and 2 key/value heads of 4."""
    return modeling.GptOssConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=layers,
        num_local_experts=experts,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
    )


def tiny_gpt_oss(config: modeling.GptOssConfig, seed: int = 0) -> modeling.GptOssForCausalLM:
    """bonsai's `GptOssForCausalLM(config)` from ``nnx.Rngs(seed)``, the Variables it makes as
    zeros (experts, sinks) drawn from a normal of scale 0.3 (from ``seed`` too).

    Example:
        >>> model = tiny_gpt_oss(tiny_config(layers=1))
        >>> bool((model.model.layers[0].mlp.experts.down_proj[...] != 0).all())
        True
    """
    model = modeling.GptOssForCausalLM(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] in (*EXPERT_WEIGHTS, "sinks"):
            key, draw = jax.random.split(key)
            variable.set_value(0.3 * jax.random.normal(draw, variable.shape))
    return model


def logits(model: modeling.GptOssForCausalLM, tokens: jax.Array) -> jax.Array:
    """``model(tokens)``, bonsai's Variables read as written (``.value``) without its warning."""
    with quiet():
        return model(tokens)


def expert_spec(model_axis: str | None = None) -> Callable[[str, nnx.Variable], P]:
    """A spec callable for ``mm.place`` rules (``path`` ``/``-joined) on a task whose mesh has an
    ``expert`` axis: each expert-stacked Variable's leading axis on ``expert`` and, with
    ``model_axis``, its expert hidden axis (``intermediate_size``) on that axis too; every other
    Variable replicated.

    Example:
        >>> model = tiny_gpt_oss(tiny_config(layers=1))
        >>> experts = model.model.layers[0].mlp.experts
        >>> expert_spec("model")("model/layers/0/mlp/experts/down_proj", experts.down_proj)
        P('expert', 'model', None)
    """

    def spec(path: str, variable: nnx.Variable) -> P:
        name = path.split("/")[-1]
        if name not in EXPERT_WEIGHTS:
            return P()
        axes = ["expert", *[None] * (len(variable.shape) - 1)]
        if model_axis is not None and EXPERT_WEIGHTS[name] is not None:
            axes[EXPERT_WEIGHTS[name]] = model_axis
        return P(*axes)

    return spec
