"""jax-ml/bonsai's Qwen3 (`vendored/bonsai_qwen3_modeling.py`) on a Hugging Face checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.outside import as_numpy, cast_params, read_config
from tests.outside.vendored import bonsai_qwen3_modeling as modeling
from tests.outside.vendored import bonsai_qwen3_params as params

ROPE_THETA = 1_000_000
"""The only rope_theta bonsai's Qwen3 computes with: its attention calls
`_generate_pos_embeddings(position_ids, head_dim)`, whose default this is, whatever the config."""


@nnx.jit  # as bonsai's own `forward` is jitted
def _logits(model, cache, tokens):
    # bonsai's `forward` takes the token pad_id for padding and keeps the last position only:
    # the model itself, with every token real (segment 1), gives all positions.
    return model(tokens, cache=cache, segment_ids=jnp.ones_like(tokens))


def outside_logits(
    directory: str | pathlib.Path, tokens: np.ndarray, *, dtype: str = "float32"
) -> np.ndarray:
    """Logits ``(B, T, vocab_size)`` (float32) of bonsai's Qwen3 loaded from ``directory`` by
    bonsai's loader, parameters and cache in ``dtype``, every sequence from position 0.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> path = write_checkpoint(tempfile.mkdtemp(), architecture="Qwen3ForCausalLM")
        >>> outside_logits(path, np.array([[1, 2, 3]])).shape
        (1, 3, 384)
    """
    config = read_config(directory, "Qwen3ForCausalLM")
    if config["rope_theta"] != ROPE_THETA or config.get("rope_scaling") is not None:
        raise ValueError(
            f"{directory}: bonsai's Qwen3 computes RoPE with theta {ROPE_THETA} and no scaling "
            f"only; this checkpoint has rope_theta {config['rope_theta']}, rope_scaling "
            f"{config.get('rope_scaling')}"
        )
    cfg = modeling.ModelConfig(
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        emb_dim=config["hidden_size"],
        mlp_dim=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        num_kv_heads=config["num_key_value_heads"],
        rope_theta=config["rope_theta"],
        rope_scaling_factor=1.0,  # unused by bonsai's Qwen3
        local_rope_theta=1e4,  # unused by bonsai's Qwen3
        norm_eps=config["rms_norm_eps"],
        tie_word_embeddings=config["tie_word_embeddings"],
    )
    model = params.create_model_from_safe_tensors(str(directory), cfg)
    cast_params(model, dtype)
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = modeling.init_cache(cfg, *tokens.shape, generate_steps=0, dtype=jnp.dtype(dtype))
    return as_numpy(_logits(model, cache, tokens))
