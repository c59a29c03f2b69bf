"""Encoder-decoder pipelines: a value several later stages read (the encoder's output, which
every cross-attention decoder layer attends over) is a side input of each, and the stage chain
follows the placement. Every result is checked against the same model on one device."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import four_tasks, loss_and_grads_steps
from tests.oracle import close, params_close, trees_close

DIM, M, LR = 16, 4, 3e-3


class Encoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(DIM, DIM, rngs=rngs)
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)

    def __call__(self, x):
        return self.norm(jax.nn.gelu(self.proj(x)))


def _linear_attention(query, key, value, **_):
    """Attention weights without the softmax: the product of queries and keys, averaged over
    the keys."""
    weights = jnp.einsum("bthd,bshd->bhts", query, key) / key.shape[1]
    return jnp.einsum("bhts,bshd->bthd", weights, value)


class CrossAttentionLayer(nnx.Module):
    """A decoder layer as Whisper's cross-attention block writes it: pre-norm, queries from the
    decoder, keys and values from the encoder's output, then an MLP."""

    def __init__(self, rngs: nnx.Rngs, softmax: bool):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2,
            in_features=DIM,
            decode=False,
            use_bias=False,  # a key bias's gradient is zero (the softmax ignores a shift)
            attention_fn=nnx.dot_product_attention if softmax else _linear_attention,
            rngs=rngs,
        )
        self.mlp_norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, h, encoded):
        h = h + self.attn(self.norm(h), encoded, encoded)
        return h + self.mlp(self.mlp_norm(h))


class DirectCrossAttentionLayer(nnx.Module):
    """A decoder layer whose attention reads the encoder's output directly as its values (no
    value projection) and, with ``keys``, as its keys too: one head, a query projection of the
    decoder's state, an output projection, then an MLP."""

    def __init__(self, rngs: nnx.Rngs, keys: bool):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.query = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.key = None if keys else nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, h, encoded):
        key = encoded if self.key is None else self.key(encoded)
        scores = jnp.einsum("btd,bsd->bts", self.query(self.norm(h)), key) / DIM**0.5
        h = h + self.out(jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), encoded))
        return h + self.mlp(self.mlp_norm(h))


class EncoderDecoder(nnx.Module):
    """An encoder and two cross-attention decoder layers; with ``embed``, the decoder reads
    token ids through an embedding, else vectors; with ``direct`` (``"values"`` or
    ``"keys"``), its layers attend over the encoder's output read directly
    (:class:`DirectCrossAttentionLayer`)."""

    def __init__(self, *, softmax: bool = True, embed: bool = False, direct: str | None = None):
        rngs = nnx.Rngs(0)
        self.encoder = Encoder(rngs)
        self.embed = nnx.Embed(32, DIM, rngs=rngs) if embed else None
        if direct is None:
            layers = [CrossAttentionLayer(rngs, softmax) for _ in range(2)]
        else:
            layers = [DirectCrossAttentionLayer(rngs, keys=direct == "keys") for _ in range(2)]
        self.decoder = nnx.List(layers)

    def __call__(self, x, y):
        encoded = self.encoder(x)
        h = self.embed(y) if self.embed is not None else y
        for layer in self.decoder:
            h = layer(h, encoded)
        return h


def loss_fn(model, x, y):
    return jnp.mean(model(x, y) ** 2)


VARIANTS = {
    "softmax": ({}, []),
    "linear": ({"softmax": False}, []),
    "embedding-on-t1": ({"embed": True}, [("embed", 1)]),
    # layer 1's cross-attention key projection of the encoder output runs on layer 0's task
    "layer1-key-on-t1": ({}, [("decoder/1/attn/key", 1)]),
    # the encoder's output read directly as values, then as keys too: counted in bytes alone,
    # each layer's attention would run on the encoder's task, after the layer's query
    "values-direct": ({"direct": "values"}, []),
    "keys-and-values-direct": ({"direct": "keys"}, []),
}
CASES = [
    (variant, schedule)
    for variant in VARIANTS
    for schedule in ("1f1b", "zero-bubble-h1")
    if (variant, schedule) != ("values-direct", "zero-bubble-h1")  # the next variant's case
]


@pytest.mark.parametrize(("variant", "schedule"), CASES)
def test_cross_attention_pipelines_as_placed_and_matches_one_device(variant, schedule):
    kwargs, extra_rules = VARIANTS[variant]
    tasks = four_tasks()[:3]
    rules = [(path, tasks[i]) for path, i in extra_rules]
    rules += [("encoder", tasks[0]), ("decoder/0", tasks[1]), ("decoder/1", tasks[2])]
    model = mm.place(EncoderDecoder(**kwargs), rules)
    ref = EncoderDecoder(**kwargs)
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (8, 5, DIM))
    if kwargs.get("embed"):
        y = jax.random.randint(jax.random.key(1), (8, 3), 0, 32)
    else:
        y = jax.random.normal(jax.random.key(1), (8, 3, DIM))
    pipelined_step, reference_step = loss_and_grads_steps(loss_fn, schedule, M)
    step = mm.jit(pipelined_step)

    plan = step.plan(model, opt, x, y)
    assert [t.name for t in plan.pipeline.stage_tasks] == ["t0", "t1", "t2"]
    # the encoder's output goes from t0 straight to each decoder layer's task
    encoded = [tr for tr in plan.transfers if tr.source is not None and tr.source.name == "t0"]
    assert {tr.target.name for tr in encoded} == {"t1", "t2"}
    first_grads = None
    for _ in range(2):
        (loss, grads), (ref_loss, ref_grads) = (
            step(model, opt, x, y),
            reference_step(ref, ref_opt, x, y),
        )
        close(loss, ref_loss)
        trees_close(grads, ref_grads)
        first_grads = ref_grads if first_grads is None else first_grads
    params_close(model, ref, first_grads, steps=2, lr=LR)
