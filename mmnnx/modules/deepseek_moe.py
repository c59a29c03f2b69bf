"""``DeepSeekMoE``: DeepSeek-V3's mixture of experts: a ``MoE`` routed by sigmoid scores over
groups of experts (:func:`~mmnnx.modules.group_routing.group_limited_route`), plus shared
experts that every token goes through."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_int, is_positive
from mmnnx.modules.group_routing import group_limited_route
from mmnnx.modules.linear import Linear
from mmnnx.modules.mlp import MLP, MLPConfig
from mmnnx.modules.moe import MoE, MoEConfig
from mmnnx.modules.routing import RouterStats


class RouterBias(nnx.Variable):
    """A router's per-expert correction bias (``e_score_correction_bias``), moved by the
    balancing rule, not by gradients."""


@dataclasses.dataclass(frozen=True)
class DeepSeekMoEConfig(MoEConfig):
    """A ``DeepSeekMoE``: a ``MoEConfig`` routed in ``n_group`` groups of which ``topk_group``
    compete, weights times ``routed_scaling_factor``, and a shared SwiGLU expert of
    ``shared_hidden`` features (``None``: none).

    Example:
        >>> DeepSeekMoEConfig(16, num_experts=8, n_group=3)
        Traceback (most recent call last):
        ...
        ValueError: DeepSeekMoEConfig.n_group must be a divisor of num_experts (8), got 3
    """

    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_hidden: int | None = None

    def __post_init__(self):
        super().__post_init__()
        experts, groups = self.num_experts, self.n_group
        ok = is_int(groups, minimum=1) and experts % groups == 0
        check(ok, "DeepSeekMoEConfig.n_group", f"a divisor of num_experts ({experts})", groups)
        ok = is_int(self.topk_group, minimum=1) and self.topk_group <= groups
        where = f"an int in 1..n_group ({groups})"
        check(ok, "DeepSeekMoEConfig.topk_group", where, self.topk_group)
        reachable = self.topk_group * experts // groups
        ok = self.top_k <= reachable
        where = f"at most the {reachable} experts of topk_group groups"
        check(ok, "DeepSeekMoEConfig.top_k", where, self.top_k)
        factor = self.routed_scaling_factor
        ok = is_positive(factor)
        check(ok, "DeepSeekMoEConfig.routed_scaling_factor", "a finite number > 0", factor)
        ok = self.shared_hidden is None or is_int(self.shared_hidden, minimum=1)
        check(ok, "DeepSeekMoEConfig.shared_hidden", "None or an int >= 1", self.shared_hidden)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> DeepSeekMoE:
        """The ``DeepSeekMoE`` of width ``dim``, its Variables in ``param_dtype``."""
        return DeepSeekMoE(dim, self, param_dtype=param_dtype, rngs=rngs)


class DeepSeekMoE(MoE):
    """A ``MoE`` routed as DeepSeek-V3 routes (a float32 ``router``, its choice shifted by
    ``correction_bias``), plus ``shared(x)``, a SiLU-gated ``MLP``.

    Example:
        >>> config = DeepSeekMoEConfig(16, num_experts=8, top_k=2, n_group=2, topk_group=1,
        ...                            routed_scaling_factor=2.5, shared_hidden=16)
        >>> with nnx.use_eager_sharding(False):
        ...     moe = config.build(8, rngs=nnx.Rngs(0))
        >>> y, stats = moe.forward(jnp.ones((2, 3, 8)))
        >>> y.shape, stats.tokens_per_expert.sum().item(), moe.correction_bias.shape
        ((2, 3, 8), 12, (8,))
    """

    def __init__(
        self,
        dim: int,
        config: DeepSeekMoEConfig,
        *,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        super().__init__(dim, config, param_dtype=param_dtype, rngs=rngs)
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        kw = dict(use_bias=False, param_dtype=jnp.float32, rngs=rngs)
        self.router = Linear(dim, self.num_experts, axes=("embed", None), **kw)
        bias = jnp.zeros((self.num_experts,), jnp.float32)
        self.correction_bias = RouterBias(bias, out_sharding=(None,))
        shared = config.shared_hidden and MLPConfig(config.shared_hidden, gated=True, bias=False)
        self.shared = shared and MLP(dim, shared, param_dtype=param_dtype, rngs=rngs)

    def forward(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """The routed experts' output plus the shared experts', and the call's ``RouterStats``."""
        y, stats = super().forward(x)
        return (y if self.shared is None else y + self.shared(x)), stats

    def route(self, tokens: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
        """The float32 logits of ``tokens`` and their ``group_limited_route``."""
        logits = self.router(tokens.astype(jnp.float32))  # its LoRA too, where it has one
        routed = group_limited_route(
            logits,
            self.correction_bias[...],
            self.top_k,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            scaling=self.routed_scaling_factor,
        )
        return logits, routed


def balance_router_biases(model: nnx.Module, captured: nnx.State, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: every ``DeepSeekMoE`` of ``model``
    moves its ``correction_bias`` by ``rate * sign(mean load - load)``, ``load`` the
    ``tokens_per_expert`` it sowed into ``captured`` (``nnx.capture(..., nnx.Intermediate)``).

    Example:
        >>> config = DeepSeekMoEConfig(16, num_experts=4, top_k=1)
        >>> with nnx.use_eager_sharding(False):
        ...     moe = config.build(8, rngs=nnx.Rngs(0))
        >>> _, captured = nnx.capture(moe, nnx.Intermediate)(jnp.ones((3, 8)))
        >>> balance_router_biases(moe, captured, 0.01)
        >>> [round(b, 3) for b in moe.correction_bias[...].tolist()]  # 3 tokens, all to expert 3
        [0.01, 0.01, 0.01, -0.01]
    """
    flat = dict(nnx.to_flat_state(captured))
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, DeepSeekMoE):
            continue
        key = (*path, "tokens_per_expert")
        if key not in flat:
            raise ValueError(
                f"balance_router_biases: the step captured no tokens_per_expert of the "
                f"DeepSeekMoE at {'/'.join(map(str, path))} (run it under nnx.capture)"
            )
        calls = flat[key].get_value()
        calls = calls if isinstance(calls, tuple) else (calls,)
        bias = node.correction_bias
        load = sum(jnp.asarray(c, jnp.float32).reshape(-1, *bias.shape).sum(0) for c in calls)
        mean = load.mean(axis=-1, keepdims=True)
        bias[...] = bias[...] + rate * jnp.sign(mean - load)
