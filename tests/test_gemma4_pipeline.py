"""google/tunix's Gemma 4 (tests/outside/tunix_gemma4.py) as written, pipelined: its 4 decoder
layers cut by ``mm.stage_rules`` over 4 tasks of one device, layers 2 and 3 attending over the
keys and values layers 0 and 1 computed two tasks before them, and holding a `kv_einsum` and key
norm they never read. Under 1F1B (the gradients) and ZB-H1 (the gradients and an AdamW step),
from the same parameters: the loss, the gradients (zero for the unread parameters, on their own
task) and the parameters equal the same step on one device, and the unread parameters add no
stage: the chain is the placement's, ``t0 t1 t2 t3``, and ``t0`` again for the output head tied
to the embedding."""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from tests.oracle import close_to_max, params_close
from tests.outside import tunix_gemma4 as gemma4

LR = 3e-3
M = 5  # the tied head makes five stages: 1F1B and ZB-H1 need as many microbatches
CONFIG = gemma4.tiny_config(layers=4)
TOKENS = jax.random.randint(jax.random.key(1), (2 * M, 7), 0, CONFIG.num_embed)


def loss_fn(model, tokens):
    """Next-token cross-entropy of tunix's logits."""
    logits = gemma4.logits(model, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def grads(model, tokens):
    """The mean loss and gradients over ``M`` microbatches (1F1B unless the step is planned
    with another schedule)."""
    grad_fn = mm.microbatch(nnx.value_and_grad(loss_fn), num=M, reduce="mean", schedule="1f1b")
    return grad_fn(model, tokens)


def train_step(model, opt, tokens):
    """:func:`grads`, then an AdamW update."""
    loss, g = grads(model, tokens)
    opt.update(model, g)
    return loss, g


def unread(model) -> list[tuple]:
    """The paths of the parameters of layers that share another layer's keys and values:
    their key/value projection and key norm, which tunix's attention does not call there."""
    shared = [i for i, j in enumerate(model.kv_cache_sharing_patterns) if i != j]
    names = (("kv_einsum", "w"), ("_key_norm", "scale"))
    return [("layers", i, "attn", *name) for i in shared for name in names]


def test_gemma4_with_shared_keys_and_values_pipelines_as_placed_and_matches_one_device():
    tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(4)]
    model = gemma4.tiny_gemma4(CONFIG)
    rules = mm.stage_rules(model, tasks, report=False)  # layer i on t{i}
    model = mm.place(model, [(regex, task, P()) for regex, task in rules])
    ref = gemma4.tiny_gemma4(CONFIG)
    assert [path[1] for path in unread(ref)] == [2, 2, 3, 3]
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)
    # the same step on one device: each microbatch's loss and gradients, then their mean
    one = nnx.jit(nnx.value_and_grad(loss_fn))
    parts = [one(ref, part) for part in TOKENS.reshape(M, 2, -1)]
    ref_loss, ref_grads = jax.tree.map(lambda *a: sum(a) / M, *parts)
    ref_opt.update(ref, ref_grads)

    one_f_one_b = mm.jit(grads)
    zero_bubble = mm.jit(train_step).with_options(schedule="zero-bubble-h1")
    for step, args in ((one_f_one_b, (model, TOKENS)), (zero_bubble, (model, opt, TOKENS))):
        plan = step.plan(*args)
        assert [t.name for t in plan.pipeline.stage_tasks] == ["t0", "t1", "t2", "t3", "t0"]
        loss, got = step(*args)
        close_to_max(loss, ref_loss)
        close_to_max(got, ref_grads)
        flat = dict(nnx.to_flat_state(got))
        for path in unread(ref):
            zero = flat[path].get_value()
            assert not np.asarray(zero).any(), path
            assert zero.devices() == set(tasks[path[1]].jax_mesh.devices.flat), path
    params_close(model, ref, ref_grads, steps=1, lr=LR)
