"""The reference GPT: shapes, the loss against a hand-written cross-entropy, tying, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmnnx.models import GPT, GPTConfig
from mmnnx.modules import Embed, LayerNorm, Linear, RMSNorm, TransformerBlock

SMALL = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=4, max_seq_len=16)


def make(config=SMALL, seed=0):
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(seed))


@nnx.jit
def logits_of(model, tokens):
    return model(tokens)


@nnx.jit
def loss_of(model, batch):
    return model.loss(batch)


def num_params(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_defaults_are_byte_level():
    c = GPTConfig()
    assert (c.vocab_size, c.dim, c.depth, c.num_heads, c.max_seq_len) == (256, 128, 4, 4, 128)
    assert (c.num_kv_heads, c.mlp_ratio, c.gated_mlp, c.tie_embeddings, c.norm) == (
        None,
        4,
        False,
        False,
        "rms",
    )


def test_structure_and_shapes():
    model = make()
    assert isinstance(model.embed, Embed) and isinstance(model.head, Linear)
    assert isinstance(model.blocks, nnx.List) and len(model.blocks) == 2
    assert all(isinstance(b, TransformerBlock) for b in model.blocks)
    assert isinstance(model.norm, RMSNorm)
    assert model.head.kernel.get_metadata()["out_sharding"] == ("embed", "vocab")
    tokens = jax.random.randint(jax.random.key(0), (3, 10), 0, 64)
    assert logits_of(model, tokens).shape == (3, 10, 64)
    assert loss_of(model, jnp.concatenate([tokens, tokens[:, :1]], axis=1)).shape == ()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))


def test_loss_is_next_token_cross_entropy():
    model = make()
    batch = jax.random.randint(jax.random.key(1), (3, 9), 0, 64)
    logits = np.asarray(logits_of(model, batch[:, :-1]), dtype=np.float64)
    targets = np.asarray(batch[:, 1:])
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    b, t = targets.shape
    nll = [-logp[i, j, targets[i, j]] for i in range(b) for j in range(t)]
    np.testing.assert_allclose(float(loss_of(model, batch)), np.mean(nll), rtol=1e-5)


def test_tied_embeddings():
    tied = make(dataclasses.replace(SMALL, tie_embeddings=True))
    assert not hasattr(tied, "head")
    assert num_params(make()) - num_params(tied) == 32 * 64
    tokens = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)

    @nnx.jit
    def hidden(model, tokens):
        h = model.embed(tokens)
        for block in model.blocks:
            h = block(h)
        return model.norm(h)

    expected = np.asarray(hidden(tied, tokens)) @ np.asarray(tied.embed.embedding.get_value()).T
    np.testing.assert_allclose(np.asarray(logits_of(tied, tokens)), expected, rtol=1e-5, atol=1e-5)
    # the gradient of the tied table collects both uses
    batch = jnp.concatenate([tokens, tokens[:, :1]], 1)
    grads = nnx.jit(nnx.grad(lambda m: m.loss(batch)))(tied)
    assert float(jnp.abs(grads["embed"]["embedding"][...]).sum()) > 0


@pytest.mark.parametrize(
    "changes",
    [dict(num_kv_heads=1), dict(gated_mlp=True, mlp_ratio=2), dict(norm="layer")],
    ids=["mqa", "gated", "layernorm"],
)
def test_variants(changes):
    model = make(dataclasses.replace(SMALL, **changes))
    assert logits_of(model, jnp.zeros((1, 5), jnp.int32)).shape == (1, 5, 64)
    if "norm" in changes:
        assert isinstance(model.norm, LayerNorm)
        assert isinstance(model.blocks[0].norm1, LayerNorm)
    if "num_kv_heads" in changes:
        assert model.blocks[0].attn.k.kernel.shape == (32, 8)
    if "gated_mlp" in changes:
        assert model.blocks[0].mlp.gate is not None and model.blocks[0].mlp.hidden == 64


@pytest.mark.parametrize("tx", [optax.adam(1e-2), optax.sgd(0.5)], ids=["adam", "sgd"])
def test_training_on_repeated_text_reduces_loss(tx):
    text = np.frombuffer(b"hello world, hello mmnnx! " * 8, dtype=np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text) - 17, size=(12, 8))
    batches = [jnp.asarray(np.stack([text[s : s + 17] for s in row])) for row in starts]
    model = make(GPTConfig(vocab_size=256, dim=32, depth=2, num_heads=2, max_seq_len=16))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, batch)) for batch in batches]
    assert float(loss_of(model, batches[0])) < 0.8 * losses[0], losses
