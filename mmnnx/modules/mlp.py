"""``MLP``: the transformer feed-forward block, plain or gated (SwiGLU-style, or GeGLU)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules.checks import check, is_int
from mmnnx.modules.linear import Linear


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU by its tanh approximation (Hugging Face's ``gelu_pytorch_tanh``, Gemma's GeGLU)."""
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x: jax.Array) -> jax.Array:
    """GELU by the error function (Hugging Face's ``gelu``)."""
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": gelu_exact,
}
"""``MLPConfig.activation``'s choices, by the names of Hugging Face's ``hidden_act``."""


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """A dense feed-forward ``MLP`` of ``hidden`` features, gated when ``gated``, with biases when
    ``bias``; ``activation`` a key of :data:`ACTIVATIONS` (``None``: SiLU when gated, else GELU).

    Example:
        >>> MLPConfig(8, activation="relu")
        Traceback (most recent call last):
        ...
        ValueError: MLPConfig.activation must be None or one of silu, gelu_pytorch_tanh, gelu, \
got 'relu'
    """

    hidden: int
    gated: bool = False
    bias: bool = True
    activation: str | None = None

    def __post_init__(self):
        check(is_int(self.hidden, minimum=1), "MLPConfig.hidden", "an int >= 1", self.hidden)
        for name in ("gated", "bias"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"MLPConfig.{name}", "a bool", value)
        ok = self.activation is None or self.activation in ACTIVATIONS
        where = f"None or one of {', '.join(ACTIVATIONS)}"
        check(ok, "MLPConfig.activation", where, self.activation)

    def build(
        self, dim: int, *, param_dtype: jax.typing.DTypeLike = jnp.float32, rngs: nnx.Rngs
    ) -> MLP:
        """The ``MLP`` of width ``dim``, its Variables in ``param_dtype``."""
        return MLP(dim, self, param_dtype=param_dtype, rngs=rngs)


class MLP(nnx.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` when ``config.gated``; ``up`` and
    ``gate`` named ``("embed", "mlp")``, ``down`` ``("mlp", "embed")``: mapping ``mlp`` to a mesh
    axis gives Megatron tensor parallelism.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     mlp = MLP(8, MLPConfig(32, gated=True), rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((2, 8))).shape, mlp.activation.__name__
        ((2, 8), 'silu')
    """

    def __init__(
        self,
        dim: int,
        config: MLPConfig,
        *,
        activation: Callable[[jax.Array], jax.Array] | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.dim, self.hidden, self.gated = dim, config.hidden, config.gated
        default = jax.nn.silu if config.gated else jax.nn.gelu
        self.activation = activation or ACTIVATIONS.get(config.activation, default)
        kw = dict(use_bias=config.bias, param_dtype=param_dtype, rngs=rngs)
        self.up = Linear(dim, self.hidden, axes=("embed", "mlp"), **kw)
        self.gate = Linear(dim, self.hidden, axes=("embed", "mlp"), **kw) if self.gated else None
        self.down = Linear(self.hidden, dim, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate is not None:
            h = self.activation(self.gate(x)) * self.up(x)
        else:
            h = self.activation(self.up(x))
        return self.down(h)
