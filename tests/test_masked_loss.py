"""Masked losses and packing (GPT.loss with ``weights``, ``segments`` and ``positions``): the
pipelined, microbatched, data-parallel step equals the one-device whole-batch step, and a
packed batch equals each example run on its own."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, stage_rules
from mmnnx.train.examples import Rows
from mmnnx.train.records import Example
from tests.models import SMALL_GPT, reference_loss_and_grads

RULES = mm.logical_rules(batch="data")


def gpt(config=SMALL_GPT):
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


def two_stages_of_two():
    return [
        mm.Task(
            f"s{i}",
            mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1], axis_names=("data",)),
            logical_axes=RULES,
        )  # fmt: skip
        for i in range(2)
    ]


def lopsided_batch(rows=8, length=16, seed=0):
    """Rows whose targets are mostly in the first microbatch: per-microbatch means differ."""
    rng = np.random.default_rng(seed)
    examples = []
    for r in range(rows):
        n = int(rng.integers(6, length + 1))
        targets = np.zeros(n, bool)
        targets[n - (n - 2 if r < 2 else 1) :] = True
        examples.append(Example(rng.integers(1, 64, n).astype(np.int32), targets))
    return Rows.of(examples, length).batch(np.arange(rows))


def assert_close(grads, ref_grads):
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def pipelined_step(num=4, schedule="1f1b"):
    def step(model, opt, batch):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, b: m.loss(b)), num=num, reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, batch)
        opt.update(model, grads)
        return loss, grads

    return mm.jit(step)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_masked_loss_pipelined_equals_one_device(schedule):
    batch = lopsided_batch()
    ref_loss, ref_grads = reference_loss_and_grads(gpt(), batch)
    model = mm.place(gpt(), stage_rules(gpt(), two_stages_of_two(), report=False))
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    loss, grads = pipelined_step(schedule=schedule)(model, opt, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
    # the mean of per-microbatch masked means is another number
    model = gpt()
    means = []
    for mb in range(4):
        part = {k: v[2 * mb : 2 * mb + 2] for k, v in batch.items()}
        mask = part["weights"] > 0
        part["weights"] = mask * (2 / mask.sum())
        means.append(float(loss_of(model, part)))
    assert abs(np.mean(means) - float(ref_loss)) > 1e-2


loss_of = nnx.jit(lambda model, batch: model.loss(batch))  # eager: each operation compiled


def test_packed_batch_equals_each_example_alone():
    rng = np.random.default_rng(1)
    examples = [
        Example(rng.integers(1, 64, n).astype(np.int32), rng.random(n) < 0.7)
        for n in (5, 9, 3, 7, 2, 12, 6, 8, 11, 4, 10, 6)
    ]
    rows = Rows.of(examples, 16, pack=True)
    assert len(rows.tokens) < len(examples)
    packed = rows.batch(np.arange(len(rows.tokens)))
    count = sum(e.targets[1:].sum() for e in examples)

    @nnx.jit
    def one(model, tokens, weights):  # an example alone, padded at its end: causal, unchanged
        return nnx.value_and_grad(lambda m: m.loss({"tokens": tokens, "weights": weights}))(model)

    model, ref_loss, ref_grads = gpt(), 0.0, None
    for e in examples:
        row = Rows.of([e], 16).batch([0])
        weights = (row["weights"] > 0).astype(np.float32) / count  # each target counted once
        loss, grads = one(model, row["tokens"], weights)
        ref_loss += loss
        ref_grads = grads if ref_grads is None else jax.tree.map(jnp.add, ref_grads, grads)
    loss, grads = reference_loss_and_grads(gpt(), packed)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
    # pipelined over two stages of two, 2 microbatches: the same step
    model = mm.place(gpt(), stage_rules(gpt(), two_stages_of_two(), report=False))
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    assert len(rows.tokens) >= 4
    even = {k: v[:4] for k, v in packed.items()}
    ref_even, _ = reference_loss_and_grads(gpt(), even)
    loss, _ = pipelined_step(num=2)(model, opt, even)
    np.testing.assert_allclose(loss, ref_even, rtol=1e-5)


def test_scan_layers_take_packing():
    rng = np.random.default_rng(2)
    examples = [Example(rng.integers(1, 64, n).astype(np.int32), np.ones(n, bool)) for n in (4, 7)]
    packed = Rows.of(examples, 12, pack=True).batch([0])
    scanned = gpt(dataclasses.replace(SMALL_GPT, scan_layers=True))
    got = loss_of(scanned, packed)  # jitted, as above

    def summed(e):  # weights of 1: the row's summed loss
        weights = np.ones((1, len(e.ids) - 1), np.float32)
        return float(loss_of(scanned, {"tokens": e.ids[None], "weights": weights}))

    alone = sum(summed(e) for e in examples) / sum(len(e.ids) - 1 for e in examples)
    np.testing.assert_allclose(got, alone, rtol=1e-5)


def test_dpo_step_pipelined_equals_one_device():
    from mmnnx.train.preference import dpo_loss, pair_rows

    rng = np.random.default_rng(3)
    pairs = [
        tuple(rng.integers(1, 64, n).tolist() for n in rng.integers(2, 5, 3)) for _ in range(4)
    ]
    rows = pair_rows(pairs, 16)

    def loss_fn(model, reference, rows):
        return dpo_loss(model, reference, rows, beta=0.5)[0]

    with nnx.use_eager_sharding(False):
        reference = GPT(SMALL_GPT, rngs=nnx.Rngs(1))
    ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(gpt(), reference, rows)
    tasks = two_stages_of_two()
    rules = stage_rules(gpt(), tasks, report=False)
    model, placed_reference = mm.place(gpt(), rules), mm.place(reference, rules)

    @mm.jit
    def step(model, reference, rows):
        grad_fn = mm.microbatch(nnx.value_and_grad(loss_fn), num=2, argnums=(2,), reduce="mean")
        return grad_fn(model, reference, rows)

    loss, grads = step(model, placed_reference, rows)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_close(grads, ref_grads)
