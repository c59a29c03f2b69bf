"""Small NNX models shared by the tests."""

import jax
from flax import nnx

INIT = nnx.initializers.lecun_normal()


class TwoStageMLP(nnx.Module):
    """Two Linear pairs with logical names; BatchNorm and Dropout for mixed state."""

    def __init__(self, dim: int = 16, hidden: int = 32, *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                nnx.Linear(
                    dim,
                    hidden,
                    rngs=rngs,
                    kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")),
                ),
                nnx.Linear(
                    hidden,
                    dim,
                    rngs=rngs,
                    kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")),
                ),
            ]
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.norm = nnx.BatchNorm(dim, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.layers[0](x))
        return self.norm(self.drop(self.layers[1](h)))


def make_mlp(seed: int = 0) -> TwoStageMLP:
    with nnx.use_eager_sharding(False):
        return TwoStageMLP(rngs=nnx.Rngs(seed))
