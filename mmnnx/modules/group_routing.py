"""DeepSeek-V3's router: sigmoid affinities, a correction bias that steers the choice only,
and top-k limited to the best groups of experts (transformers' ``DeepseekV3TopkRouter``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_limited_route(
    logits: jax.Array,
    bias: jax.Array,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights, indices, probs)`` of router ``logits`` ``(N, E)``, float32, as transformers'
    ``DeepseekV3TopkRouter``: scores ``s = sigmoid(logits)``; the choice reads ``s + bias``, among
    the experts of the ``topk_group`` best of ``n_group`` groups (each scored by its two best biased
    scores); weights are the chosen unbiased ``s``, over their sum plus ``1e-20`` when
    ``norm_topk_prob``, times ``scaling``; ``probs``: ``s`` over its sum. (DeepSeek's own code
    always normalises, adds no ``1e-20`` and takes bfloat16 logits.)

    Example:
        >>> logits = jnp.array([[1.5, 1.0, -3.0, 2.0]])  # expert 3 best, its group (2, 3) not
        >>> w, i, _ = group_limited_route(logits, jnp.zeros(4), 2, n_group=2, topk_group=1)
        >>> i.tolist(), [round(v, 3) for v in w[0].tolist()]
        ([[0, 1]], [0.528, 0.472])
    """
    num_experts = logits.shape[-1]
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)
    if n_group > 1:
        grouped = biased.reshape(*biased.shape[:-1], n_group, num_experts // n_group)
        group_scores = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
        best = jax.lax.top_k(group_scores, topk_group)[1]
        chosen = (jnp.arange(n_group) == best[..., None]).any(-2)
        biased = jnp.where(chosen[..., None], grouped, -jnp.inf).reshape(biased.shape)
    indices = jax.lax.top_k(biased, top_k)[1]
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return weights * scaling, indices.astype(jnp.int32), probs
