"""``Experts``: a mixture of experts' SwiGLU feed-forward networks as stacked weights, run as
grouped matmuls (``jax.lax.ragged_dot``) over the token assignments sorted by expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# fan-in over each expert's own input dimension, not over the stack of experts
default_expert_init = nnx.initializers.lecun_normal(batch_axis=(0,))

IN_NAMES = ("expert", "embed", "mlp")  # gate and up, (E, D, H)
OUT_NAMES = ("expert", "mlp", "embed")  # down, (E, H, D)


class Experts(nnx.Module):
    """``num_experts`` SwiGLU networks ``down_e(silu(gate_e(x)) * up_e(x))``, their weights
    stacked: ``gate`` and ``up`` ``(E, dim, hidden)`` named ``("expert", "embed", "mlp")``,
    ``down`` ``(E, hidden, dim)`` named ``("expert", "mlp", "embed")`` (no biases, as
    Qwen3-MoE's experts). Mapping ``expert`` to a mesh axis gives expert parallelism
    (``mmnnx.modules.MoE``).

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


def grouped_swiglu(
    rows: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    down: jax.Array,
    group_sizes: jax.Array,
) -> jax.Array:
    """Rows sorted by expert, each through its SwiGLU; rows past the groups: 0.

    Example:
        >>> w = jnp.ones((2, 3, 4))
        >>> out = grouped_swiglu(jnp.ones((3, 3)), w, w, jnp.ones((2, 4, 3)), jnp.array([1, 1]))
        >>> [round(v, 2) for v in out[:, 0].tolist()]  # 4 * silu(3) * 3, twice, then nothing
        [34.29, 34.29, 0.0]
    """
    dtype = rows.dtype
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate.astype(dtype), group_sizes))
    h = h * jax.lax.ragged_dot(rows, up.astype(dtype), group_sizes)
    return jax.lax.ragged_dot(h, down.astype(dtype), group_sizes)


def combine(weights: jax.Array, outputs: jax.Array) -> jax.Array:
    return jnp.sum(weights[..., None] * outputs, axis=1)


def sort_by_expert(key: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The stable order sorting ``key``, its inverse, and each group's size.

    Example:
        >>> order, inverse, sizes = sort_by_expert(jnp.array([1, 3, 0, 1]), 2)
        >>> order.tolist(), inverse.tolist(), sizes.tolist()
        ([2, 0, 3, 1], [1, 3, 0, 2], [1, 2])
    """
    order = jnp.argsort(key, stable=True)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))
    sizes = jnp.zeros(num_groups, jnp.int32).at[key].add(1, mode="drop")
    return order, inverse, sizes


def apply_local(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: tuple[jax.Array, jax.Array, jax.Array],
) -> jax.Array:
    """``sum_k weights * expert_{indices}(x)`` over the assignments ``keep`` keeps.

    Example:
        >>> w = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 4)), jnp.ones((2, 4, 3))
        >>> idx, keep = jnp.array([[1], [0]]), jnp.array([[True], [False]])
        >>> y = apply_local(jnp.ones((2, 3)), idx, jnp.ones((2, 1)), keep, w)
        >>> [round(v, 2) for v in y[:, 0].tolist()]  # the second token's assignment dropped
        [34.29, 0.0]
    """
    n, k = indices.shape
    num_experts = experts[0].shape[0]
    key = jnp.where(keep, indices, num_experts).reshape(-1)
    order, inverse, sizes = sort_by_expert(key, num_experts)
    out = grouped_swiglu(x[order // k], *experts, sizes)[inverse].reshape(n, k, -1)
    return combine(weights, jnp.where(keep[..., None], out, 0))
