"""``Linear``: a dense layer whose kernel and bias carry logical axis names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

default_kernel_init = nnx.initializers.lecun_normal()


class Linear(nnx.Module):
    """``y = x @ kernel + bias``, ``kernel`` named ``axes`` and ``bias`` ``axes[1:]`` (logical names
    ``mm.place`` translates by each task's rules); computed in the input's dtype.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     layer = Linear(4, 8, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 4))).shape
        (2, 8)
        >>> layer.kernel.get_metadata()["out_sharding"], layer.bias.get_metadata()["out_sharding"]
        (('embed', 'mlp'), ('mlp',))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None] = ("embed", "mlp"),
        use_bias: bool = True,
        kernel_init: nnx.Initializer = default_kernel_init,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if len(axes) != 2:
            raise ValueError(f"Linear: axes must name the 2 kernel dimensions, got {axes!r}")
        self.in_features, self.out_features = in_features, out_features
        self.axes = tuple(axes)
        init = nnx.with_partitioning(kernel_init, self.axes)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype))
        zeros = nnx.with_partitioning(nnx.initializers.zeros_init(), self.axes[1:])
        bias = zeros(rngs.params(), (out_features,), param_dtype) if use_bias else None
        self.bias = None if bias is None else nnx.Param(bias)
        self.lora = nnx.data(None)  # a LoRA adapter (mmnnx.modules.add_lora), added to the output
        self.adapters = True  # whether ``lora`` is added: ``nnx.view(model, adapters=False)``

    def set_view(self, adapters: bool | None = None) -> None:
        """``nnx.view(model, adapters=False)``: the same Variables computing without LoRA adapters.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     layer = Linear(4, 8, rngs=nnx.Rngs(0))
            >>> base = nnx.view(layer, adapters=False)
            >>> base.kernel is layer.kernel, base.adapters, layer.adapters
            (True, False, True)
        """
        if adapters is not None:
            self.adapters = adapters

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...].astype(x.dtype)  # computed in the input's dtype
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        if self.lora is not None and self.adapters:
            y = y + self.lora(x)
        return y
