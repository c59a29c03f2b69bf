"""mm.microbatch against the full-batch call on one device."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.oracle import close, trees_close
from tests.test_jit import RULES, loss_fn, make, two_stage


@pytest.fixture(scope="module")
def batch():
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jax.random.normal(jax.random.key(2), (16, 4))
    return x, y


@pytest.fixture(scope="module")
def tasks():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    return tuple(
        mm.Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=RULES) for i in range(2)
    )


@pytest.mark.parametrize("num", [1, 2, 4, 8])
def test_mean_equals_full_batch(batch, num):
    model = make()
    full = nnx.value_and_grad(loss_fn)(model, *batch)
    split = mm.microbatch(nnx.value_and_grad(loss_fn), num=num, argnums=(1, 2), reduce="mean")(
        model, *batch
    )
    close(split[0], full[0])
    trees_close(split[1], full[1])


def test_sum_and_size_and_pytree_reduce(batch):
    x, _ = batch

    def f(w, x):
        return {"total": (x * w).sum(), "count": jnp.float32(x.shape[0])}

    out = mm.microbatch(f, size=4, reduce="sum")(2.0, x)
    close(out["total"], (x * 2.0).sum())
    assert float(out["count"]) == 16.0
    mixed = mm.microbatch(f, num=4, reduce={"total": "sum", "count": "mean"})(2.0, x)
    close(mixed["total"], (x * 2.0).sum())
    assert float(mixed["count"]) == 4.0


def test_split_along_another_dim():
    x = jnp.arange(24.0).reshape(2, 12)
    out = mm.microbatch(lambda x: x.sum(axis=1), num=3, argnums=0, dim=1)(x)
    close(out, x.sum(axis=1))


def test_inside_mm_jit_two_stages(tasks, batch):
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ref = make()
    ref_opt = nnx.Optimizer(ref, optax.adamw(1e-2), wrt=nnx.Param)

    def step(model, opt, x, y, micro):
        grad_fn = nnx.value_and_grad(loss_fn)
        if micro:
            grad_fn = mm.microbatch(grad_fn, num=4, argnums=(1, 2), reduce="mean")
        loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss

    jstep = mm.jit(step, static_argnums=4)
    for _ in range(2):
        close(jstep(model, opt, *batch, True), step(ref, ref_opt, *batch, False))
    trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    assert mm.placement(model)["l2/kernel"][0] == "stage1"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num=2, size=4), "exactly one of num= and size="),
        (dict(), "exactly one of num= and size="),
        (dict(num=0), "num must be >= 1"),
        (dict(num=2, schedule="zigzag"), "unknown schedule 'zigzag'.*gpipe, 1f1b"),
        (dict(num=2, reduce="max"), "reduce 'max' is not one of"),
        (dict(num=2, virtual_stages=0), "virtual_stages must be an int >= 1"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mm.microbatch(lambda w, x: x, **kwargs)


def test_bad_batches():
    f = mm.microbatch(lambda w, x: x["a"].sum(), num=3)
    with pytest.raises(ValueError, match="3 microbatches do not divide the batch of 8"):
        f(1.0, {"a": jnp.ones((8, 2)), "b": jnp.ones((8,))})
    with pytest.raises(ValueError, match=r"differ in size along dimension 0: arg1\['a'\] has 6"):
        mm.microbatch(lambda w, x: 0.0, num=2)(1.0, {"a": jnp.ones((6, 2)), "b": jnp.ones(4)})
    with pytest.raises(ValueError, match="size 5 does not divide the batch of 8"):
        mm.microbatch(lambda w, x: 0.0, size=5)(1.0, jnp.ones(8))
    # an Rngs where the batch is expected (Flax's tutorials pass one before the batch)
    rngs_first = mm.microbatch(lambda w, rngs, x: x.sum(), num=2)
    with pytest.raises(
        ValueError,
        match=r"arg1\.default\.count\.value has no dimension 0 to split \(shape \(\)\); the "
        r"arguments at argnums=\(1,\) are split into microbatches: pass argnums=",
    ):
        rngs_first(1.0, nnx.Rngs(0), jnp.ones(8))
    assert (
        float(
            mm.microbatch(lambda w, r, x: x.sum(), num=2, argnums=2)(1.0, nnx.Rngs(0), jnp.ones(8))
        )
        == 8.0
    )


@pytest.mark.parametrize("bad", [2.0, "2", True])
def test_a_count_that_is_not_an_int_says_so(bad):
    with pytest.raises(TypeError, match=rf"num must be an int, got {bad!r}"):
        mm.microbatch(lambda w, x: x, num=bad)


def test_an_unsplit_batch_argument_is_named_with_the_argnums_to_use():
    def loss(w, x, y):  # the default argnums=(1,) splits x but leaves y whole
        return jnp.mean((x @ w - y) ** 2)

    w, x, y = jnp.ones((3, 2)), jnp.ones((8, 3)), jnp.ones((8, 2))
    with pytest.raises(
        TypeError, match=r"argument\(s\) 2 have the batch's size 8 .*argnums=\(1, 2\)"
    ):
        mm.microbatch(loss, num=4)(w, x, y)
    assert float(mm.microbatch(loss, num=4, argnums=(1, 2), reduce="mean")(w, x, y)) == 4.0


def test_a_reduce_tree_that_does_not_match_names_both_structures():
    f = mm.microbatch(lambda w, x: (x.sum(), x.mean()), num=2, reduce={"a": "sum"})
    with pytest.raises(ValueError, match=r"reduce is PyTreeDef\(\{'a': \*\}\), the output is "):
        f(1.0, jnp.ones(4))


def test_a_function_updating_parameters_is_unrolled_and_says_so(tasks):
    # a parameter written inside the microbatched function (here: a max-norm projection done
    # in the forward pass) is traced once per microbatch instead of pipelined; the warning and
    # the plan name the Variables. Batch statistics and RNG counts do pipeline
    # (tests/test_pipeline_state.py).
    s0, s1 = tasks

    class Projected(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 16, rngs=rngs)
            self.b = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x):
            kernel = self.b.kernel[...]
            self.b.kernel[...] = kernel / jnp.maximum(1.0, jnp.linalg.norm(kernel))
            return self.b(jax.nn.relu(self.a(x)))

    model = mm.place(Projected(nnx.Rngs(0)), [("a", s0), ("b", s1)])
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    step = mm.jit(mm.microbatch(nnx.value_and_grad(loss), num=4, reduce="mean"))
    with pytest.warns(mm.UnrolledMicrobatchWarning) as caught:
        step(model, x)
    message = str(caught[0].message)
    assert message.startswith(
        "mm.microbatch: the microbatched function updates 'arg0/b/kernel', so its 4 "
        "microbatches run as an unrolled loop"
    )
    plan = step.plan(model, x)
    assert plan.pipeline is None and plan.unrolled == [message]
    assert f"unrolled: {message}" in str(plan)
    # the timeline has no pipeline actions to show, and says why
    with pytest.warns(mm.UnrolledMicrobatchWarning, match="timeline: nothing to time, mm.micro"):
        assert step.timeline(model, x) == []
