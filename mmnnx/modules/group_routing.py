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
    """``(weights, indices, probs)`` of router ``logits`` ``(N, E)``, float32.

    As transformers' ``DeepseekV3TopkRouter``: scores ``s = sigmoid(logits)``; the choice reads
    ``s + bias`` (``e_score_correction_bias``, ``(E,)``): the ``E`` experts form ``n_group``
    groups of consecutive experts, each group scored by the sum of its two best biased scores,
    only the experts of the ``topk_group`` best groups compete, and the ``top_k`` best biased
    scores among them are chosen. The weights are the chosen experts' unbiased ``s``, divided
    by their sum plus ``1e-20`` when ``norm_topk_prob``, times ``scaling``
    (``routed_scaling_factor``). ``probs``: ``s`` divided by its sum over the experts (the
    normalised affinities DeepSeek-V3's balance loss reads).

    Where transformers (matched here) differs from DeepSeek's own inference code
    (``inference/model.py``'s ``Gate``) and the paper: it adds ``1e-20`` to the sum it divides
    by; it normalises only when ``norm_topk_prob`` (DeepSeek's code always normalises sigmoid
    weights, as the paper's gating values); its logits are float32 (DeepSeek's code takes them
    in the weights' dtype, bfloat16). The paper's node-limited routing appears, in both codes,
    as groups scored by their two best biased scores.

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
        keep = jnp.repeat(chosen, num_experts // n_group, axis=-1)
        biased = jnp.where(keep, biased, -jnp.inf)
    indices = jax.lax.top_k(biased, top_k)[1]
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    return weights * scaling, indices.astype(jnp.int32), probs
