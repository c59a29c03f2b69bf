"""``MoE``: a mixture-of-experts feed-forward layer, routed as Qwen3-MoE routes, dropless by
default, expert-parallel where its experts are placed split over a mesh axis."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx import _nnx
from mmnnx.modules.expert_parallel import apply_expert_parallel, expert_layout
from mmnnx.modules.experts import Experts, apply_local, default_expert_init
from mmnnx.modules.linear import Linear
from mmnnx.modules.routing import RouterStats, capacity, capacity_keep, route, router_stats

METRICS = ("router_aux_loss", "router_z_loss", "tokens_per_expert", "dropped_tokens")
"""The names a ``MoE`` sows under ``nnx.capture(..., nnx.Intermediate)``, one value per call."""


class MoE(nnx.Module):
    """A mixture of ``num_experts`` SwiGLU experts, each token sent to ``top_k`` of them.

    ``router`` is a ``Linear(dim, num_experts)`` without bias named ``("embed", None)``
    (Qwen3-MoE's ``mlp.gate``); ``experts`` an :class:`~mmnnx.modules.experts.Experts` (stacked
    ``gate``, ``up`` ``(E, dim, hidden)`` and ``down`` ``(E, hidden, dim)``, named
    ``("expert", "embed", "mlp")`` / ``("expert", "mlp", "embed")``). As Qwen3-MoE: the router's
    logits (in the input's dtype) go through a softmax over every expert in float32, the
    ``top_k`` most probable experts are chosen, their probabilities divided by their sum when
    ``norm_topk_prob``, and the output is ``sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))``, the
    weights cast to the input's dtype.

    Dropless by default: every token reaches its ``top_k`` experts, computed as grouped matmuls
    (``jax.lax.ragged_dot``) over the assignments sorted by expert. With ``capacity_factor``,
    an expert takes at most ``ceil(capacity_factor * tokens * top_k / num_experts)``
    assignments of a call, the first in token order; the rest contribute nothing.

    Placed on a task whose rules map ``expert`` to mesh axes (``mm.logical_rules(batch="data",
    expert="expert")``), each device of an expert-parallel group holds ``E / EP`` experts and
    the tokens, split over the task's batch axes and the expert axes, travel to their experts
    and back by ``all_to_all`` (:mod:`~mmnnx.modules.expert_parallel`): the same numbers. Held
    whole by every device of a task whose batch axes split the tokens, each device runs its
    own tokens' assignments (under ``shard_map`` too, nothing exchanged).

    ``moe(x)`` returns the output, of ``x``'s shape ``(..., dim)``; ``moe.forward(x)`` returns it
    with the call's :class:`~mmnnx.modules.routing.RouterStats`, whose ``aux_loss`` (Hugging
    Face's ``load_balancing_loss_func``) and ``z_loss`` a model adds to its loss
    (``GPT.loss`` does). Under ``nnx.capture(fn, nnx.Intermediate)`` each call also sows
    :data:`METRICS`: ``router_aux_loss``, ``router_z_loss``, ``tokens_per_expert`` ``(E,)`` and
    ``dropped_tokens``; outside a capture it sows nothing, so a step can run again without
    popping them.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     moe = MoE(8, 16, num_experts=4, top_k=2, rngs=nnx.Rngs(0))
        >>> y, stats = moe.forward(jnp.ones((2, 3, 8)))
        >>> y.shape, stats.tokens_per_expert.sum().item()
        ((2, 3, 8), 12)
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        norm_topk_prob: bool = True,
        capacity_factor: float | None = None,
        kernel_init: nnx.Initializer = default_expert_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_moe_args(num_experts, top_k, capacity_factor, "MoE")
        self.dim = dim
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.capacity_factor = capacity_factor
        self.router = Linear(
            dim, num_experts, axes=("embed", None), use_bias=False, param_dtype=param_dtype,
            rngs=rngs,
        )  # fmt: skip
        self.experts = Experts(
            num_experts, dim, hidden, kernel_init=kernel_init, param_dtype=param_dtype, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.forward(x)[0]

    def forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """The layer's output for ``x`` ``(..., dim)`` and the call's ``RouterStats``."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE: input of shape {x.shape} does not end in dim {self.dim}")
        tokens = x.reshape(-1, self.dim)
        n = tokens.shape[0]
        layout = expert_layout(self.experts.gate)
        # split evenly over the mesh axes (XLA:CPU's partitioner miscounts a scatter over
        # unevenly split tokens): padding rows at the end, routed but kept by no expert
        pad = 0 if layout is None else -n % layout.token_shards
        tokens = jnp.pad(tokens, ((0, pad), (0, 0)))
        logits = self.router(tokens)
        weights, indices, probs = route(logits, self.top_k, norm_topk_prob=self.norm_topk_prob)
        weights = weights.astype(x.dtype)
        limit = None
        keep = jnp.broadcast_to((jnp.arange(n + pad) < n)[:, None], indices.shape)
        if self.capacity_factor is not None:
            limit = capacity(self.capacity_factor, n, self.top_k, self.num_experts)
            keep = keep & capacity_keep(indices, self.num_experts, limit)
        stats = router_stats(logits, probs, indices, keep, tokens=n)
        experts = (self.experts.gate[...], self.experts.up[...], self.experts.down[...])
        if layout is None:
            y = apply_local(tokens, indices, weights, keep, experts)
        else:
            y = apply_expert_parallel(layout, tokens, indices, weights, keep, experts, limit=limit)
        if _nnx.capturing(self):
            for name, value in zip(METRICS, _metrics(stats), strict=True):
                self.sow(nnx.Intermediate, name, value)
        return y[:n].reshape(x.shape), stats


def _metrics(stats: RouterStats) -> tuple[jax.Array, ...]:
    return stats.aux_loss, stats.z_loss, stats.tokens_per_expert, stats.dropped.sum()


def check_moe_args(num_experts: object, top_k: object, capacity_factor: object, where: str) -> None:
    """Raises ``ValueError`` naming ``where`` for an expert count below 1, a ``top_k`` outside
    ``1 .. num_experts``, or a capacity factor that is not a finite number > 0.

    Example:
        >>> check_moe_args(8, 2, None, "MoE")
        >>> check_moe_args(8, 9, None, "MoE")
        Traceback (most recent call last):
        ...
        ValueError: MoE: top_k must be an int in 1..num_experts (8), got 9
    """
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{where}: num_experts must be an int >= 1, got {num_experts!r}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{where}: top_k must be an int in 1..num_experts ({num_experts}), got {top_k!r}"
        )
    if capacity_factor is not None and not (
        isinstance(capacity_factor, numbers.Real)
        and not isinstance(capacity_factor, bool)
        and 0 < capacity_factor < math.inf
    ):
        raise ValueError(
            f"{where}: capacity_factor must be None (dropless) or a finite number > 0, got "
            f"{capacity_factor!r}"
        )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
