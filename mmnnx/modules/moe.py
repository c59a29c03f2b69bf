"""``MoE``: a mixture-of-experts feed-forward layer, routed as Qwen3-MoE routes, dropless by
default, expert-parallel where its experts are placed split over a mesh axis;
``ClampedMoEConfig``: gpt-oss's (a biased router, ``ClampedExperts``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx import _nnx
from mmnnx.modules.checks import check, is_int, is_positive
from mmnnx.modules.expert_parallel import apply_expert_parallel, expert_layout
from mmnnx.modules.experts import ClampedExperts, Experts, apply_local, default_expert_init
from mmnnx.modules.linear import Linear
from mmnnx.modules.routing import RouterStats, capacity, capacity_keep, route, router_stats


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (``MoE``): ``num_experts`` SwiGLU experts of ``hidden``
    features, each token routed to ``top_k`` of them, their weights renormalised when
    ``norm_topk_prob``; ``capacity_factor`` bounds each expert's assignments (``None``: dropless).

    Example:
        >>> MoEConfig(16, num_experts=8, top_k=9)
        Traceback (most recent call last):
        ...
        ValueError: MoEConfig.top_k must be an int in 1..num_experts (8), got 9
    """

    hidden: int
    num_experts: int
    top_k: int = 2
    norm_topk_prob: bool = True
    capacity_factor: float | None = None

    def __post_init__(self):
        experts, top_k, factor = self.num_experts, self.top_k, self.capacity_factor
        check(is_int(self.hidden, minimum=1), "MoEConfig.hidden", "an int >= 1", self.hidden)
        check(is_int(experts, minimum=1), "MoEConfig.num_experts", "an int >= 1", experts)
        ok = is_int(top_k, minimum=1) and top_k <= experts
        check(ok, "MoEConfig.top_k", f"an int in 1..num_experts ({experts})", top_k)
        ok = isinstance(self.norm_topk_prob, bool)
        check(ok, "MoEConfig.norm_topk_prob", "a bool", self.norm_topk_prob)
        ok = factor is None or is_positive(factor)
        check(ok, "MoEConfig.capacity_factor", "None (dropless) or a finite number > 0", factor)

    router_bias: ClassVar[bool] = False  # whether the router's Linear has a bias

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> MoE:
        """The ``MoE`` of width ``dim``, its Variables in ``param_dtype``."""
        return MoE(dim, self, param_dtype=param_dtype, rngs=rngs)

    def experts(self, dim: int, **kwargs: Any) -> Experts:
        """The ``MoE``'s experts module of width ``dim`` (``kernel_init``, ``param_dtype``,
        ``rngs``)."""
        return Experts(self.num_experts, dim, self.hidden, **kwargs)


@dataclasses.dataclass(frozen=True)
class ClampedMoEConfig(MoEConfig):
    """gpt-oss's mixture of experts: a router with a bias, the ``top_k`` largest logits' softmax as
    weights, and :class:`~mmnnx.modules.experts.ClampedExperts` (``limit``, ``alpha``).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     moe = ClampedMoEConfig(16, num_experts=4, limit=5.0).build(8, rngs=nnx.Rngs(0))
        >>> type(moe.experts).__name__, moe.experts.limit, moe.router.bias.shape
        ('ClampedExperts', 5.0, (4,))
    """

    alpha: float = 1.702
    limit: float = 7.0

    router_bias: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            check(is_positive(value), f"ClampedMoEConfig.{name}", "a finite number > 0", value)
        ok = self.norm_topk_prob
        check(ok, "ClampedMoEConfig.norm_topk_prob", "True (the chosen logits' softmax)", ok)

    def experts(self, dim: int, **kwargs: Any) -> ClampedExperts:
        return ClampedExperts(
            self.num_experts, dim, self.hidden, alpha=self.alpha, limit=self.limit, **kwargs
        )


METRICS = ("router_aux_loss", "router_z_loss", "tokens_per_expert", "dropped_tokens")
"""The names a ``MoE`` sows under ``nnx.capture(..., nnx.Intermediate)``, one value per call."""


class MoE(nnx.Module):
    """A mixture of ``num_experts`` SwiGLU experts, each token sent to ``top_k`` of them, as
    Qwen3-MoE: ``router`` (``Linear(dim, E)`` named ``("embed", None)``) logits, a float32
    softmax over every expert, the ``top_k`` most probable chosen (renormalised when
    ``norm_topk_prob``), output ``sum_k w_k * expert_k(x)`` by grouped matmuls over the
    assignments sorted by expert. Dropless unless ``capacity_factor`` caps each expert at
    ``ceil(capacity_factor * tokens * top_k / E)`` assignments, the first in token order.

    Where the task's rules map ``expert`` to mesh axes, tokens travel to their experts and back by
    ``all_to_all`` (:mod:`~mmnnx.modules.expert_parallel`), with the same numbers.
    ``moe.forward(x)`` also returns the call's :class:`~mmnnx.modules.routing.RouterStats`; under
    ``nnx.capture(fn, nnx.Intermediate)`` each call sows :data:`METRICS`.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     moe = MoE(8, MoEConfig(16, num_experts=4, top_k=2), rngs=nnx.Rngs(0))
        >>> y, stats = moe.forward(jnp.ones((2, 3, 8)))
        >>> y.shape, stats.tokens_per_expert.sum().item()
        ((2, 3, 8), 12)
    """

    def __init__(
        self,
        dim: int,
        config: MoEConfig,
        *,
        kernel_init: nnx.Initializer = default_expert_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dim, self.hidden, self.top_k = dim, config.hidden, config.top_k
        self.num_experts, self.norm_topk_prob = config.num_experts, config.norm_topk_prob
        self.capacity_factor = config.capacity_factor
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        bias = config.router_bias
        self.router = Linear(dim, self.num_experts, axes=("embed", None), use_bias=bias, **kw)
        self.experts = config.experts(dim, kernel_init=kernel_init, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward(x)[0]

    def forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """The layer's output for ``x`` ``(..., dim)`` and the call's ``RouterStats``."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE: input of shape {x.shape} does not end in dim {self.dim}")
        tokens = x.reshape(-1, self.dim)
        n = tokens.shape[0]
        layout = expert_layout(self.experts.placed)
        # split evenly over the mesh axes (XLA:CPU's partitioner miscounts a scatter over
        # unevenly split tokens): padding rows at the end, routed but kept by no expert
        pad = 0 if layout is None else -n % layout.token_shards
        tokens = jnp.pad(tokens, ((0, pad), (0, 0)))
        logits, (weights, indices, probs) = self.route(tokens)
        weights = weights.astype(x.dtype)
        limit = None
        keep = jnp.broadcast_to((jnp.arange(n + pad) < n)[:, None], indices.shape)
        if self.capacity_factor is not None:
            limit = capacity(self.capacity_factor, n, self.top_k, self.num_experts)
            keep = keep & capacity_keep(indices, self.num_experts, limit)
        rows = math.prod(x.shape[:-2]) if x.ndim > 2 else 1  # sequences, for seq_balance
        stats = router_stats(logits, probs, indices, keep, tokens=n, rows=rows)
        experts, ffn = self.experts.arrays(), self.experts.apply
        if layout is None:
            y = apply_local(tokens, indices, weights, keep, experts, ffn)
        else:
            y = apply_expert_parallel(
                layout, tokens, indices, weights, keep, experts,
                limit=limit, ffn=ffn, specs=self.experts.specs,
            )  # fmt: skip
        if _nnx.capturing(self):
            values = (stats.aux_loss, stats.z_loss, stats.tokens_per_expert, stats.dropped.sum())
            for name, value in zip(METRICS, values, strict=True):
                self.sow(nnx.Intermediate, name, value)
        return y[:n].reshape(x.shape), stats

    def route(self, tokens: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
        """The router's logits of ``tokens`` ``(N, dim)`` and their ``(weights, indices,
        probs)``."""
        logits = self.router(tokens)
        return logits, route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
