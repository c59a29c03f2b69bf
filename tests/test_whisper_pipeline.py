"""bonsai's Whisper (tests/bonsai_whisper.py, copied from jax-ml/bonsai) pipelined as written:
its encoder and decoder layers placed over 2 and 4 tasks, every decoder layer attending over
the encoder's output, trained under 1F1B and ZB-H1 equal to one device."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests import bonsai_whisper as whisper
from tests.models import four_tasks, loss_and_grads_steps
from tests.oracle import close, params_close, trees_close

LR, SOURCE = 3e-3, 6  # learning rate, encoder positions

CONFIG = dataclasses.replace(
    whisper.ModelConfig.whisper_tiny(),
    d_model=16,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    encoder_layers=2,
    decoder_layers=2,
    num_mel_bins=8,
    max_source_positions=SOURCE,
    max_length=8,
    vocab_size=32,
)


def make_whisper() -> whisper.Whisper:
    return whisper.Whisper(CONFIG, rngs=nnx.Rngs(0))


def loss_fn(model, features, tokens):
    """Next-token cross-entropy; the output projection is the token embedding's transpose, as
    Whisper ties them."""
    encoded = model.encoder(features)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    hidden = model.decoder(inputs, nnx.make_causal_mask(inputs), encoded, None, decode=False)
    logits = model.decoder.embed_tokens.attend(hidden)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# (placement rules, the stage chain, microbatches): on 4 tasks the output projection, tied to
# the decoder's token embedding on t2, brings the forward pass back to t2 (docs/pipelining.md,
# "A head tied to the embedding"), so 1F1B needs 5 microbatches there
TASKS = four_tasks()
LAYOUTS = {
    2: ([("^encoder/", TASKS[0]), ("^decoder/", TASKS[1])], ["t0", "t1"], 4),
    4: (
        [
            ("^encoder/(layers/1|layer_norm)/", TASKS[1]),
            ("^encoder/", TASKS[0]),
            ("^decoder/(layers/1|layer_norm)/", TASKS[3]),
            ("^decoder/", TASKS[2]),
        ],
        ["t0", "t1", "t2", "t3", "t2"],
        5,
    ),
}


def key_biases_as_noise(grads):
    """``grads`` with each attention key bias's gradient marked as rounding noise for
    ``params_close`` (held to ``steps`` x ``lr``): a softmax ignores a shift of its scores, so
    that gradient is zero up to rounding, and Adam turns rounding into a full step."""

    def mark(path, g):
        name = jax.tree_util.keystr(path)
        return jnp.full_like(g, 1e-30) if "['key']['bias']" in name else g

    return jax.tree.map_with_path(mark, grads)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
@pytest.mark.parametrize("num_tasks", [2, 4])
def test_whisper_trains_pipelined_as_placed_and_matches_one_device(num_tasks, schedule):
    rules, chain, num = LAYOUTS[num_tasks]
    model, ref = mm.place(make_whisper(), rules), make_whisper()
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)
    batch = 2 * num
    features = jax.random.normal(jax.random.key(0), (batch, 2 * SOURCE, CONFIG.num_mel_bins))
    tokens = jax.random.randint(jax.random.key(1), (batch, 5), 0, CONFIG.vocab_size)
    pipelined_step, reference_step = loss_and_grads_steps(loss_fn, schedule, num)
    step = mm.jit(pipelined_step)

    plan = step.plan(model, opt, features, tokens)
    assert [t.name for t in plan.pipeline.stage_tasks] == chain
    first_grads = None
    for _ in range(2):
        (loss, grads), (ref_loss, ref_grads) = (
            step(model, opt, features, tokens),
            reference_step(ref, ref_opt, features, tokens),
        )
        close(loss, ref_loss)
        trees_close(grads, ref_grads)
        first_grads = ref_grads if first_grads is None else first_grads
    params_close(model, ref, key_biases_as_noise(first_grads), steps=2, lr=LR)
