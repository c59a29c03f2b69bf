"""Train steps written the way Flax's own tutorials write them, run through mm.jit unchanged on
two tasks and compared with the same code on one device."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.oracle import params_close
from tests.plans import packing_of


class CNN(nnx.Module):
    """The CNN of Flax's MNIST tutorial (docs_nnx/mnist_tutorial), with fewer channels: Dropout
    drawing from an ``nnx.Rngs`` passed to ``__call__``, and BatchNorm."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(8, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(784, 32, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=0.025, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.dropout2(self.conv2(x), rngs=rngs))))
        x = x.reshape(x.shape[0], -1)
        x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
        return self.linear2(x)


def loss_fn(model, rngs, batch):
    logits = model(batch["image"], rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def train_step(model, optimizer, metrics, rngs, batch):
    """The tutorial's train step: metrics updated inside it, an unplaced Rngs for Dropout."""
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, rngs, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])
    optimizer.update(model, grads)


def eval_step(model, metrics, batch):
    loss, logits = loss_fn(model, None, batch)
    metrics.update(loss=loss, logits=logits, labels=batch["label"])


def batches(n: int):
    rng = np.random.default_rng(0)
    return [
        {
            "image": jnp.asarray(rng.normal(size=(16, 28, 28, 1)), jnp.float32),
            "label": jnp.asarray(rng.integers(0, 10, size=(16,)), jnp.int32),
        }
        for _ in range(n)
    ]


def run(train, evaluate, model):
    """The tutorial's loop: train steps, compute and reset the metrics, an eval step."""
    optimizer = nnx.Optimizer(model, optax.adamw(0.005, 0.9), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    rngs = nnx.Rngs(0)
    history = []
    data = batches(3)
    unplaced = nnx.state((metrics, rngs))
    devices = {path: v.get_value().devices() for path, v in nnx.to_flat_state(unplaced)}
    for batch in data[:2]:
        model.train()
        train(model, optimizer, metrics, rngs, batch)
        # state on no task stays on its devices: a metric's total and count together
        now = nnx.state((metrics, rngs))
        assert {p: v.get_value().devices() for p, v in nnx.to_flat_state(now)} == devices
    history.append({k: float(v) for k, v in metrics.compute().items()})
    metrics.reset()
    model.eval()
    evaluate(model, metrics, data[2])
    history.append({k: float(v) for k, v in metrics.compute().items()})
    return history, model


def test_mnist_tutorial_train_and_eval_steps_on_two_tasks():
    convs = mm.Task("convs", mesh=mm.TaskMesh(devices=range(2)))
    dense = mm.Task("dense", mesh=mm.TaskMesh(devices=range(2, 4)))
    rules = [("conv|batch_norm|dropout1", convs), ("linear|dropout2", dense)]
    placed = mm.init(lambda: CNN(rngs=nnx.Rngs(0)), rules)
    history, placed = run(mm.jit(train_step), mm.jit(eval_step), placed)
    expected, reference = run(nnx.jit(train_step), nnx.jit(eval_step), CNN(rngs=nnx.Rngs(0)))
    for got, want in zip(history, expected, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
    # parameters after two AdamW steps (rounding noise in a gradient becomes a +-lr step), and
    # every other Variable (batch statistics, RNG keys and counts) as on one device
    (_, _), first_grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(
        CNN(rngs=nnx.Rngs(0)), nnx.Rngs(0), batches(1)[0]
    )  # compiled: an eager convolution gradient compiles op by op (7 s)
    params_close(placed, reference, first_grads, steps=2, lr=0.005)
    others = nnx.Not(nnx.Param)
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(placed, others)),
        nnx.to_flat_state(nnx.state(reference, others)),
        strict=True,
    ):
        a, b = a.get_value(), b.get_value()
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, err_msg=str(path))


class Encoder(nnx.Module):
    """A block of the ViT tutorial (docs_nnx/examples/vit_training.md): LayerNorms,
    ``nnx.MultiHeadAttention`` with dropout drawing from the ``rngs`` passed in, an MLP with
    Dropout."""

    def __init__(self, dim, rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.mha = nnx.MultiHeadAttention(
            num_heads=2,
            in_features=dim,
            dropout_rate=0.1,
            broadcast_dropout=False,
            decode=False,
            deterministic=False,
            keep_rngs=False,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp_up_proj = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.mlp_down_proj = nnx.Linear(2 * dim, dim, rngs=rngs)
        self.mlp_drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, rngs=None):
        x = x + self.mha(self.norm1(x), rngs=rngs)
        h = self.mlp_drop(nnx.gelu(self.mlp_up_proj(self.norm2(x))), rngs=rngs)
        return x + self.mlp_drop(self.mlp_down_proj(h), rngs=rngs)


class ViT(nnx.Module):
    """The tutorial's VisionTransformer, small: patch embedding, class token, position
    embeddings, Dropout, the blocks in an ``nnx.Sequential`` named ``encoder``, ``final_norm``
    and ``classifier``."""

    def __init__(self, rngs, dim=16, depth=4):
        self.patch_embeddings = nnx.Conv(3, dim, kernel_size=(8, 8), strides=(8, 8), rngs=rngs)
        self.position_embeddings = nnx.Param(0.02 * jax.random.normal(rngs.params(), (1, 5, dim)))
        self.dropout = nnx.Dropout(0.1)
        self.cls_token = nnx.Param(jnp.zeros((1, 1, dim)))
        self.encoder = nnx.Sequential(*[Encoder(dim, rngs) for _ in range(depth)])
        self.final_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.classifier = nnx.Linear(dim, 10, rngs=rngs)

    def __call__(self, x, rngs=None):
        patches = self.patch_embeddings(x)
        patches = patches.reshape(patches.shape[0], -1, patches.shape[-1])
        cls = jnp.tile(self.cls_token[...], (patches.shape[0], 1, 1))
        x = jnp.concat([cls, patches], axis=1) + self.position_embeddings[...]
        x = self.encoder(self.dropout(x, rngs=rngs), rngs=rngs)
        return self.classifier(self.final_norm(x)[:, 0])


def vit_losses_and_logits(model, images, labels, rngs=None):
    logits = model(images, rngs=rngs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits


def vit_train_step(model, optimizer, rngs, batch):
    """The tutorial's ``train_step``, its gradient microbatched: Dropout draws from an
    ``nnx.Rngs`` forked inside the step."""
    images, labels = batch
    grad_fn = mm.microbatch(
        nnx.value_and_grad(vit_losses_and_logits, has_aux=True),
        num=4,
        argnums=(1, 2),
        reduce=(("mean", "concat"), "mean"),
    )
    (loss, logits), grads = grad_fn(model, images, labels, rngs.fork())
    optimizer.update(model, grads)
    return loss, logits


def vit_batch():
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(8, 16, 16, 3)), jnp.float32),
        jnp.asarray(rng.integers(0, 10, 8), jnp.int32),
    )


@pytest.fixture(scope="module")
def vit_loop():
    """Two steps of the tutorial's step with ``mm.microbatch`` outside ``mm.jit`` (the plain
    loop, eager), once for every placement: each step's loss and logits, then the parameters."""
    ref = ViT(nnx.Rngs(1))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.01, 0.9, nesterov=True), wrt=nnx.Param)
    ref_rngs, batch = nnx.Rngs(12), vit_batch()
    steps = [vit_train_step(ref, ref_opt, ref_rngs, batch) for _ in range(2)]
    return steps, jax.tree.leaves(nnx.state(ref, nnx.Param))


@pytest.mark.parametrize("per_task", [2, 1], ids=["two devices a task", "one device a task"])
def test_vit_tutorial_train_step_with_a_forked_rngs_pipelines_like_the_loop(vit_loop, per_task):
    # on one-device tasks each encoder layer's weights and residuals travel packed, one buffer
    # per layer and one residual buffer per forward, its layers laid out alike
    tasks = [
        mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=range(per_task * i, per_task * (i + 1))))
        for i in range(2)
    ]
    model = ViT(nnx.Rngs(1))
    rules = mm.stage_rules(model, tasks, report=False)  # the Sequential's layers, by default
    assert rules[0][0].startswith("^patch_embeddings/") and "|^encoder/layers/" in rules[0][0]
    assert rules[1][0].startswith("^encoder/layers/")
    assert rules[1][0].endswith("|^final_norm/|^classifier/")
    model = mm.place(model, rules)
    opt = nnx.Optimizer(model, optax.sgd(0.01, 0.9, nesterov=True), wrt=nnx.Param)
    rngs, batch = nnx.Rngs(12), vit_batch()
    step = mm.jit(vit_train_step)
    reference, ref_params = vit_loop
    for ref_loss, ref_logits in reference:
        loss, logits = step(model, opt, rngs, batch)
        # each microbatch draws its own dropout masks, as in the loop (they were all the
        # first microbatch's when the forked count's update was read by nothing)
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
        np.testing.assert_allclose(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), ref_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert step.plan(model, opt, rngs, batch).pipeline.schedule.num_stages == 2
    if per_task == 1:  # each encoder layer's weights and residuals travel packed
        (executable, _), *_ = step._cache.values()
        program = executable.plan.program
        packing, _ = packing_of(executable)
        layers_on = {task.name: 0 for task in tasks}
        for layer in model.encoder.layers:
            (device,) = layer.norm1.scale.get_value().devices()
            layers_on[tasks[device.id].name] += 1
        assert sorted(layers_on.values()) == [1, 3]  # balanced by parameters
        for task, buffers in packing.weights.items():
            assert len(buffers) == layers_on[task.name]  # one buffer per layer
        forwards = [i for i in packing.by_run if program.actions[i].label[1] == "F"]
        assert len(forwards) == 2 * 4  # two stages, four microbatches
        for i in forwards:
            (packed,) = packing.by_run[i]
            assert len(packed.bases) == layers_on[program.actions[i].task.name]
