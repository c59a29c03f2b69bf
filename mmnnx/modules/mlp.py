"""``MLP``: the transformer feed-forward block, plain or gated (SwiGLU-style)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.linear import Linear


class MLP(nnx.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when ``gated``.

    ``up`` and ``gate`` are ``dim -> hidden`` kernels named ``("embed", "mlp")``; ``down`` is
    ``hidden -> dim`` named ``("mlp", "embed")``: mapping ``mlp`` to a mesh axis gives Megatron
    tensor parallelism (one reduction, after ``down``). ``activation`` defaults to GELU, or SiLU
    when gated. ``use_bias=False`` (Llama, Qwen3) drops the three biases; Variables are created
    in ``param_dtype``.

    Example:
        >>> import jax.numpy as jnp
        >>> with nnx.use_eager_sharding(False):
        ...     mlp = MLP(8, 32, gated=True, rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((2, 8))).shape, mlp.activation.__name__
        ((2, 8), 'silu')
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        gated: bool = False,
        activation: Callable[[jax.Array], jax.Array] | None = None,
        use_bias: bool = True,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dim = dim
        self.hidden = hidden
        self.gated = gated
        if activation is None:
            activation = jax.nn.silu if gated else jax.nn.gelu
        self.activation = activation
        kw = dict(use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.up = Linear(dim, hidden, axes=("embed", "mlp"), **kw)
        self.gate = Linear(dim, hidden, axes=("embed", "mlp"), **kw) if gated else None
        self.down = Linear(hidden, dim, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate is not None:
            h = self.activation(self.gate(x)) * self.up(x)
        else:
            h = self.activation(self.up(x))
        return self.down(h)
