"""A mixture of experts' router, as Qwen3-MoE routes; the capacity that drops late
assignments; ``RouterStats``, the sums its losses are made of."""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterStats(NamedTuple):
    """Sums (not means, so that layers and calls ``merge``) over the tokens routed, the losses'
    parts.

    Example:
        >>> logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
        >>> _, idx, probs = route(logits, 1)
        >>> stats = router_stats(logits, probs, idx, jnp.ones(idx.shape, bool))
        >>> stats.tokens_per_expert.tolist(), round(float(stats.aux_loss), 4)  # 3 * 0.4468
        ([1, 1, 0], 1.3402)
    """

    tokens: jax.Array  # () float32: tokens routed
    selected: jax.Array  # (E,) int32: top-k assignments chosen per expert, dropped ones included
    probs: jax.Array  # (E,) float32: each expert's router probability summed over the tokens
    logsumexp_sq: jax.Array  # () float32: logsumexp(logits) ** 2 summed over the tokens
    dropped: jax.Array  # (E,) int32: assignments the capacity dropped, per expert
    seq_balance: jax.Array  # () float32: a call's mean over its rows of seq_balance_loss, summed

    @property
    def aux_loss(self) -> jax.Array:
        """``E * sum_e f_e * P_e``, Hugging Face's ``load_balancing_loss_func`` over these
        tokens."""
        n = self.tokens
        return self.probs.shape[-1] * jnp.sum(self.selected / n * (self.probs / n))

    @property
    def z_loss(self) -> jax.Array:
        """ST-MoE's router z-loss: the mean over the tokens of ``logsumexp(logits) ** 2``."""
        return self.logsumexp_sq / self.tokens

    @property
    def tokens_per_expert(self) -> jax.Array:
        """Assignments each expert computed (chosen and not dropped), ``(E,)`` int32."""
        return self.selected - self.dropped

    def merge(self, other: RouterStats) -> RouterStats:
        """The stats of both calls' tokens together (sums added)."""
        return jax.tree.map(operator.add, self, other)

    def loss(self, aux_coef: float, z_coef: float = 0.0, seq_coef: float = 0.0) -> jax.Array:
        """``aux_coef * aux_loss + z_coef * z_loss + seq_coef * seq_balance`` (zero terms left
        out)."""
        total = jnp.zeros((), jnp.float32)
        if aux_coef:
            total = total + aux_coef * self.aux_loss
        if z_coef:
            total = total + z_coef * self.z_loss
        if seq_coef:
            total = total + seq_coef * self.seq_balance
        return total

    @staticmethod
    def zeros(num_experts: int) -> RouterStats:
        """The stats of no tokens (a sum's start)."""
        f, i = jnp.float32, jnp.int32
        e = (num_experts,)
        return RouterStats(
            tokens=jnp.zeros((), f),
            selected=jnp.zeros(e, i),
            probs=jnp.zeros(e, f),
            logsumexp_sq=jnp.zeros((), f),
            dropped=jnp.zeros(e, i),
            seq_balance=jnp.zeros((), f),
        )


def route(
    logits: jax.Array, top_k: int, *, norm_topk_prob: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights, indices, probs)`` of router ``logits`` ``(N, E)``, as Qwen3-MoE routes."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, indices = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, indices.astype(jnp.int32), probs


def capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(capacity_factor * tokens * top_k / num_experts)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(indices: jax.Array, num_experts: int, limit: int) -> jax.Array:
    """Which assignments ``indices`` keep when each expert takes its first ``limit``."""
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    first = jnp.searchsorted(flat[order], jnp.arange(num_experts, dtype=flat.dtype))
    rank = jnp.arange(flat.size) - first[flat[order]]  # place among its expert's assignments
    position = jnp.zeros_like(rank).at[order].set(rank)
    return (position < limit).reshape(indices.shape)


def router_stats(
    logits: jax.Array,
    probs: jax.Array,
    indices: jax.Array,
    keep: jax.Array,
    tokens: int | None = None,
    rows: int = 1,
) -> RouterStats:
    """The ``RouterStats`` of one call; with ``tokens``, only the first ``tokens`` rows count;
    ``rows``: the sequences those tokens are, in order (for ``seq_balance``)."""
    counts = jnp.zeros(probs.shape[-1], jnp.int32)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    n = probs.shape[0] if tokens is None else tokens
    real = jnp.arange(probs.shape[0]) < n
    chosen = jnp.broadcast_to(real[:, None], indices.shape).astype(jnp.int32)
    return RouterStats(
        tokens=jnp.asarray(n, jnp.float32),
        selected=counts.at[indices].add(chosen),
        probs=jnp.where(real[:, None], probs, 0).sum(0),
        logsumexp_sq=jnp.sum(jnp.where(real, lse * lse, 0)),
        dropped=counts.at[indices].add(chosen * ~keep),
        seq_balance=seq_balance_loss(probs[:n], indices[:n], rows),
    )


def seq_balance_loss(probs: jax.Array, indices: jax.Array, rows: int = 1) -> jax.Array:
    """DeepSeek-V3's sequence-wise balance loss, the mean over ``rows`` sequences (the tokens of
    ``probs`` ``(N, E)`` and ``indices`` ``(N, K)`` in order, ``T = N / rows`` each) of ``sum_i f_i
    P_i``: ``f_i = E / (K T) *`` the sequence's tokens that chose expert ``i``, ``P_i`` the mean of
    its router probabilities (DeepSeek: the normalised affinities)."""
    n, k = indices.shape
    num_experts, length = probs.shape[-1], n // rows
    row = jnp.repeat(jnp.arange(rows), length * k)
    counts = jnp.zeros((rows, num_experts), jnp.float32).at[row, indices.reshape(-1)].add(1.0)
    f = counts * num_experts / (k * length)
    p = probs.astype(jnp.float32).reshape(rows, length, num_experts).mean(axis=1)
    return jnp.mean(jnp.sum(f * p, axis=-1))
