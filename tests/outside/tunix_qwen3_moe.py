"""google/tunix's Qwen3 with its mixture of experts (`vendored/tunix_qwen3_model.py`) on a Hugging
Face Qwen3-MoE checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.outside import as_numpy, quiet, read_config

with quiet():  # its TPU-only paths import jax.experimental.shard_map, deprecated here
    from tests.outside.vendored import tunix_qwen3_model as model_lib
    from tests.outside.vendored import tunix_qwen3_params as params

ROPE_THETA = 1_000_000
"""The only rope_theta tunix's Qwen3 computes with: its attention calls `apply_rope` without
one, whose default this is, whatever the config."""


@nnx.jit
def _logits(model, tokens, positions, mask):
    return model(tokens, positions, None, mask)[0]


def outside_logits(
    directory: str | pathlib.Path, tokens: np.ndarray, *, dtype: str = "float32"
) -> np.ndarray:
    """Logits ``(B, T, vocab_size)`` (float32) of tunix's Qwen3 MoE loaded from ``directory`` by
    tunix's loader (which casts to ``dtype``), every sequence from position 0. On CPU its
    ``MoELayer`` runs every expert on the tokens routed to it (its dense fallback), not megablox.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> path = write_checkpoint(tempfile.mkdtemp(), architecture="Qwen3MoeForCausalLM")
        >>> outside_logits(path, np.array([[1, 2, 3]])).shape
        (1, 3, 384)
    """
    config = read_config(directory, "Qwen3MoeForCausalLM")
    refused = {
        "rope_theta": (config["rope_theta"], ROPE_THETA),
        "rope_scaling": (config.get("rope_scaling"), None),
        "decoder_sparse_step": (config.get("decoder_sparse_step", 1), 1),  # every layer MoE
        "mlp_only_layers": (config.get("mlp_only_layers") or [], []),
        "norm_topk_prob": (config.get("norm_topk_prob", False), True),  # always renormalised
    }
    for key, (value, computed) in refused.items():
        if value != computed:
            raise ValueError(
                f"{directory}: tunix's Qwen3 MoE computes {key}={computed!r} only; this "
                f"checkpoint has {value!r}"
            )
    cfg = model_lib.ModelConfig(
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        embed_dim=config["hidden_size"],
        hidden_dim=config["moe_intermediate_size"],  # the experts' (no dense layers)
        num_heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        num_kv_heads=config["num_key_value_heads"],
        rope_theta=config["rope_theta"],
        norm_eps=config["rms_norm_eps"],
        use_tied_embedding=config["tie_word_embeddings"],
        num_experts=config["num_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
    )
    # tunix's parameters carry mesh axis names; it turns flax's eager sharding off for the whole
    # process when imported (removed there), here only while the model is built.
    with nnx.use_eager_sharding(False), quiet():
        model = params.create_model_from_safe_tensors(str(directory), cfg, dtype=jnp.dtype(dtype))
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (b, t, t))
    with quiet():
        return as_numpy(_logits(model, tokens, positions, causal))
