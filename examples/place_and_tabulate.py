"""Demo: a small NNX model placed on two tasks of 8 simulated CPU devices, then summarised.

Run with `.venv/bin/python examples/place_and_tabulate.py` (after `make setup`); it sets
XLA_FLAGS for 8 simulated CPU devices itself, before JAX is imported.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mmnnx as mm  # noqa: E402


class MLP(nnx.Module):
    """Two tensor-parallel blocks; the kernels carry logical axis names."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.blocks = nnx.List(
            [
                nnx.Sequential(
                    nnx.Linear(
                        dim,
                        hidden,
                        rngs=rngs,
                        kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                    ),
                    nnx.Linear(
                        hidden,
                        dim,
                        rngs=rngs,
                        kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                    ),
                )
                for _ in range(2)
            ]
        )
        self.norm = nnx.RMSNorm(dim, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


def main():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    rules = mm.logical_rules(batch="data", mlp="model", embed=None)
    stage0 = mm.Task("stage0", mesh=mesh.slice(stage=0), logical_axes=rules)
    stage1 = mm.Task("stage1", mesh=mesh.slice(stage=1), logical_axes=rules)

    model = mm.init(
        lambda: MLP(64, 256, rngs=nnx.Rngs(0)),
        [("blocks/0", stage0), ("blocks/1|norm", stage1)],
    )
    print(f"{len(jax.devices())} devices; global mesh {dict(mesh.shape)}\n")
    print(mm.tabulate(model, jnp.ones((16, 64))))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    print()
    print(mm.tabulate(opt, title="optimizer state (moments follow their parameters)"))


if __name__ == "__main__":
    main()
