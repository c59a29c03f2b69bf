"""A step that fails while it runs (a callback raises) raises from the mm.jit call, leaves the
model and optimizer as they were, and the next call runs normally."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import one_device_tasks
from tests.oracle import close


@pytest.fixture(scope="module")
def tasks():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    rules = mm.logical_rules(batch="data")
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=rules) for i in range(2)]


def make():
    return nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 16, rngs=nnx.Rngs(1))
    )


class Tripwire:
    """A host callback that raises while armed (optionally only for some inputs)."""

    def __init__(self, when=lambda x: True):
        self.armed, self.when = False, when

    def __call__(self, x):
        if self.armed and self.when(np.asarray(x)):
            raise RuntimeError("tripwire")


def snapshot(*nodes):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(nodes))]


def assert_unchanged(before, *nodes):
    after = snapshot(*nodes)
    assert len(before) == len(after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def loss_with(tripwire, callback):
    def loss_fn(model, x):
        y = model(x)
        return jnp.mean(y**2) + callback(tripwire, y)

    return loss_fn


def debug_callback(tripwire, y):
    jax.debug.callback(tripwire, y)
    return 0.0


def scanned_pure_callback(tripwire, y):
    """A pure_callback nested in a scan body (no effect is recorded for it)."""

    def body(carry, row):
        out = jax.pure_callback(
            lambda r: (tripwire(r), r)[1], jax.ShapeDtypeStruct(row.shape, row.dtype), row
        )
        return carry + out.sum() * 0, None

    total, _ = jax.lax.scan(body, 0.0, jax.lax.stop_gradient(y))
    return total  # zero, but read by the loss: the callback runs


def io_callback_in_cond(tripwire, y):
    """An unordered io_callback in a cond branch."""
    from jax.experimental import io_callback

    def call(v):
        return io_callback(lambda r: (tripwire(r), r)[1], jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    out = jax.lax.cond(True, call, lambda v: v, jax.lax.stop_gradient(y))
    return out.sum() * 0


@pytest.fixture(scope="module")
def single_device_tasks():
    return one_device_tasks(2)


# A callback raising inside a program over several devices, before a collective, made XLA:CPU
# abort the process after 40 s; mm.jit now catches the callback's exception (mpmd/callbacks.py),
# lets the programs finish and raises StepError: every layout survives.
@pytest.mark.parametrize(
    "callback, layout",
    [
        (debug_callback, "tasks"),
        (scanned_pure_callback, "single_device_tasks"),
        (scanned_pure_callback, "tasks"),
        (io_callback_in_cond, "tasks"),
    ],
    ids=["debug_callback_2x2", "pure_callback_in_scan", "pure_callback_in_scan_2x2", "io_2x2"],
)
def test_failing_step_raises_and_keeps_the_state(request, callback, layout):
    s0, s1 = request.getfixturevalue(layout)
    model = mm.place(make(), [("layers/0", s0), ("layers/1", s1)])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref = make()
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    tripwire = Tripwire()
    loss_fn = loss_with(tripwire, callback)

    def train_step(model, opt, x):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x)
        opt.update(model, grads)
        return loss

    step = mm.jit(train_step)
    x = jax.random.normal(jax.random.key(0), (8, 16))
    close(step(model, opt, x), train_step(ref, ref_opt, x))
    before = snapshot(model, opt)
    tripwire.armed = True
    with pytest.raises(mm.StepError, match="train_step failed while running .*tripwire"):
        step(model, opt, x)
    assert_unchanged(before, model, opt)  # no error arrays were written back
    tripwire.armed = False
    close(step(model, opt, x), train_step(ref, ref_opt, x))  # the next call runs normally
    for a, b in zip(snapshot(model, opt), snapshot(ref, ref_opt), strict=True):
        close(a, b)
    assert step.trace_count == 1


def test_failure_in_one_microbatch_of_a_pipeline(tasks):
    s0, s1 = tasks
    model = mm.place(make(), [("layers/0", s0), ("layers/1", s1)])
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref = make()
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100
    third = np.asarray(x[4:6])  # microbatch 2 of 4
    tripwire = Tripwire(when=lambda seen: seen.shape == third.shape and np.allclose(seen, third))

    def loss_fn(model, x):
        jax.debug.callback(tripwire, x)
        return jnp.mean(model(x) ** 2)

    def train_step(model, opt, x):
        grad_fn = mm.microbatch(nnx.value_and_grad(loss_fn), num=4, reduce="mean")
        loss, grads = grad_fn(model, x)
        opt.update(model, grads)
        return loss

    step = mm.jit(train_step)
    assert step.plan(model, opt, x).pipeline is not None  # pipelined, not unrolled
    before = snapshot(model, opt)
    tripwire.armed = True
    with pytest.raises(mm.StepError, match="tripwire"):
        step(model, opt, x)
    assert_unchanged(before, model, opt)
    tripwire.armed = False

    def ref_step(model, opt, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        opt.update(model, grads)
        return loss

    close(step(model, opt, x), ref_step(ref, ref_opt, x))


@pytest.mark.parametrize("num", [1, 4])
def test_a_callback_on_the_batch_runs_once_per_microbatch(tasks, num):
    """A callback that reads only the batch is neither dropped nor recomputed in every fragment
    (it was dropped: slicing of the batch is recomputed where it is read, and a callback has no
    reader)."""
    s0, s1 = tasks
    model = mm.place(make(), [("layers/0", s0), ("layers/1", s1)])
    seen = []

    def loss_fn(model, x):
        jax.debug.callback(lambda rows: seen.append(np.asarray(rows)[:, 0].tolist()), x)
        return jnp.mean(model(x) ** 2)

    grad_fn = nnx.value_and_grad(loss_fn)
    if num > 1:
        grad_fn = mm.microbatch(grad_fn, num=num, reduce="mean")
    x = jnp.arange(8, dtype=jnp.float32)[:, None] * jnp.ones((8, 16))
    jax.block_until_ready(mm.jit(grad_fn)(model, x))
    jax.effects_barrier()
    assert sorted(seen) == [list(map(float, rows)) for rows in np.arange(8).reshape(num, -1)]
