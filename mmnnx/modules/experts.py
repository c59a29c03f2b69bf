"""``Experts``: a mixture of experts' SwiGLU feed-forward networks as stacked weights, run as
grouped matmuls (``jax.lax.ragged_dot``) over the token assignments sorted by expert;
``ClampedExperts``: gpt-oss's, with biases and a clamped SwiGLU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

ExpertFn = Callable[..., jax.Array]
"""``fn(rows, *arrays, group_sizes, hidden_axes=())``: rows sorted by expert through each
one's network (rows past the groups: 0), the experts' ``arrays`` as a module's ``arrays()``
gives them; ``hidden_axes``: the mesh axes (inside ``shard_map``) splitting each expert's
hidden features, whose ``psum`` follows."""

# fan-in over each expert's own input dimension, not over the stack of experts
default_expert_init = nnx.initializers.lecun_normal(batch_axis=(0,))

IN_NAMES = ("expert", "embed", "mlp")  # gate and up, (E, D, H)
OUT_NAMES = ("expert", "mlp", "embed")  # down, (E, H, D)


class Experts(nnx.Module):
    """``num_experts`` SwiGLU networks ``down_e(silu(gate_e(x)) * up_e(x))``, stacked: ``gate``,
    ``up`` ``(E, dim, hidden)`` named ``("expert", "embed", "mlp")``, ``down`` ``(E, hidden, dim)``.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     experts = Experts(4, 8, 16, rngs=nnx.Rngs(0))
        >>> experts.gate.shape, experts.down.get_metadata()["out_sharding"]
        ((4, 8, 16), ('expert', 'mlp', 'embed'))
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        kernel_init: nnx.Initializer = default_expert_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden

        def param(names, shape):
            init = nnx.with_partitioning(kernel_init, names)
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        self.gate = param(IN_NAMES, (num_experts, dim, hidden))
        self.up = param(IN_NAMES, (num_experts, dim, hidden))
        self.down = param(OUT_NAMES, (num_experts, hidden, dim))

    @property
    def placed(self) -> nnx.Variable:
        """The ``(E, dim, hidden)`` Variable whose placement is the experts' layout."""
        return self.gate

    def arrays(self) -> tuple[jax.Array, ...]:
        """The weights :meth:`apply` takes: ``gate``, ``up``, ``down``."""
        return self.gate[...], self.up[...], self.down[...]

    @staticmethod
    def specs(expert: Any, hidden: Any) -> tuple[PartitionSpec, ...]:
        """Each of :meth:`arrays`' specs, the experts split over ``expert``, hidden features over
        ``hidden``."""
        return (PartitionSpec(expert, None, hidden),) * 2 + (PartitionSpec(expert, hidden, None),)

    def apply(
        self, rows: jax.Array, *arrays_and_sizes: jax.Array, hidden_axes: tuple[str, ...] = ()
    ) -> jax.Array:
        """``grouped_swiglu``: an :data:`ExpertFn`."""
        return grouped_swiglu(rows, *arrays_and_sizes)


class ClampedExperts(nnx.Module):
    """gpt-oss's experts: ``down_e(clamped_swiglu(x @ gate_up_e + gate_up_bias_e)) + down_bias_e``,
    ``gate_up`` ``(E, dim, 2 * hidden)`` interleaving gate (even) and up (odd) features as
    transformers' ``GptOssExperts`` stores them.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     experts = ClampedExperts(4, 8, 16, rngs=nnx.Rngs(0))
        >>> experts.gate_up.shape, experts.down_bias.shape
        ((4, 8, 32), (4, 8))
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        *,
        alpha: float = 1.702,
        limit: float = 7.0,
        kernel_init: nnx.Initializer = default_expert_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self.alpha, self.limit = alpha, limit

        def param(names, shape, init=kernel_init):
            return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, param_dtype))

        zeros = nnx.initializers.zeros_init()
        self.gate_up = param(IN_NAMES, (num_experts, dim, 2 * hidden))
        self.gate_up_bias = param(("expert", "mlp"), (num_experts, 2 * hidden), zeros)
        self.down = param(OUT_NAMES, (num_experts, hidden, dim))
        self.down_bias = param(("expert", "embed"), (num_experts, dim), zeros)

    @property
    def placed(self) -> nnx.Variable:
        """The ``(E, dim, 2 * hidden)`` Variable whose placement is the experts' layout."""
        return self.gate_up

    def arrays(self) -> tuple[jax.Array, ...]:
        """The weights :meth:`apply` takes: ``gate_up``, its bias, ``down``, its bias."""
        return self.gate_up[...], self.gate_up_bias[...], self.down[...], self.down_bias[...]

    @staticmethod
    def specs(expert: Any, hidden: Any) -> tuple[PartitionSpec, ...]:
        """Each of :meth:`arrays`' specs, the experts split over ``expert``, hidden features over
        ``hidden``."""
        e, h = expert, hidden
        return (PartitionSpec(e, None, h), PartitionSpec(e, h),
                PartitionSpec(e, h, None), PartitionSpec(e, None))  # fmt: skip

    def apply(
        self, rows: jax.Array, *arrays_and_sizes: jax.Array, hidden_axes: tuple[str, ...] = ()
    ) -> jax.Array:
        """``grouped_clamped_swiglu``; with ``hidden_axes``, ``down_bias`` added on their first
        device only."""
        *arrays, down_bias, sizes = arrays_and_sizes
        if hidden_axes:
            down_bias = jnp.where(jax.lax.axis_index(hidden_axes) == 0, down_bias, 0)
        return grouped_clamped_swiglu(
            rows, *arrays, down_bias, sizes, alpha=self.alpha, limit=self.limit
        )


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's activation of interleaved gate (even) and up (odd) features: ``(clip(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def grouped_clamped_swiglu(
    rows: jax.Array,
    gate_up: jax.Array,
    gate_up_bias: jax.Array,
    down: jax.Array,
    down_bias: jax.Array,
    group_sizes: jax.Array,
    *,
    alpha: float,
    limit: float,
) -> jax.Array:
    """Rows sorted by expert, each through its :class:`ClampedExperts` network; rows past the
    groups: 0."""
    dtype = rows.dtype
    num_experts = gate_up.shape[0]
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")  # E past them

    def bias(b: jax.Array) -> jax.Array:
        padded = jnp.concatenate([b.astype(dtype), jnp.zeros((1, b.shape[-1]), dtype)])
        return padded[jnp.minimum(expert, num_experts)]

    h = jax.lax.ragged_dot(rows, gate_up.astype(dtype), group_sizes) + bias(gate_up_bias)
    h = clamped_swiglu(h, alpha, limit)
    return jax.lax.ragged_dot(h, down.astype(dtype), group_sizes) + bias(down_bias)


def grouped_swiglu(
    rows: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    """Rows sorted by expert, each through its SwiGLU; rows past the groups: 0."""
    dtype = rows.dtype
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate.astype(dtype), group_sizes))
    h = h * jax.lax.ragged_dot(rows, up.astype(dtype), group_sizes)
    return jax.lax.ragged_dot(h, down.astype(dtype), group_sizes)


def combine(weights: jax.Array, outputs: jax.Array) -> jax.Array:
    return jnp.sum(weights[..., None] * outputs, axis=1)


def sort_by_expert(key: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The stable order sorting ``key``, its inverse, and each group's size."""
    order = jnp.argsort(key, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    sizes = jnp.zeros(num_groups, jnp.int32).at[key].add(1, mode="drop")
    return order, inverse, sizes


def apply_local(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: tuple[jax.Array, ...],
    ffn: ExpertFn = grouped_swiglu,
) -> jax.Array:
    """``sum_k weights * expert_{indices}(x)`` over the assignments ``keep`` keeps, each expert's
    network ``ffn`` of the ``experts`` arrays (default SwiGLU: gate, up, down)."""
    n, k = indices.shape
    num_experts = experts[0].shape[0]
    key = jnp.where(keep, indices, num_experts).reshape(-1)
    order, inverse, sizes = sort_by_expert(key, num_experts)
    out = ffn(x[order // k], *experts, sizes)[inverse].reshape(n, k, -1)
    return combine(weights, jnp.where(keep[..., None], out, 0))
