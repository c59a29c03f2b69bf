"""bonsai's gpt-oss (tests/outside/bonsai_gpt_oss.py, an unmerged jax-ml/bonsai pull request) as
written, pipelined: its 4 decoder layers cut by ``mm.stage_rules(blocks="model.layers")`` over 2
tasks of 2x2 devices (experts on one mesh axis, their hidden axis on the other; 2 microbatches
under 1F1B) and over 4 tasks of 2 devices (experts on the mesh's one axis; 4 microbatches, a
step under 1F1B then one under ZB-H1): its logits (4 tasks), loss, gradients and parameters after
2 AdamW steps equal the same model on one device. Its attention ``sinks``, which the forward pass
never reads, get zero gradients on their own task and add no stage: the chain is the
placement's."""

import functools

import jax
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.oracle import close_to_max, params_close
from tests.outside import bonsai_gpt_oss as gpt_oss

LR = 3e-3
CONFIG = gpt_oss.tiny_config(layers=4, experts=4)
TOKENS = jax.random.randint(jax.random.key(1), (8, 7), 0, CONFIG.vocab_size)


def tasks_of(num_tasks: int) -> tuple[list[mm.Task], str | None]:
    """``num_tasks`` tasks on disjoint devices of the 8, and the axis the experts' hidden axis
    goes on (2 tasks: 2x2 meshes ``("expert", "model")``; 4 tasks: 2 devices ``("expert",)``)."""
    per = 8 // num_tasks
    shape = {4: ((2, 2), ("expert", "model")), 2: ((2,), ("expert",))}[per]
    tasks = [
        mm.Task(
            f"t{i}",
            mesh=mm.TaskMesh(
                devices=range(per * i, per * (i + 1)), axis_sizes=shape[0], axis_names=shape[1]
            ),
        )
        for i in range(num_tasks)
    ]
    return tasks, "model" if per == 4 else None


def loss_fn(model, tokens):
    """Next-token cross-entropy of bonsai's logits."""
    logits = gpt_oss.logits(model, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_step(microbatches: int):
    """A step (for ``mm.jit``) over ``microbatches`` under 1F1B (unless planned with another
    schedule) returning the loss and the gradients after an AdamW update."""

    def step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn), num=microbatches, reduce="mean", schedule="1f1b"
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss, grads

    return step


@functools.cache  # one oracle for every layout
def one_device() -> tuple:
    """The tiny gpt-oss on one device: the model after 2 AdamW steps, its logits before them
    and each step's ``(loss, grads)``."""

    @nnx.jit
    def reference_step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        opt.update(model, grads)
        return loss, grads

    ref = gpt_oss.tiny_gpt_oss(CONFIG)
    logits = nnx.jit(gpt_oss.logits)(ref, TOKENS)
    opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)
    return ref, logits, [reference_step(ref, opt, TOKENS) for _ in range(2)]


def placed(num_tasks: int) -> tuple[nnx.Module, list[mm.Task]]:
    """The tiny gpt-oss (the oracle's weights: the same seed) placed over ``num_tasks`` tasks by
    ``mm.stage_rules`` with the experts' specs, and the tasks; checks where each layer's experts
    went."""
    tasks, model_axis = tasks_of(num_tasks)
    model = gpt_oss.tiny_gpt_oss(CONFIG)
    stages = mm.stage_rules(model, tasks, blocks="model.layers", report=False)
    spec = gpt_oss.expert_spec(model_axis)
    model = mm.place(model, [(regex, task, spec) for regex, task in stages])
    per_task = CONFIG.num_hidden_layers // num_tasks
    for i, layer in enumerate(model.model.layers):
        down = layer.mlp.experts.down_proj
        assert set(down.get_value().devices()) == set(tasks[i // per_task].jax_mesh.devices.flat)
        assert down.get_value().sharding.spec == spec("down_proj", down)
    return model, tasks


@pytest.mark.parametrize(
    ("num_tasks", "microbatches", "schedules"),
    [(2, 2, ("1f1b", "1f1b")), (4, 4, ("1f1b", "zero-bubble-h1"))],
    ids=["2-tasks-1f1b", "4-tasks-1f1b-then-zb-h1"],
)
def test_gpt_oss_trains_pipelined_as_placed_and_matches_one_device(
    num_tasks, microbatches, schedules
):
    model, tasks = placed(num_tasks)
    ref, ref_logits, ref_steps = one_device()
    if num_tasks == 4:  # the forward pass alone, not pipelined
        close_to_max(mm.jit(gpt_oss.logits)(model, TOKENS), ref_logits)

    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    step = mm.jit(train_step(microbatches))
    steps = {name: step.with_options(schedule=name) for name in set(schedules)}
    boundaries = list(zip(tasks, tasks[1:], strict=False))
    for scheduled in steps.values():
        plan = scheduled.plan(model, opt, TOKENS)
        assert [t.name for t in plan.pipeline.stage_tasks] == [t.name for t in tasks]
        # one activation forward and one cotangent back per boundary (a layer's output, read by
        # five ops of the next layer, not the two addends of the residual sum that makes it)
        activations = [tr for tr in plan.transfers if tr.source is not None and tr.shape]
        assert sorted((tr.source.name, tr.target.name) for tr in activations) == sorted(
            (s.name, t.name) for pair in boundaries for s, t in (pair, pair[::-1])
        )
    per_task = CONFIG.num_hidden_layers // num_tasks
    for schedule, (ref_loss, ref_grads) in zip(schedules, ref_steps, strict=True):
        loss, grads = steps[schedule](model, opt, TOKENS)
        close_to_max(loss, ref_loss)
        close_to_max(grads, ref_grads)
        for i, layer in grads.model.layers.items():  # zero, on the layer's task
            sinks = layer.self_attn.sinks[...]
            assert not sinks.any()
            assert sinks.devices() == set(tasks[i // per_task].jax_mesh.devices.flat)
    params_close(model, ref, ref_steps[0][1], steps=2, lr=LR)
