"""Sliding-window attention (``AttentionConfig.sliding_window``): a query at position ``i`` sees
keys ``j`` with ``i - w < j <= i`` (transformers' convention), in the plain causal path, within
each example of a packed row, and in the key/value-cache decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmnnx.models import GPT, GPTConfig
from mmnnx.models.decoding import _ONE_DEVICE
from mmnnx.modules import Attention, AttentionConfig, BlockConfig, MLPConfig, Packing

WINDOW = 3


def _dense_window(seq: int, window: int) -> np.ndarray:
    return np.array([[i - window < j <= i for j in range(seq)] for i in range(seq)])


def _model(scan_layers: bool = False) -> GPT:
    block = BlockConfig(AttentionConfig(4, num_kv_heads=2, sliding_window=WINDOW), MLPConfig(64))
    config = GPTConfig(
        vocab_size=64, dim=32, depth=2, num_heads=4, num_kv_heads=2, max_seq_len=16,
        layers=(block, block), scan_layers=scan_layers,
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_sliding_window_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="AttentionConfig.sliding_window must be None or an int"):
        AttentionConfig(4, sliding_window=bad)


def test_attention_matches_a_dense_window_mask():
    seq = 10
    with nnx.use_eager_sharding(False):
        windowed = Attention(16, AttentionConfig(4, sliding_window=WINDOW), rngs=nnx.Rngs(0))
        plain = Attention(16, AttentionConfig(4), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, seq, 16))
    positions = jnp.arange(seq)
    np.testing.assert_array_equal(windowed.visible(positions, positions), _dense_window(seq, 3))
    reference = plain.attend(*plain.project(x), jnp.asarray(_dense_window(seq, WINDOW)))
    np.testing.assert_allclose(windowed(x), reference, rtol=1e-6, atol=1e-6)
    # a window as long as the sequence is plain causal attention; a shorter one is not
    with nnx.use_eager_sharding(False):
        whole = Attention(16, AttentionConfig(4, sliding_window=seq), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(whole(x), plain(x), rtol=1e-6, atol=1e-6)
    assert not np.allclose(windowed(x), plain(x), atol=1e-3)


def test_packed_examples_see_their_own_window():
    """Two examples in one row give the logits each gives alone: the window counts positions
    within its example."""
    model = _model()
    first, second = jnp.arange(1, 8), jnp.arange(20, 29)
    row = jnp.concatenate([first, second])[None]
    segments = jnp.concatenate([jnp.ones(7, int), jnp.full(9, 2)])[None]
    positions = jnp.concatenate([jnp.arange(7), jnp.arange(9)])[None]
    # jitted: eager, each operation compiled on its own took seconds
    forward = nnx.jit(lambda model, tokens, packing=None: model(tokens, packing))
    packed = forward(model, row, Packing(segments, positions))[0]
    np.testing.assert_allclose(packed[:7], forward(model, first[None])[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[7:], forward(model, second[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_decoding_token_by_token_equals_the_full_forward(scan_layers):
    model = _model(scan_layers)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, 64)
    full = model(tokens)
    logits, cache = _ONE_DEVICE(model, tokens[:, :2], None, jnp.zeros((), jnp.int32))
    np.testing.assert_allclose(logits, full[:, 1], rtol=1e-5, atol=1e-5)
    keys = jax.tree.leaves(cache)[0]  # a ring of the window's w - 1 earlier positions
    assert keys.shape[-3] == WINDOW - 1 and len(jax.tree.leaves(cache)) == 4 - 2 * scan_layers
    for t in range(2, tokens.shape[1]):  # past the window: the ring's slots are overwritten
        logits, cache = _ONE_DEVICE(model, tokens[:, t : t + 1], cache, jnp.asarray(t, jnp.int32))
        np.testing.assert_allclose(logits, full[:, t], rtol=1e-5, atol=1e-5)
    generated = model.generate(tokens[:, :4], 6)  # greedy: each token the argmax after its past
    chosen = jnp.argmax(model(jnp.concatenate([tokens[:, :4], generated], axis=1)), axis=-1)
    np.testing.assert_array_equal(generated, chosen[:, 3:9])
