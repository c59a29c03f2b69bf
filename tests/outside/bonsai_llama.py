"""jax-ml/bonsai's Llama 3.2 (`vendored/bonsai_llama3_2_modeling.py`, from bonsai's pull request
138, not merged) on a Hugging Face checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.outside import as_numpy, cast_params, read_config
from tests.outside.vendored import bonsai_llama3_2_modeling as modeling
from tests.outside.vendored import bonsai_llama3_2_params as params


@nnx.jit  # as bonsai's own `forward` is jitted
def _logits(model, tokens):
    # Every token real (segment 1); no cache: a causal mask over the tokens given.
    return model(tokens, jnp.ones_like(tokens), None)


def outside_logits(
    directory: str | pathlib.Path, tokens: np.ndarray, *, dtype: str = "float32"
) -> np.ndarray:
    """Logits ``(B, T, vocab_size)`` (float32) of bonsai's Llama loaded from ``directory`` by
    bonsai's loader, parameters and activations in ``dtype``, every sequence from position 0.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> outside_logits(write_checkpoint(tempfile.mkdtemp()), np.array([[1, 2, 3]])).shape
        (1, 3, 384)
    """
    config = read_config(directory, "LlamaForCausalLM")
    scaling = config.get("rope_scaling")
    if scaling is not None:
        if scaling.get("rope_type") != "llama3":
            raise ValueError(f"{directory}: rope_scaling {scaling}: bonsai's Llama has llama3 only")
        scaling = modeling.RopeScalingConfig(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    cfg = modeling.ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        head_dim=config["head_dim"],
        num_key_value_heads=config["num_key_value_heads"],
        max_position_embeddings=config["max_position_embeddings"],
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        rope_scaling=scaling,
        tie_word_embeddings=config["tie_word_embeddings"],
        shd_cfg=modeling.LlamaShardCfg.no_sharding(),
        dtype=jnp.dtype(dtype),
    )
    model = params.create_model_from_safe_tensors(str(directory), cfg)
    cast_params(model, dtype)  # bonsai's loader keeps the file's dtype
    tokens = jnp.asarray(tokens, jnp.int32)
    return as_numpy(_logits(model, tokens))
