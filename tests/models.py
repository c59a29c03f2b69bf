"""Small NNX models shared by the tests."""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig

INIT = nnx.initializers.lecun_normal()


class TwoStageMLP(nnx.Module):
    """Two Linear pairs with logical names; BatchNorm and Dropout for mixed state."""

    def __init__(self, dim: int = 16, hidden: int = 32, *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                nnx.Linear(
                    dim,
                    hidden,
                    rngs=rngs,
                    kernel_init=nnx.with_partitioning(INIT, ("embed", "mlp")),
                ),
                nnx.Linear(
                    hidden,
                    dim,
                    rngs=rngs,
                    kernel_init=nnx.with_partitioning(INIT, ("mlp", "embed")),
                ),
            ]
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.norm = nnx.BatchNorm(dim, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.layers[0](x))
        return self.norm(self.drop(self.layers[1](h)))


def make_mlp(seed: int = 0) -> TwoStageMLP:
    with nnx.use_eager_sharding(False):
        return TwoStageMLP(rngs=nnx.Rngs(seed))


def tensor_parallel_mlp(depth: int, dim: int, hidden: int) -> nnx.Sequential:
    """``depth`` Linear layers (at ``layers/0``, ``layers/2``, ...), tanh between them,
    alternating ``dim -> hidden`` named ("embed", "mlp") and ``hidden -> dim`` named ("mlp",
    "embed"); layer ``i`` drawn from ``nnx.Rngs(i)``."""
    layers = []
    for i in range(depth):
        names, shape = (
            (("embed", "mlp"), (dim, hidden)) if i % 2 == 0 else (("mlp", "embed"), (hidden, dim))
        )
        layers += [nnx.Linear(*shape, kernel_init=_tp(names), rngs=nnx.Rngs(i)), nnx.tanh]
    return nnx.Sequential(*layers[:-1])


def _tp(names):
    return nnx.with_partitioning(INIT, names)


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, tensor-parallel names."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.qkv = nnx.Linear(
            dim, 3 * dim, use_bias=False, kernel_init=_tp(("embed", "heads")), rngs=rngs
        )
        self.out = nnx.Linear(
            dim, dim, use_bias=False, kernel_init=_tp(("heads", "embed")), rngs=rngs
        )
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, kernel_init=_tp(("embed", "mlp")), rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, kernel_init=_tp(("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jax.numpy.split(self.qkv(self.norm1(x)), 3, axis=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (a.reshape(shape) for a in (q, k, v))
        mask = nnx.make_causal_mask(jax.numpy.ones((b, t)))
        attn = nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d)
        x = x + self.out(attn)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyGPT(nnx.Module):
    """Embedding, four blocks, final norm and an untied head."""

    def __init__(
        self, vocab: int = 32, dim: int = 16, heads: int = 2, depth: int = 4, *, rngs: nnx.Rngs
    ):
        self.embed = nnx.Embed(vocab, dim, embedding_init=_tp(("vocab", "embed")), rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(
            dim, vocab, use_bias=False, kernel_init=_tp(("embed", "vocab")), rngs=rngs
        )

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        labels = tokens[:, 1:]
        logp = jax.nn.log_softmax(logits)
        return -jax.numpy.mean(jax.numpy.take_along_axis(logp, labels[..., None], axis=-1))


def make_gpt(seed: int = 0) -> TinyGPT:
    with nnx.use_eager_sharding(False):
        return TinyGPT(rngs=nnx.Rngs(seed))


GPT_RULES = mm.logical_rules(mlp="model", heads="model", vocab="model", embed=None)


def one_device_tasks(n: int) -> list[mm.Task]:
    """Tasks d0..d{n-1}, each on one device (device i)."""
    return [mm.Task(f"d{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(n)]


def four_tasks() -> list[mm.Task]:
    """Tasks t0..t3 of two devices each, tensor-parallel ("model") inside each."""
    return [
        mm.Task(
            f"t{i}",
            mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1], axis_names=("model",)),
            logical_axes=GPT_RULES,
        )
        for i in range(4)
    ]


def four_stage_rules(tasks: list[mm.Task]) -> list[tuple[str, mm.Task]]:
    """A 4-block ``TinyGPT`` as four stages: embedding with block 0, head with block 3."""
    t0, t1, t2, t3 = tasks
    return [
        ("embed|blocks/0/", t0),
        ("blocks/1/", t1),
        ("blocks/2/", t2),
        ("blocks/3/|norm|head", t3),
    ]


def tiny_gpt(depth: int = 4) -> "TinyGPT":
    """A ``TinyGPT`` of ``depth`` blocks with its logical names kept (nothing placed yet)."""
    with nnx.use_eager_sharding(False):
        return TinyGPT(depth=depth, rngs=nnx.Rngs(0))


def placed_gpt(tasks: list[mm.Task], depth: int = 4) -> "TinyGPT":
    """``tiny_gpt(depth)`` on the four tasks: four stages for depth 4, else block ``i`` on task
    ``i % 4`` (each task holds several non-adjacent stages)."""
    if depth == 4:
        rules = four_stage_rules(tasks)
    else:
        rules = [(f"blocks/{i}/", tasks[i % 4]) for i in range(depth)]
        rules += [("^embed/", tasks[0]), ("^norm/|^head/", tasks[3])]
    return mm.place(tiny_gpt(depth), rules)


SMALL_GPT = GPTConfig(vocab_size=64, dim=32, depth=4, num_heads=2, max_seq_len=16)


def small_gpt() -> GPT:
    """The library's GPT at ``SMALL_GPT`` (4 blocks of dim 32), seed 0, unplaced."""
    with nnx.use_eager_sharding(False):
        return GPT(SMALL_GPT, rngs=nnx.Rngs(0))


def full_batch_step(model, opt, tokens):
    """One full-batch train step of a model with a ``loss(tokens)`` method."""
    loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
    opt.update(model, grads)
    return loss


reference_step = nnx.jit(full_batch_step)
"""The oracle: :func:`full_batch_step` on one device under ``nnx.jit`` (run op by op, the
small GPT's first step compiled each op apart: 5.9 s, then 0.55 s a step; jitted, 2.0 s once,
then 0.01 s)."""

reference_loss_and_grads = nnx.jit(nnx.value_and_grad(lambda m, t: m.loss(t)))
"""The loss and gradients of a model with a ``loss(tokens)`` method, on one device under
``nnx.jit``: ``reference_loss_and_grads(model, tokens)``."""


def mse(model, x, y):
    """Mean squared error of ``model(x)`` against ``y``."""
    return jnp.mean((model(x) - y) ** 2)


def train_step(model, opt, x, y):
    """One full-batch train step on :func:`mse` (the oracle of the MLP tests)."""
    loss, grads = nnx.value_and_grad(mse)(model, x, y)
    opt.update(model, grads)
    return loss


def microbatched_train_step(schedule: str = "1f1b", num: int = 4):
    """:func:`train_step` over ``num`` microbatches of ``x`` and ``y`` under ``schedule``, mean
    loss."""

    def step(model, opt, x, y):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(mse), num=num, argnums=(1, 2), reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss

    return step


def loss_and_grads_steps(loss_fn, schedule: str, num: int):
    """A train step of ``loss_fn(model, x, y)`` over ``num`` microbatches of ``x`` and ``y``
    under ``schedule`` (to run with ``mm.jit``), and its full-batch reference under
    ``nnx.jit``; both update the optimizer and return ``(loss, grads)``."""

    def pipelined(model, opt, x, y):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn), num=num, argnums=(1, 2), reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss, grads

    return pipelined, _reference_step(loss_fn)


@functools.cache  # one nnx.jit per loss: its compiled steps are shared by every schedule
def _reference_step(loss_fn):
    @nnx.jit
    def reference(model, opt, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        opt.update(model, grads)
        return loss, grads

    return reference


def gpt_step(schedule: str):
    """A train step of a model with a ``loss(tokens)`` method: 4 microbatches under
    ``schedule``, mean loss, the optimizer updated."""

    def step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)), num=4, reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    return step


def _layers(weights, chunk):
    for w in weights:  # a matrix: a matmul layer; a vector: an elementwise one
        chunk = jnp.tanh((chunk @ w if w.ndim == 2 else chunk * w) + 0.1)
    return chunk


def _by_chunks(a):
    return a.reshape(-1, 2, a.shape[-1])


@jax.custom_vjp
def chunked_layers(weights, h):
    """``benchmarks/pipeline.py``'s stage: ``tanh`` layers over chunks of 2 rows in a scan, with
    a custom backward that recomputes each chunk and sums the weight gradients in the carry."""
    return jax.lax.scan(lambda c, x: (c, _layers(weights, x)), None, _by_chunks(h))[1].reshape(
        h.shape
    )


def _chunked_fwd(weights, h):
    return chunked_layers(weights, h), (weights, h)


def _chunked_bwd(residuals, grad):
    weights, h = residuals

    def chunk_vjp(grad_weights, chunk_and_grad):
        chunk, chunk_grad = chunk_and_grad
        d_weights, d_chunk = jax.vjp(_layers, weights, chunk)[1](chunk_grad)
        return jax.tree.map(jnp.add, grad_weights, d_weights), d_chunk

    zeros = jax.tree.map(jnp.zeros_like, weights)
    d_weights, d_h = jax.lax.scan(chunk_vjp, zeros, (_by_chunks(h), _by_chunks(grad)))
    return d_weights, d_h.reshape(h.shape)


chunked_layers.defvjp(_chunked_fwd, _chunked_bwd)
