"""JAX's own shape errors raised inside a user's step come back naming the model path of the
module and the user's line (issue 44): a Python int written for the whole batch, a wrong feature
dimension, a batch argument left out of ``argnums``."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mmnnx as mm


class Net(nnx.Module):
    def __init__(self, *, hidden_in: int = 16, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.l2 = nnx.Linear(hidden_in, 4, rngs=rngs)

    def __call__(self, x, rows=None):
        h = self.l1(x)
        if rows is not None:
            h = h.reshape(rows, -1, 16).mean(0)  # LINE-RESHAPE
        return self.l2(h)  # LINE-L2


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if f"# {marker}" in text)


@pytest.fixture(scope="module")
def tasks():
    mesh = mm.MultiMesh(axis_sizes=(2,), axis_names=("stage",), devices=range(2))
    return [mm.Task(f"t{i}", mesh=mesh.task_mesh(stage=i)) for i in range(2)]


def _step(tasks, *, hidden_in=16, rows=None, argnums=(1, 2)):
    model = mm.place(Net(hidden_in=hidden_in, rngs=nnx.Rngs(0)), {"l1": tasks[0], "l2": tasks[1]})
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    before = nnx.state(model, nnx.Param)

    def loss_fn(m, x, y):
        return jnp.mean((m(x, rows=rows) - y) ** 2)

    @mm.jit
    def step(m, o, x, y):
        grad = nnx.value_and_grad(loss_fn)
        loss, g = mm.microbatch(grad, num=4, argnums=argnums, reduce="mean")(m, x, y)
        o.update(m, g)
        return loss

    return step, model, optimizer, before


def _unchanged(model, before):
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all((a == b).all() for a, b in zip(after, jax.tree.leaves(before), strict=True))


def test_a_python_int_written_for_the_whole_batch(tasks):
    step, model, optimizer, before = _step(tasks, rows=8)
    with pytest.raises(TypeError) as info:
        step(model, optimizer, jnp.ones((8, 8)), jnp.ones((8, 4)))
    message = str(info.value)
    assert "cannot reshape" in message  # JAX's own words stay first
    assert "split into 4 microbatches of 2" in message and "x.shape[0]" in message
    assert f"{__file__}:{_line('LINE-RESHAPE')}" in message
    _unchanged(model, before)


def test_a_wrong_feature_dimension_names_the_module(tasks):
    step, model, optimizer, _ = _step(tasks, hidden_in=8)
    with pytest.raises(TypeError) as info:
        step(model, optimizer, jnp.ones((8, 8)), jnp.ones((8, 4)))
    message = str(info.value)
    assert "dot_general" in message
    assert re.search(r"raised in module l2 .*Linear: .*kernel \(8, 4\)", message), message
    assert f"{__file__}:{_line('LINE-L2')}" in message
    assert "microbatches of" not in message  # not mistaken for a whole-batch shape


def test_a_batch_argument_left_out_of_argnums(tasks):
    step, model, optimizer, before = _step(tasks, argnums=(1,))
    with pytest.raises(TypeError) as info:
        step(model, optimizer, jnp.ones((8, 8)), jnp.ones((8, 4)))
    message = str(info.value)
    assert "use argnums=(1, 2)" in message
    assert f"{__file__}:" in message  # the user's line of the loss
    _unchanged(model, before)


def test_plain_mm_jit_names_the_module_too(tasks):
    model = mm.place(Net(hidden_in=8, rngs=nnx.Rngs(0)), {"l1": tasks[0], "l2": tasks[1]})
    with pytest.raises(TypeError, match=r"(?s)raised in module l2 .*LINE-L2"):
        mm.jit(lambda m, x: m(x))(model, jnp.ones((2, 8)))


def test_placement_rules_as_a_dict_and_a_one_axis_mesh(tasks):
    model = mm.place(Net(rngs=nnx.Rngs(0)), {"l1": tasks[0], "l2": tasks[1]})
    assert mm.task_of(model.l1.kernel).name == "t0" and mm.task_of(model.l2.kernel).name == "t1"
    assert list(tasks[1].mesh.devices.flat) == [1]
