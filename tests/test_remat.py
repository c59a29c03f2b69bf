"""Residual recomputation (``mm.jit(recompute_residuals=True)``, the default): each stage's
backward remakes the cheap residuals of its forward from those it keeps. The forward returns
fewer arrays, fewer bytes wait between the passes, and the step trains as on one device."""

import functools

import jax
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import stage_rules
from mmnnx.mpmd.plan.remat import RECOMPUTED
from tests.models import (
    SMALL_GPT,
    gpt_step,
    one_device_tasks,
    reference_loss_and_grads,
    reference_step,
    small_gpt,
)
from tests.oracle import close, close_to_max, params_close

TOKENS = jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)


def trained(schedule, recompute):
    """The small GPT on four one-device tasks, three AdamW steps on ``TOKENS`` (the third
    timed by ``memory_profile``): the model, the first two losses, the executable, the
    memory profile."""
    tasks = one_device_tasks(4)
    model = small_gpt()
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(gpt_step(schedule), recompute_residuals=recompute)
    losses = [step(model, opt, TOKENS) for _ in range(2)]
    memory = step.memory_profile(model, opt, TOKENS)  # the last step
    (executable, _), *_ = step._cache.values()
    return model, losses, executable, memory


@pytest.fixture(scope="module")
def steps():
    """``steps(schedule, recompute)``: :func:`trained`'s three steps on ``TOKENS``, run once
    for every test of this module that reads them."""
    return functools.cache(trained)


TRANSCENDENTAL = {"exp", "log", "tanh", "rsqrt", "sqrt", "logistic", "erf", "sin", "cos"}


def residuals(pipeline):
    """Per stage: the forward's results that a backward pass of the stage reads."""
    out = {}
    for (kind, stage), frag in pipeline.stages.items():
        if kind == "F":
            back = [f for (k, s), f in pipeline.stages.items() if s == stage and k in "BIW"]
            out[stage] = {v for v in frag.out_ids if any(v in b.in_ids for b in back)}
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_recomputing_backward_trains_like_one_device_with_fewer_residuals(schedule, steps):
    tokens = TOKENS
    model, losses, executable, memory = steps(schedule, True)
    kept_model, kept_losses, kept_executable, kept_memory = steps(schedule, False)

    ref = small_gpt()
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
    _, ref_grads = reference_loss_and_grads(small_gpt(), tokens)
    for loss, kept_loss in zip(losses, kept_losses, strict=True):
        ref_loss = reference_step(ref, ref_opt, tokens)
        close(loss, ref_loss)
        close(kept_loss, ref_loss)
    reference_step(ref, ref_opt, tokens)
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)

    pipeline, kept_pipeline = executable.plan.pipeline, kept_executable.plan.pipeline
    fewer, every = residuals(pipeline), residuals(kept_pipeline)
    assert fewer.keys() == every.keys()
    for stage in every:
        # a GPT block keeps about half its residuals; nothing new is saved
        assert fewer[stage] < every[stage]
        assert 3 * len(fewer[stage]) <= 2 * len(every[stage]), (stage, fewer, every)
    # the backward runs only cheap forward ops again: no exp, tanh, rsqrt or matmul
    for (kind, stage), frag in pipeline.stages.items():
        if kind not in "BIW":
            continue
        forward = {op.index for op in pipeline.stages[("F", stage)].ops}
        before = {op.index for op in kept_pipeline.stages[(kind, stage)].ops}
        again = {op.name for op in frag.ops if op.index in forward and op.index not in before}
        assert again, (kind, stage)
        assert not again & TRANSCENDENTAL and "dot_general" not in again
        assert again <= RECOMPUTED
    # each task holds fewer bytes of per-microbatch values at its peak (under ZB-H1 much of
    # the peak is input gradients that deferred weight-gradient passes hold)
    bound = 0.75 if schedule == "1f1b" else 0.95
    for task, (peak, _) in memory.items():
        assert peak < bound * kept_memory[task][0], (task, peak, kept_memory[task])


def test_a_residual_sent_on_is_read_not_recomputed(steps):
    # the activation a stage hands the next one is returned anyway: its backward reads it
    _, _, executable, _ = steps("1f1b", True)
    pipeline = executable.plan.pipeline
    for stage in range(3):
        forward, nxt = pipeline.stages[("F", stage)], pipeline.stages[("F", stage + 1)]
        sent = set(forward.out_ids) & set(nxt.in_ids)
        assert sent
        back = pipeline.stages[("B", stage)]
        assert not sent & {v for op in back.ops for v in op.outs}


def test_recompute_residuals_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute_residuals must be True or False"):
        mm.jit(gpt_step("1f1b"), recompute_residuals="yes")


def remat_gpt(remat):
    import dataclasses

    from mmnnx.models import GPT

    with nnx.use_eager_sharding(False):
        return GPT(dataclasses.replace(SMALL_GPT, remat=remat), rngs=nnx.Rngs(0))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_gpt_remat_policies_train_like_one_device_holding_less(schedule):
    tokens = jax.random.randint(jax.random.key(3), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    held = {}
    for remat in ("none", "full", "dots", "offload"):
        model = remat_gpt(remat)
        mm.place(model, stage_rules(model, one_device_tasks(4), report=False))
        opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
        step = mm.jit(gpt_step(schedule))
        held[remat] = step.memory_profile(model, opt, tokens)
        ref_loss, _ = reference_loss_and_grads(small_gpt(), tokens)
        close(step(model, opt, tokens), ref_loss)
    for task, (peak, _) in held["none"].items():  # each task holds fewer bytes at its peak
        assert held["full"][task][0] < 0.7 * peak, (task, held)
        assert held["dots"][task][0] < peak, (task, held)


def test_unknown_remat_policy_is_named():
    from mmnnx.models import GPTConfig

    with pytest.raises(ValueError, match="GPTConfig.remat must be one of none, full, dots"):
        GPTConfig(remat="some")


def test_remat_flag_reaches_scratch_and_pretrained_models():
    import pathlib

    from mmnnx.train.config import RunConfig
    from mmnnx.train.run_model import model_config

    policy = pathlib.Path(__file__).parent / "transformers_fixtures" / "dpo" / "policy"
    assert model_config(RunConfig.of({"remat": "full", "model_axis": 1}), 256).remat == "full"
    pretrained = model_config(RunConfig.of({"remat": "dots", "init_from": str(policy)}), 300)
    assert pretrained.remat == "dots" and pretrained.depth == 2


def test_a_block_under_remat_steps_with_residuals_kept_too():
    # its core shared with the other stages' would have returned the block's input, which it
    # reads through the input's constraint: it is not shared (it raised KeyError before)
    tokens = jax.random.randint(jax.random.key(4), (8, SMALL_GPT.max_seq_len + 1), 0, 64)
    model = remat_gpt("full")
    mm.place(model, stage_rules(model, one_device_tasks(4), report=False))
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    loss = mm.jit(gpt_step("1f1b"), recompute_residuals=False)(model, opt, tokens)
    close(loss, reference_loss_and_grads(small_gpt(), tokens)[0])


def whole_model_remat_step(schedule, remat):
    """A train step whose loss runs the whole model under one ``nnx.remat`` (``remat``) or
    without it, over 4 microbatches; it returns the loss and the gradients."""

    def loss(model, tokens):
        return nnx.remat(lambda m, t: m.loss(t))(model, tokens) if remat else model.loss(tokens)

    def step(model, opt, tokens):
        grad_fn = mm.microbatch(nnx.value_and_grad(loss), num=4, reduce="mean", schedule=schedule)
        out = grad_fn(model, tokens)
        opt.update(model, out[1])
        return out

    return step


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_a_remat_over_blocks_on_two_tasks_is_split_per_task(schedule):
    # one nnx.remat around the whole forward, its blocks on two tasks: one checkpoint per task,
    # each stage's backward recomputing its own forward (it raised PlacementConflictError)
    from tests.models import tiny_gpt

    tokens = jax.random.randint(jax.random.key(5), (8, 9), 0, 32)
    d0, d1 = one_device_tasks(2)
    rules = [("embed|blocks/[0-1]/", d0), ("blocks/[2-3]/|norm|head", d1)]
    kept, pipelines = {}, {}
    for remat in (True, False):
        model = mm.place(tiny_gpt(), rules)
        opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
        step = mm.jit(whole_model_remat_step(schedule, remat))
        loss, grads = step(model, opt, tokens)
        ref_loss, ref_grads = reference_loss_and_grads(tiny_gpt(), tokens)
        close(loss, ref_loss, rtol=1e-6)
        close_to_max(grads, ref_grads)
        (executable, _), *_ = step._cache.values()
        pipelines[remat] = executable.plan.pipeline
        kept[remat] = residuals(pipelines[remat])
    for (kind, stage), frag in pipelines[True].stages.items():  # recomputed in the backward
        assert any(op.name == "remat2" for op in frag.ops) == (kind != "F"), (kind, stage)
    assert kept[True].keys() == kept[False].keys() == {0, 1}
    for stage in (0, 1):  # stage 0 keeps nothing, stage 1 the activation it received
        assert len(kept[True][stage]) <= stage < 3 < len(kept[False][stage]), kept


@pytest.mark.parametrize(
    "remat",
    [
        dict(policy=jax.checkpoint_policies.dots_saveable),  # the saved matmuls read across
        dict(prevent_cse=False),
    ],
)
def test_a_remat_over_two_tasks_with_a_policy_steps_like_one_device(remat):
    # the step without mm.microbatch: one program per task, the checkpoint still split
    from tests.models import tiny_gpt

    def step(model, opt, tokens):
        loss_fn = lambda m, t: nnx.remat(lambda m, t: m.loss(t), **remat)(m, t)  # noqa: E731
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        opt.update(model, grads)
        return loss, grads

    tokens = jax.random.randint(jax.random.key(6), (4, 9), 0, 32)
    d0, d1 = one_device_tasks(2)
    model = mm.place(tiny_gpt(), [("embed|blocks/[0-1]/", d0), ("blocks/[2-3]/|norm|head", d1)])
    loss, grads = mm.jit(step)(model, nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param), tokens)
    ref_loss, ref_grads = reference_loss_and_grads(tiny_gpt(), tokens)
    close(loss, ref_loss, rtol=1e-6)
    close_to_max(grads, ref_grads)
