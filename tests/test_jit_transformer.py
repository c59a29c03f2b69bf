"""A 4-block transformer on 4 tasks of 2 devices each, against one device."""

import jax
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import four_stage_rules, four_tasks, make_gpt, reference_loss_and_grads
from tests.oracle import close, params_close, trees_close


@pytest.fixture(scope="module")
def tasks():
    return four_tasks()


def place(tasks):
    return mm.place(make_gpt(), four_stage_rules(tasks))


def train_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(tokens))(model)
    opt.update(model, grads)
    return loss


reference_step = nnx.jit(train_step)  # eager, each operation compiled on its own


def test_four_task_transformer_matches_one_device(tasks):
    tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 32)
    model = place(tasks)
    tx = optax.adamw(3e-3)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref = make_gpt()
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)

    loss, grads = mm.jit(nnx.value_and_grad(lambda m, t: m.loss(t)))(model, tokens)
    ref_loss, ref_grads = reference_loss_and_grads(ref, tokens)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)

    step = mm.jit(train_step)
    placement = mm.placement(opt)
    for _ in range(3):
        close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    # e.g. blocks/3/qkv/kernel[8, 19] has gradient -2.7e-8, against ~7e-3 around it
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)
    assert mm.placement(opt) == placement
    for i, block in enumerate(model.blocks):
        kernel = block.up.kernel.get_value()
        assert sorted(d.id for d in kernel.devices()) == [2 * i, 2 * i + 1]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    plan = step.plan(model, opt, tokens)
    assert [t.name for t in plan.tasks] == ["t0", "t1", "t2", "t3"]
    # activations go forward t0->t1->t2->t3 and cotangents come back, nothing else big moves
    hops = [
        (t.source.name, t.target.name)
        for t in plan.transfers
        if t.source is not None and t.nbytes >= 4 * 8 * 16 * 4
    ]
    assert len(hops) == 6  # one activation forward and one cotangent back per boundary
    assert set(hops) == {
        ("t0", "t1"),
        ("t1", "t2"),
        ("t2", "t3"),
        ("t3", "t2"),
        ("t2", "t1"),
        ("t1", "t0"),
    }
