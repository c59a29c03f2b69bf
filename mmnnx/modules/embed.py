"""``Embed``: a token embedding table named ``("vocab", "embed")``, with a tied output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

default_embed_init = nnx.initializers.normal(stddev=0.02)


class Embed(nnx.Module):
    """Looks up rows of ``embedding`` (``num_embeddings x features``); ``attend`` reuses it.

    ``embed(tokens)`` maps integer ids of any shape to vectors (``tokens.shape + (features,)``);
    ``embed.attend(x)`` is ``x @ embedding.T``, the logits of an output head tied to the table.
    The table is created in ``param_dtype``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     embed = Embed(16, 8, rngs=nnx.Rngs(0))
        >>> x = embed(jnp.array([[1, 2, 3]]))
        >>> x.shape, embed.attend(x).shape
        ((1, 3, 8), (1, 3, 16))
        >>> embed.embedding.get_metadata()["out_sharding"]
        ('vocab', 'embed')
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        embedding_init: nnx.Initializer = default_embed_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_embeddings, self.features = num_embeddings, features
        init = nnx.with_partitioning(embedding_init, ("vocab", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (num_embeddings, features), param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits ``x @ embedding.T`` over the vocabulary (a head tied to the embedding).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     embed = Embed(16, 8, rngs=nnx.Rngs(0))
            >>> embed.attend(jnp.ones((2, 8))).shape
            (2, 16)
        """
        return x @ self.embedding[...].T.astype(x.dtype)
