"""Steps written for explicit mesh axes (JAX's "sharding in types": ``jax.sharding.reshard``,
``out_sharding=P(...)``), as JAX's explicit-sharding guide and MaxText write them: ``mm.jit``
traces them on the mesh shape every task shares and compiles each task's programs under its
own mesh with explicit axes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from tests.oracle import close


class ExplicitMLP(nnx.Module):
    """Tensor-parallel MLP written for explicit axes: the hidden layer is resharded over
    "model" by hand and the output layer names its output sharding."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            8, 16, kernel_init=nnx.with_partitioning(init, P(None, "model")), rngs=rngs
        )
        self.down = nnx.Linear(
            16, 8, kernel_init=nnx.with_partitioning(init, P("model", None)), rngs=rngs
        )

    def __call__(self, x):
        x = jax.sharding.reshard(x, P())
        h = nnx.relu(self.up(x))
        h = jax.sharding.reshard(h, P(None, "model"))
        return self.down(h, out_sharding=P())


class TwoMLPs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first, self.second = ExplicitMLP(rngs), ExplicitMLP(rngs)

    def __call__(self, x):
        return self.second(self.first(x))


def model_tasks(sizes=(2, 2)) -> list[mm.Task]:
    start = np.cumsum((0, *sizes))
    return [
        mm.Task(
            f"t{i}", mesh=mm.TaskMesh(devices=range(start[i], start[i + 1]), axis_names=("model",))
        )
        for i in range(len(sizes))
    ]


def loss_fn(model, x):
    return (model(x) ** 2).mean()


def train_step(model, opt, x):
    loss, grads = mm.microbatch(nnx.value_and_grad(loss_fn), num=2, reduce="mean")(model, x)
    opt.update(model, grads)
    return loss


BATCH = jnp.arange(64.0).reshape(8, 8) / 64


def test_a_step_written_for_explicit_axes_pipelines_like_one_device():
    with nnx.use_eager_sharding(False):
        model, reference = TwoMLPs(nnx.Rngs(0)), TwoMLPs(nnx.Rngs(0))
    tasks = model_tasks()
    mm.place(model, [("^first/", tasks[0]), ("^second/", tasks[1])])
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    one_device = jax.make_mesh(
        (1,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1]
    )
    with jax.set_mesh(one_device):
        ref_opt = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    step, ref_step = mm.jit(train_step), nnx.jit(train_step)
    assert step.plan(model, opt, BATCH).pipeline is not None
    for _ in range(3):
        loss = step(model, opt, BATCH)
        with jax.set_mesh(one_device):
            close(loss, ref_step(reference, ref_opt, BATCH))
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference)), strict=True
    ):
        close(np.asarray(a), np.asarray(b))
    kernel = model.first.up.kernel.get_value()
    assert kernel.sharding == tasks[0].sharding(P(None, "model"))  # back on the task's mesh
    assert step.trace_count == 1  # the updated state plans as before


def test_explicit_axes_need_tasks_of_one_mesh_shape():
    with nnx.use_eager_sharding(False):
        model = TwoMLPs(nnx.Rngs(0))
    tasks = model_tasks((2, 4))
    mm.place(model, [("^first/", tasks[0]), ("^second/", tasks[1])])
    before = model.first.up.kernel.get_value()
    with pytest.raises(
        mm.MPMDError, match=r"explicit mesh axes.*'t0' \{'model': 2\}; 't1' \{'model': 4\}"
    ):
        mm.jit(loss_fn)(model, BATCH)
    assert model.first.up.kernel.get_value() is before


# Flax's miniGPT tutorial (google/flax docs_nnx/examples/minigpt.md), written for explicit axes:
# `out_sharding` metadata as PartitionSpecs, `out_sharding=jax.typeof(x).sharding` on the token
# embedding and `reshard` of the logits; sizes shrunk, dropout kept.


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs, rate=0.1):
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.mlp = nnx.Sequential(
            nnx.Linear(
                in_features=embed_dim,
                out_features=ff_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.relu,
            nnx.Linear(
                in_features=ff_dim,
                out_features=embed_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, *, rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x, out_sharding=jax.typeof(x).sharding)
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    def __init__(self, maxlen, vocab_size, embed_dim, num_heads, ff_dim, num_blocks, rngs):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[TransformerBlock(embed_dim, num_heads, ff_dim, rngs=rngs) for _ in range(num_blocks)]
        )
        self.output_layer = nnx.Linear(
            in_features=embed_dim,
            out_features=vocab_size,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return jax.sharding.reshard(self.output_layer(x), jax.typeof(inputs).sharding)


def minigpt_loss(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def minigpt_step(model, optimizer, metrics, batch):  # the tutorial's train_step
    grad_fn = nnx.value_and_grad(minigpt_loss, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, lables=batch[1])
    optimizer.update(model, grads)


def test_flax_minigpt_tutorial_trains_on_two_tasks_like_one_device():
    def create_model():
        return MiniGPT(16, 32, 16, 2, 16, 2, rngs=nnx.Rngs(0))

    tasks = [
        mm.Task(
            f"t{i}",
            mesh=mm.TaskMesh(
                devices=[2 * i, 2 * i + 1], axis_sizes=(1, 2), axis_names=("batch", "model")
            ),
        )
        for i in range(2)
    ]
    rules = [
        ("^embedding_layer/|^transformer_blocks/layers/0/", tasks[0]),
        ("^transformer_blocks/layers/1/|^output_layer/", tasks[1]),
    ]
    one_device = jax.make_mesh(
        (1, 1), ("batch", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:1]
    )
    with nnx.use_eager_sharding(False):
        model = mm.place(create_model(), rules)
    # SGD: the attention key bias has a zero gradient up to rounding, which Adam would magnify
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    with jax.set_mesh(one_device):
        reference = create_model()
        ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
        ref_metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    with jax.set_mesh(one_device):  # as the tutorial lays out its batch
        ref_batch = jax.device_put(batch, P("batch", None))
    step, ref_step = mm.jit(minigpt_step), nnx.jit(minigpt_step)
    for _ in range(3):
        step(model, optimizer, metrics, batch)
        with jax.set_mesh(one_device):
            ref_step(reference, ref_optimizer, ref_metrics, ref_batch)
    close(metrics.compute()["loss"], ref_metrics.compute()["loss"])
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(reference, nnx.Param)),
        strict=True,
    ):
        close(np.asarray(a), np.asarray(b))
