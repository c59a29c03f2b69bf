"""google/tunix's Llama 3 (`vendored/tunix_llama3_model.py`) on a Hugging Face checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.outside import as_numpy, quiet, read_config
from tests.outside.vendored import tunix_llama3_model as model_lib
from tests.outside.vendored import tunix_llama3_params as params

ROPE_THETA = 1_000_000
"""The only rope_theta tunix's Llama 3 computes with: its attention calls `apply_rope` without
one, whose default this is, whatever the config (real Llama 3 checkpoints have 500000)."""


@nnx.jit
def _logits(model, tokens, positions, mask):
    return model(tokens, positions, None, mask)[0]


def outside_logits(
    directory: str | pathlib.Path, tokens: np.ndarray, *, dtype: str = "float32"
) -> np.ndarray:
    """Logits ``(B, T, vocab_size)`` (float32) of tunix's Llama 3 loaded from ``directory`` by
    tunix's loader (which casts to ``dtype``), every sequence from position 0.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> path = write_checkpoint(tempfile.mkdtemp(), rope_theta=1_000_000)
        >>> outside_logits(path, np.array([[1, 2, 3]])).shape
        (1, 3, 384)
    """
    config = read_config(directory, "LlamaForCausalLM")
    if config["rope_theta"] != ROPE_THETA or config.get("rope_scaling") is not None:
        raise ValueError(
            f"{directory}: tunix's Llama 3 computes RoPE with theta {ROPE_THETA} and no scaling "
            f"only; this checkpoint has rope_theta {config['rope_theta']}, rope_scaling "
            f"{config.get('rope_scaling')}"
        )
    cfg = model_lib.ModelConfig(
        num_layers=config["num_hidden_layers"],
        vocab_size=config["vocab_size"],
        embed_dim=config["hidden_size"],
        hidden_dim=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        num_kv_heads=config["num_key_value_heads"],
        rope_theta=config["rope_theta"],
        norm_eps=config["rms_norm_eps"],
        weight_tying=config["tie_word_embeddings"],
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
