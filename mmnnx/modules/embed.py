"""``Embed``: a token embedding table named ``("vocab", "embed")``, with a tied output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmnnx.modules.checks import check, is_positive

default_embed_init = nnx.initializers.normal(stddev=0.02)


class Embed(nnx.Module):
    """Looks up rows of ``embedding`` (``num_embeddings x features``, named ``("vocab", "embed")``)
    for integer ids of any shape, times ``scale`` when given (Gemma's, in the table's dtype as
    transformers does); ``attend`` is the output head tied to the table.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     embed = Embed(16, 8, rngs=nnx.Rngs(0))
        ...     scaled = Embed(16, 8, scale=2.0, rngs=nnx.Rngs(0))
        >>> x = embed(jnp.array([[1, 2, 3]]))
        >>> x.shape, embed.attend(x).shape
        ((1, 3, 8), (1, 3, 16))
        >>> bool((scaled(jnp.array([3])) == 2 * embed(jnp.array([3]))).all())
        True
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        embedding_init: nnx.Initializer = default_embed_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        scale: float | None = None,
        rngs: nnx.Rngs,
    ):
        check(scale is None or is_positive(scale), "Embed: scale", "None or a number > 0", scale)
        self.num_embeddings, self.features, self.scale = num_embeddings, features, scale
        init = nnx.with_partitioning(embedding_init, ("vocab", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], tokens, axis=0)
        if self.scale is None:
            return x
        return x * jnp.asarray(np.float32(self.scale)).astype(x.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits ``x @ embedding.T`` over the vocabulary (a head tied to the embedding)."""
        return jnp.einsum("...d,vd->...v", x, self.embedding[...].astype(x.dtype))
