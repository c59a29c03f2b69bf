"""Model code as Flax's GSPMD guide writes it, run through mm.jit: the model of
google/flax ``docs_nnx/guides/flax_gspmd.md`` ("Shard a wholesome model"), copied as written
(Variables annotated with device axes, ``jax.lax.with_sharding_constraint`` with a bare
``PartitionSpec`` inside a ``jax.lax.scan`` over ``nnx.vmap``-stacked layers), against the same
step under ``nnx.jit`` on one auto mesh of the same shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mmnnx as mm


# -- from google/flax docs_nnx/guides/flax_gspmd.md, as written --------------------------------
class DotReluDot(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,  # or use `bias_init` to give it annotation too
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth)),  # RNG key and shape for W2 creation
            sharding=("model", None),
        )

    def __call__(self, x: jax.Array):
        y = self.dot1(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        z = jnp.dot(y, self.w2[...])
        return z


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs):
        # Annotate the additional axis with sharding=None, meaning it will be
        # replicated across all devices.
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.fork(split=num_layers))

    def __call__(self, x):
        def scan_over_layers(x, layer):
            return layer(x), None

        x, _ = jax.lax.scan(scan_over_layers, x, self.layers)
        return x


def train_step(model, optimizer, x, y):
    def loss_fn(model: DotReluDot):
        y_pred = model(x)
        return jnp.mean((y_pred - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


# -- the guide's model through mmnnx ------------------------------------------------------------


def _build():
    with nnx.use_eager_sharding(False):
        model = MultiDotReluDot(64, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def _task(name, first):
    mesh = mm.TaskMesh(
        devices=range(first, first + 4), axis_sizes=(2, 2), axis_names=("data", "model")
    )
    return mm.Task(name, mesh=mesh)


def _pipelined_step(model, optimizer, x, y):
    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    grad_fn = mm.microbatch(
        nnx.value_and_grad(loss_fn), num=2, reduce="mean", schedule="1f1b", argnums=(1, 2)
    )
    loss, grads = grad_fn(model, x, y)
    optimizer.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def reference():
    x = jax.random.normal(jax.random.key(1), (8, 64))
    y = jax.random.normal(jax.random.key(2), (8, 64))
    model, opt = _build()
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )
    with jax.set_mesh(mesh):
        step = nnx.jit(train_step)
        losses = [float(step(model, opt, x, y)) for _ in range(3)]
    return x, y, losses, nnx.state(model)


@pytest.mark.parametrize("layout", ["one task", "layers split over two tasks", "pipelined"])
def test_the_flax_gspmd_guide_model_trains_as_written(reference, layout):
    x, y, want, want_state = reference
    model, _ = _build()
    if layout == "one task":
        rules = [(".*", _task("t", 0))]
    else:
        rules = [("layers", [_task("t0", 0), _task("t1", 4)])]
    model = mm.place(model, rules)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    # placed as annotated: device axes on the task's own mesh
    assert tuple(model.layers.dot1.kernel.get_value().sharding.spec)[1:] == (None, "model")
    step = mm.jit(_pipelined_step if layout == "pipelined" else train_step)
    losses = [float(step(model, opt, x, y)) for _ in range(3)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    for (path, got), (_, expected) in zip(
        jax.tree.leaves_with_path(nnx.state(model)),
        jax.tree.leaves_with_path(want_state),
        strict=True,
    ):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6, err_msg=str(path)
        )


def test_a_bare_spec_naming_an_axis_no_task_has_is_named():
    task = _task("t", 0)

    @mm.jit
    def step(model, x):
        return jax.lax.with_sharding_constraint(model(x), P("data", "expert")).sum()

    model = mm.place(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), [(".*", task)])
    with pytest.raises(ValueError, match=r"expert .* is not found in mesh"):
        step(model, jnp.ones((8, 4)))
