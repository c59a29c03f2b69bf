"""mm.cached_partial: the bound Module and Optimizer are walked once, and the step is unchanged."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.oracle import close
from tests.test_jit import (
    batch,
    flat,
    make,
    placed_and_reference,
    tasks,
    train_step,
    two_stage,
)

__all__ = ["batch", "tasks"]  # pytest fixtures shared with test_jit


def test_steps_match_one_device_and_plain_mm_jit(tasks, batch):
    s0, s1 = tasks
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    step = mm.jit(train_step)
    bound = mm.cached_partial(step, model, opt)
    placement = mm.placement(opt)
    for i in range(3):
        # alternate the two entry points: they share one plan and one model
        loss = bound(*batch) if i % 2 == 0 else step(model, opt, *batch)
        close(loss, train_step(ref, ref_opt, *batch))
        for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
            close(a, b)
        for a, b in zip(flat(opt.opt_state), flat(ref_opt.opt_state), strict=True):
            close(a, b)
        assert mm.placement(opt) == placement
    assert model.l0.kernel.get_value().sharding.mesh == s0.jax_mesh
    assert model.l3.kernel.get_value().sharding.mesh == s1.jax_mesh
    assert step.trace_count == 1


def test_new_batch_shape_and_new_value_shape_replan(tasks, batch):
    model = two_stage(tasks)
    step = mm.jit(lambda m, x: m(x))
    bound = mm.cached_partial(step, model)
    x, _ = batch
    close(bound(x), make()(x), rtol=1e-5)
    bound(x + 1)
    assert step.trace_count == bound.trace_count == 1
    assert bound(jnp.ones((4, 16))).shape == (4, 4)
    assert step.trace_count == bound.trace_count == 2
    # a bound Variable given a value of another shape is read afresh and re-plans
    s1 = tasks[1]
    model.l3.bias.set_value(jax.device_put(jnp.ones((4,)), s1.sharding()))
    out = bound(x)
    ref = make()
    ref.l3.bias.set_value(jnp.ones((4,)))
    close(out, ref(x), rtol=1e-5)


def test_static_and_keyword_arguments_after_the_bound_ones(tasks, batch):
    model = two_stage(tasks)

    def scaled(m, x, scale, *, shift):
        return m(x) * scale + shift

    step = mm.jit(scaled, static_argnums=2)
    bound = mm.cached_partial(step, model)
    x, _ = batch
    ref = make()
    close(bound(x, 2.0, shift=jnp.ones(())), ref(x) * 2.0 + 1, rtol=1e-5)
    close(bound(x, 3.0, shift=jnp.zeros(())), ref(x) * 3.0, rtol=1e-5)
    assert step.trace_count == 2  # one plan per static value


def test_unbound_module_arguments_are_still_written_back(tasks, batch):
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.sgd(0.1))
    bound = mm.cached_partial(mm.jit(train_step), model)  # the optimizer is passed each call
    for _ in range(2):
        close(bound(opt, *batch), train_step(ref, ref_opt, *batch))
    for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
        close(a, b)
    assert int(opt.step.get_value()) == 2


def test_plan_and_timeline_take_the_bound_arguments(tasks, batch):
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    bound = mm.cached_partial(mm.jit(train_step), model, opt)
    assert [t.name for t in bound.plan(*batch).tasks] == ["stage0", "stage1"]
    assert bound.timeline(*batch) == []  # no microbatch loop: nothing is a pipeline action
    assert int(opt.step.get_value()) == 1


def test_only_mm_jit_functions_can_be_bound(tasks):
    model = two_stage(tasks)
    with pytest.raises(TypeError, match="wrap the step with mm.jit first"):
        mm.cached_partial(lambda m, x: m(x), model)


def test_a_failed_step_leaves_the_bound_model_untouched(tasks, batch):
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    bound = mm.cached_partial(mm.jit(train_step), model, opt)
    bound(*batch)  # the structure is cached from here on
    before = flat(nnx.state((model, opt)))
    with pytest.raises(mm.MPMDError, match="'arg2' is a str, not an array"):
        bound("not a batch", batch[1])
    after = flat(nnx.state((model, opt)))
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_restored_checkpoint_is_seen_by_the_bound_step(tasks, batch, tmp_path):
    """Checkpointer.restore writes into the same Variables, so the binding stays valid."""
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    bound = mm.cached_partial(mm.jit(train_step), model, opt)
    with mm.train.Checkpointer(tmp_path / "ckpt") as checkpoints:
        checkpoints.save(0, model=model, opt=opt)
        first = bound(*batch)
        bound(*batch)
        checkpoints.restore(0, model=model, opt=opt)
    close(bound(*batch), first, rtol=0, atol=0)
    assert int(opt.step.get_value()) == 1


def test_training_state_is_held_once(tasks, frozen_heap):
    """The bound step keeps no earlier step's arrays alive: live device bytes after several
    steps equal those of a plain mm.jit loop (issue: they doubled after the first step)."""
    import gc

    s0, s1 = tasks
    x = jax.device_put(jnp.ones((64, 256)), s0.sharding())
    y = jax.device_put(jnp.zeros((64, 256)), s1.sharding())

    def build():
        model = nnx.Sequential(
            nnx.Linear(256, 512, rngs=nnx.Rngs(0)), nnx.Linear(512, 256, rngs=nnx.Rngs(1))
        )
        model = mm.place(model, [("layers/0", s0), ("layers/1", s1)])
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def live_bytes():
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())

    def loop(bind):
        before = live_bytes()
        model, opt = build()
        step = mm.jit(train_step)
        run = mm.cached_partial(step, model, opt) if bind else functools.partial(step, model, opt)
        sizes = []
        for _ in range(4):
            run(x, y)
            sizes.append(live_bytes() - before)
        return sizes

    plain = loop(bind=False)
    bound = loop(bind=True)
    state = 3 * sum(a.nbytes for a in jax.tree.leaves(nnx.state(build()[0])))
    assert plain[-1] >= state  # the model and both Adam moments are alive
    assert bound == plain


def _bound_two_stage(tasks):
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    return model, opt, mm.cached_partial(mm.jit(train_step), model, opt)


def test_a_replaced_variable_or_submodule_is_detected(tasks, batch):
    s0, _ = tasks
    model, opt, step = _bound_two_stage(tasks)
    step(*batch)
    kernel = model.l0.kernel.get_value()
    model.l0.kernel = nnx.Param(kernel + 1)  # a new Variable: the binding holds the old one
    with pytest.raises(mm.SideEffectError, match=r"\.kernel is another object now"):
        step(*batch)
    model, opt, step = _bound_two_stage(tasks)
    step(*batch)
    model.l1 = mm.place(nnx.Linear(32, 16, rngs=nnx.Rngs(5)), [(".*", s0)])
    before = flat(nnx.state(model))
    with pytest.raises(mm.SideEffectError, match=r"\.l1 is another object now"):
        step(*batch)
    for a, b in zip(flat(nnx.state(model)), before, strict=True):
        np.testing.assert_array_equal(a, b)  # refused before anything ran


def test_an_added_variable_is_detected_and_a_plain_attribute_walked_again(tasks, batch):
    model, opt, step = _bound_two_stage(tasks)
    step(*batch)
    model.note = "tuned"  # static, not a Variable: the binding walks the model afresh once
    step(*batch)
    step(*batch)
    assert step.trace_count == 2  # the new static attribute re-plans once, as with mm.jit
    model.l0.scale = nnx.Param(jnp.ones(32))  # never read nor trained by the old binding
    before = flat(nnx.state((model, opt)))
    with pytest.raises(mm.SideEffectError, match=r"'arg0/l0/scale', an nnx.Param, was added"):
        step(*batch)
    for a, b in zip(flat(nnx.state((model, opt))), before, strict=True):
        np.testing.assert_array_equal(a, b)  # refused before anything ran


def test_placing_the_bound_model_again_names_the_fix(tasks, batch):
    s0, s1 = tasks
    model, opt, step = _bound_two_stage(tasks)
    step(*batch)
    mm.place(model, [("l0|l1|l2", s0), ("l3", s1)])  # l2 moves to s0
    with pytest.raises(mm.SideEffectError, match=r"'arg0/l2/.*' was placed again .*new mm.cached"):
        step(*batch)


def test_a_model_placed_on_swapped_tasks_needs_a_new_binding_which_trains_it(tasks, batch):
    s0, s1 = tasks
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.sgd(0.1))
    step = mm.jit(train_step)
    old = mm.cached_partial(step, model, opt)
    close(old(*batch), train_step(ref, ref_opt, *batch))
    mm.place(model, [("l0|l1", s1), ("l2|l3", s0)])
    with pytest.raises(
        mm.SideEffectError, match=r"'arg0/l0/bias' was placed again \(task 'stage0'"
    ):
        old(*batch)
    assert mm.place_optimizer(opt, model) is opt  # optax.sgd keeps nothing per parameter
    new = mm.cached_partial(step, model, opt)
    close(new(*batch), train_step(ref, ref_opt, *batch))
    assert model.l0.kernel.get_value().sharding.mesh == s1.jax_mesh
    assert int(opt.step.get_value()) == 2


def test_assigning_a_plain_array_attribute_is_refused(tasks, batch):
    model = two_stage(tasks)
    model.calls = jnp.zeros(())  # an array attribute, not a Variable

    def counting(m, x):
        m.calls = m.calls + 1
        return m(x)

    with pytest.raises(mm.SideEffectError, match=r"new value to 'arg0/calls', which is not an"):
        mm.jit(counting)(model, batch[0])
    assert float(model.calls) == 0.0
