"""google/tunix's Gemma 4 (`vendored/tunix_gemma4_model.py`, its text model) built small with
random weights.

tunix's `FeedForward` makes its three kernels as zeros for its checkpoint loader to fill;
`tiny_gemma4` draws them instead, so that every layer's MLP computes something. Gemma 4 shares
key/value caches: with ``frac_shared_layers`` its last layers compute no keys and values of
their own, but attend over those an earlier layer of the same attention type computed (the
last unshared global layer, or the one before it for sliding-window layers). Such a layer still
holds its `kv_einsum` and key norm, unread (their gradient is zero). Each layer also adds a
per-layer input: a slice of one table the embedder computes from the tokens before the layers.
The output head is tied to the embedding (`Embedder.decode`).

tunix's Variables carry tunix's mesh axis names (``sharding=("tp", "fsdp")``); placement rules
give them specs of their own. tunix turns flax's eager sharding off for the whole process when
its config is imported (removed there); `tiny_gemma4` turns it off only while it builds the
model.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from tests.outside import quiet

with quiet():  # its TPU-only paths import jax.experimental.shard_map, deprecated here
    from tests.outside.vendored import tunix_gemma4_model as modeling

LOCAL, GLOBAL = modeling.AttentionType.LOCAL_SLIDING, modeling.AttentionType.GLOBAL


def tiny_config(*, layers: int = 8) -> modeling.ModelConfig:
    """tunix's own config class at test sizes: hidden 16, 4 query heads of 8, sliding-window
    and global layers alternating (2 key/value heads, 1 for the global ones), a per-layer input
    of 4, and the second half of the layers sharing the key/value caches of the last two
    unshared ones (a global and a sliding-window layer: ``layers`` a multiple of 4).

    Example:
        >>> tiny_gemma4(tiny_config(layers=4)).kv_cache_sharing_patterns
        [0, 1, 0, 1]
    """
    return modeling.ModelConfig(
        num_layers=layers,
        num_embed=32,
        embed_dim=16,
        hidden_dim=32,
        num_heads=4,
        head_dim=8,
        num_kv_heads=2,
        num_global_kv_heads=1,
        global_key_size=8,
        sliding_window_size=4,
        per_layer_input_dim=4,
        attention_pattern=(LOCAL, GLOBAL),
        frac_shared_layers=0.5,
    )


def tiny_gemma4(config: modeling.ModelConfig, seed: int = 0) -> modeling.Gemma4:
    """tunix's `Gemma4(config)` (text only) from ``nnx.Rngs(seed)``, the kernels it makes as
    zeros (its MLPs') drawn from a normal of scale 0.3 (from ``seed`` too).

    Example:
        >>> model = tiny_gemma4(tiny_config(layers=2))
        >>> bool((model.layers[1].mlp.down_proj.kernel[...] != 0).all())
        True
    """
    with nnx.use_eager_sharding(False), quiet():
        model = modeling.Gemma4(config, rngs=nnx.Rngs(seed))
    key = jax.random.key(seed)
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "mlp" in path:
            key, draw = jax.random.split(key)
            variable.set_value(0.3 * jax.random.normal(draw, variable.shape))
    return model


def logits(model: modeling.Gemma4, tokens: jax.Array) -> jax.Array:
    """``model(tokens, ...)``'s logits, every sequence from position 0 under a causal mask (the
    sliding-window layers narrow it themselves), without its deprecation warnings.

    Example:
        >>> model = tiny_gemma4(tiny_config(layers=4))
        >>> jax.eval_shape(lambda t: logits(model, t), jnp.ones((2, 5), jnp.int32)).shape
        (2, 5, 32)
    """
    b, t = tokens.shape
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), dtype=bool)), (b, t, t))
    with quiet():
        return model(tokens, None, None, causal)[0]
