"""Property tests: random layer chains, random placements of their layers on 2-4 tasks and random
schedules, each against the same model on one device."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmnnx as mm
from tests.oracle import close, trees_close

SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,  # the same examples on every run (CI)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
BATCH = 8


class Chain(nnx.Module):
    def __init__(self, widths, *, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths[:-1], widths[1:], strict=True)]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


reference = nnx.jit(nnx.value_and_grad(loss_fn))
"""The loss and gradients on one device, under ``nnx.jit`` (one program per chain rather than
each op compiled apart for each chain's widths)."""


@pytest.fixture(scope="module")
def tasks():
    return [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[4 + i])) for i in range(4)]


@st.composite
def chains(draw, max_layers=5):
    layers = draw(st.integers(2, max_layers))
    widths = draw(st.lists(st.integers(2, 6), min_size=layers + 1, max_size=layers + 1))
    num_tasks = draw(st.integers(2, 4))
    owners = draw(st.lists(st.integers(0, num_tasks - 1), min_size=layers, max_size=layers))
    return widths, owners


def build(widths, owners, tasks):
    model = Chain(widths, rngs=nnx.Rngs(0))
    rules = [(f"layers/{i}/", tasks[t]) for i, t in enumerate(owners)]
    return mm.place(model, rules), Chain(widths, rngs=nnx.Rngs(0))


def data(widths):
    x = jax.random.normal(jax.random.key(1), (BATCH, widths[0]))
    y = jax.random.normal(jax.random.key(2), (BATCH, widths[-1]))
    return x, y


@SETTINGS
@given(chain=chains())
def test_random_placements_match_one_device(tasks, chain):
    widths, owners = chain
    model, ref = build(widths, owners, tasks)
    x, y = data(widths)
    step = mm.jit(nnx.value_and_grad(loss_fn))
    loss, grads = step(model, x, y)
    ref_loss, ref_grads = reference(ref, x, y)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    for i, t in enumerate(owners):
        assert grads["layers"][i]["kernel"].get_value().devices() == {tasks[t].jax_mesh.devices[0]}


@SETTINGS
@given(
    chain=chains(max_layers=4),
    schedule=st.sampled_from(["gpipe", "1f1b", "zero-bubble-h1"]),
    num=st.sampled_from([4, 8]),
)
def test_random_pipelines_match_one_device(tasks, chain, schedule, num):
    widths, owners = chain
    model, ref = build(widths, owners, tasks)
    x, y = data(widths)
    step = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss_fn), num=num, argnums=(1, 2), reduce="mean", schedule=schedule
        )
    )
    loss, grads = step(model, x, y)
    ref_loss, ref_grads = reference(ref, x, y)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    pipeline = step.plan(model, x, y).pipeline
    assert pipeline.schedule.name == schedule and pipeline.schedule.num_microbatches == num
