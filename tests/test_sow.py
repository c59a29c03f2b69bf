"""Values a step sows (``self.sow(nnx.Intermediate, ...)``, ``nnx.capture``): carried back to
the caller's model as ``nnx.jit`` does, and collected from every microbatch of a pipeline in the
unrolled loop's order (``mm.microbatch`` outside ``mm.jit``)."""

import warnings

import jax.numpy as jnp
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import one_device_tasks
from tests.oracle import close, trees_close

pytestmark = pytest.mark.filterwarnings("ignore:Using 'Module.sow:DeprecationWarning")


class Probed(nnx.Module):
    """Four layers, one per stage; each sows its activation (the second sows two values per
    call, so the unrolled loop interleaves them), as Flax's "extracting intermediates" guide
    writes it."""

    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = nnx.tanh(layer(x))
            layer.sow(nnx.Intermediate, "out", x)
            if i == 1:
                layer.sow(nnx.Intermediate, "out", 2 * x)
        return x


def placed_probed() -> Probed:
    tasks = one_device_tasks(4)
    return mm.place(Probed(nnx.Rngs(0)), [(f"^layers/{i}/", t) for i, t in enumerate(tasks)])


def loss_fn(model, x):
    return (model(x) ** 2).sum()


def microbatched(model, x):
    return mm.microbatch(nnx.value_and_grad(loss_fn), num=4, schedule="1f1b")(model, x)


BATCH = jnp.arange(32.0).reshape(8, 4) / 32
LAYERS = {("layers", i, "out") for i in range(4)}


def sown(model) -> dict:
    return {p: v.get_value() for p, v in nnx.to_flat_state(nnx.pop(model, nnx.Intermediate))}


def test_values_sown_in_a_pipeline_equal_the_unrolled_loop_and_reach_the_model():
    model = placed_probed()
    step = mm.jit(microbatched)
    with warnings.catch_warnings():
        warnings.simplefilter("error", mm.UnrolledMicrobatchWarning)
        plan = step.plan(model, BATCH)
        loss, grads = step(model, BATCH)
    assert plan.pipeline is not None and plan.unrolled == []

    reference = Probed(nnx.Rngs(0))
    ref_loss, ref_grads = microbatched(reference, BATCH)  # the unrolled loop, one device
    close(loss, ref_loss)
    trees_close(nnx.state(grads), nnx.state(ref_grads))
    got, want = sown(model), sown(reference)
    assert got.keys() == want.keys() == LAYERS
    assert len(got[("layers", 1, "out")]) == 8  # two values per microbatch, interleaved
    trees_close(got, want)

    step(model, BATCH)  # popped: the next call runs the same plan
    assert step.trace_count == 1


def test_intermediates_popped_or_captured_inside_the_step_are_returned():
    @mm.jit
    def popped(model, x):
        loss, _ = microbatched(model, x)
        return loss, nnx.pop(model, nnx.Intermediate)

    @mm.jit
    def captured(model, x):  # Flax's capture cannot wrap nnx.grad: a forward pass
        return nnx.capture(mm.microbatch(loss_fn, num=4), nnx.Intermediate)(model, x)

    reference = Probed(nnx.Rngs(0))
    microbatched(reference, BATCH)
    want = sown(reference)
    model = placed_probed()
    for step in (popped, captured):
        _, state = step(model, BATCH)
        trees_close({p: v.get_value() for p, v in nnx.to_flat_state(state)}, want)
        assert not hasattr(model.layers[0], "out")


def test_a_step_that_sows_leaves_the_values_on_the_model_as_nnx_jit_does():
    def forward(model, x):
        return model(x).sum()

    model, reference = placed_probed(), Probed(nnx.Rngs(0))
    close(mm.jit(forward)(model, BATCH), nnx.jit(forward)(reference, BATCH))
    trees_close(sown(model), sown(reference))

    step = mm.jit(forward)
    step(model, BATCH)
    with pytest.raises(mm.MPMDError, match=r"'arg0/layers/0/out' holds values sown by an earlier"):
        step(model, BATCH)  # before anything runs
    assert len(model.layers[0].out.get_value()) == 1


def test_a_sow_with_its_own_reduce_fn_unrolls_and_says_so():
    class Summed(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(4, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            h = self.a(x)
            self.sow(nnx.Intermediate, "total", h.sum(), reduce_fn=jnp.add, init_fn=lambda: 0.0)
            return self.b(h)

    tasks = one_device_tasks(2)
    model = mm.place(Summed(nnx.Rngs(0)), [("^a/", tasks[0]), ("^b/", tasks[1])])
    reference = Summed(nnx.Rngs(0))
    step = mm.jit(microbatched)
    with pytest.warns(mm.UnrolledMicrobatchWarning, match="total"):
        loss, _ = step(model, BATCH)
    close(loss, microbatched(reference, BATCH)[0])
    close(model.total.get_value(), reference.total.get_value())
