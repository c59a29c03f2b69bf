"""Pipelines whose microbatched function draws random numbers and updates batch statistics:
traced once, pipelined, equal to the unrolled loop (``mm.microbatch`` outside ``mm.jit``)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig, stage_rules
from tests.models import gpt_step, one_device_tasks
from tests.oracle import close, params_close
from tests.test_flax_examples import CNN

CNN_RULES = [
    ("^conv1/|^batch_norm1/|^dropout1/", 0),
    ("^conv2/|^batch_norm2/|^dropout2/", 1),
    ("^linear1/", 2),
    ("^linear2/", 3),
]


def single_device_tasks() -> list[mm.Task]:
    return one_device_tasks(4)


def cnn_step(schedule: str, num: int):
    """Flax's MNIST train step with the loss microbatched: Dropout draws from the ``nnx.Rngs``
    passed in, BatchNorm updates its statistics in every microbatch."""

    def loss_fn(model, rngs, batch):
        logits = model(batch["image"], rngs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    def step(model, opt, rngs, batch):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn), num=num, argnums=(2,), reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, rngs, batch)
        opt.update(model, grads)
        return loss

    return step


def cnn_batch(size: int = 16):
    rng = np.random.default_rng(0)
    return {
        "image": jnp.asarray(rng.normal(size=(size, 28, 28, 1)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, size=(size,)), jnp.int32),
    }


def pipelined_without_unrolling(step, *args) -> mm.Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("error", mm.UnrolledMicrobatchWarning)
        plan = step.plan(*args)
    assert plan.pipeline is not None and plan.unrolled == []
    return plan


def with_rates(model, rate: float):
    for _, m in nnx.iter_graph(model):
        if isinstance(m, nnx.Dropout):
            m.rate = rate
    return model


# ZB-H1 with the residuals packed (mm.jit(pack_residuals=True)): its I and W both read them
@pytest.mark.parametrize("schedule, packed", [("1f1b", False), ("zero-bubble-h1", True)])
def test_mnist_cnn_with_dropout_and_batchnorm_pipelines_like_the_unrolled_loop(schedule, packed):
    tasks = single_device_tasks()
    rules = [(regex, tasks[i]) for regex, i in CNN_RULES]
    model = mm.place(with_rates(CNN(rngs=nnx.Rngs(0)), 0.3), rules)
    ref = with_rates(CNN(rngs=nnx.Rngs(0)), 0.3)
    opt = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    rngs, ref_rngs = nnx.Rngs(7), nnx.Rngs(7)
    batch = cnn_batch()
    step = mm.jit(cnn_step(schedule, 4), pack_residuals=packed)
    plan = pipelined_without_unrolling(step, model, opt, rngs, batch)
    assert [t.name for t in plan.pipeline.stage_tasks] == ["d0", "d1", "d2", "d3"]
    ref_step = nnx.jit(cnn_step(schedule, 4))  # outside mm.jit, mm.microbatch is a plain loop
    probe = with_rates(CNN(rngs=nnx.Rngs(0)), 0.3)  # a copy: a forward pass updates statistics

    @nnx.jit
    def first_grads_of(probe):  # the first step's gradient, for params_close's noise
        def loss_fn(model, rngs, batch):
            logits = model(batch["image"], rngs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        grad_fn = mm.microbatch(nnx.grad(loss_fn), num=4, argnums=(2,), reduce="mean")
        return grad_fn(probe, nnx.Rngs(7), batch)

    first_grads = first_grads_of(probe)
    for i in range(3):
        close(step(model, opt, rngs, batch), ref_step(ref, ref_opt, ref_rngs, batch))
        if i == 0:  # later steps' statistics also follow Adam's noise-sized bias steps
            for stats, ref_stats in zip(
                jax.tree.leaves(nnx.state(model, nnx.BatchStat)),
                jax.tree.leaves(nnx.state(ref, nnx.BatchStat)),
                strict=True,
            ):
                close(stats, ref_stats)  # chained through the 4 microbatches in order
    counts = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(rngs, nnx.RngCount))]
    ref_counts = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(ref_rngs, nnx.RngCount))]
    assert counts == ref_counts and int(counts[0]) == 3 * 4 * 3  # 3 draws x 4 microbatches x 3
    params_close(model, ref, nnx.state(first_grads, nnx.Param), steps=3, lr=0.005)


def test_programs_do_not_grow_with_the_microbatch_count():
    tasks = single_device_tasks()
    model = mm.place(CNN(rngs=nnx.Rngs(0)), [(regex, tasks[i]) for regex, i in CNN_RULES])
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    programs = set()
    for num in (4, 8, 16):
        step = mm.jit(cnn_step("1f1b", num))
        plan = pipelined_without_unrolling(step, model, opt, nnx.Rngs(0), cnn_batch(32))
        programs.add(plan.num_programs)
        assert plan.num_programs == len(plan.fragments)  # one program per fragment, summing too
        summing = [a for a in plan.program.actions if isinstance(a, mm.mpmd.Run) and a.sums]
        assert summing and all(None in a.outs for a in summing)  # gradients: the sums alone
    assert len(programs) == 1


GPT_DROPOUT = GPTConfig(vocab_size=64, dim=32, depth=4, num_heads=2, max_seq_len=16, dropout=0.1)
GPT_TOKENS = jax.random.randint(jax.random.key(1), (8, 17), 0, 64)


def new_gpt() -> GPT:
    with nnx.use_eager_sharding(False):
        return GPT(GPT_DROPOUT, rngs=nnx.Rngs(0))


def sgd(model: GPT) -> nnx.Optimizer:
    return nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)  # Adam would magnify rounding


@pytest.fixture(scope="module")
def gpt_unrolled_loop() -> tuple[list, list]:
    """Three steps of the unrolled loop (``mm.microbatch`` outside ``mm.jit``, any schedule):
    the losses and the parameters after them."""
    ref = new_gpt()
    ref_opt = sgd(ref)
    step = nnx.jit(gpt_step("1f1b"))
    losses = [step(ref, ref_opt, GPT_TOKENS) for _ in range(3)]
    return losses, jax.tree.leaves(nnx.state(ref, nnx.Param))


@pytest.mark.parametrize("schedule, packed", [("1f1b", False), ("zero-bubble-h1", True)])
def test_gpt_with_dropout_pipelines_like_the_unrolled_loop(schedule, packed, gpt_unrolled_loop):
    tasks = single_device_tasks()  # tensor parallelism would only slow compiling here
    model = new_gpt()
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = sgd(model)
    step = mm.jit(gpt_step(schedule), pack_residuals=packed)
    pipelined_without_unrolling(step, model, opt, GPT_TOKENS)
    ref_losses, ref_params = gpt_unrolled_loop
    for ref_loss in ref_losses:
        close(step(model, opt, GPT_TOKENS), ref_loss)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), ref_params, strict=True):
        close(a, b)


def test_state_updated_by_two_stages_is_refused_naming_it():
    tasks = single_device_tasks()

    class Shared(nnx.Module):
        """A running total updated by the first and the last layer (two stages)."""

        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 1, rngs=rngs)
            self.total = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            h = self.a(x)
            self.total[...] = self.total[...] + h.sum()
            y = self.b(h)
            self.total[...] = self.total[...] + y.sum()
            return y

    model = mm.place(Shared(nnx.Rngs(0)), [("^a/|^total", tasks[0]), ("^b/", tasks[1])])
    step = mm.jit(
        lambda m, x: mm.microbatch(nnx.value_and_grad(lambda m, x: m(x).sum()), num=2)(m, x)[0]
    )
    with pytest.raises(mm.MPMDError, match="read and written by different pipeline stages"):
        step(model, jnp.ones((4, 4)))
    assert float(model.total.get_value()) == 0.0
