"""Autoregressive decoding of a ``GPT`` with a key/value cache, each step a compiled program
(``nnx.jit`` on one device; ``mm.jit`` for a model placed on tasks)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmnnx._nnx import variables_of
from mmnnx.jit import jit as mm_jit
from mmnnx.modules import constrain
from mmnnx.modules.transformer import TransformerBlock
from mmnnx.sharding import home_of

ACTIVATIONS = (None, "seq", "embed")
"""The logical names of activations between blocks while decoding: the batch is not split."""

KV = tuple[jax.Array, jax.Array]
"""One block's cache: keys and values, each ``(batch, slots, num_kv_heads, head_dim)`` (with a
leading axis of the repetitions for a stacked segment's, a tuple of one per layer of a
``Period``; a ``LatentAttention``'s latent
``(batch, slots, 1, kv_lora_rank)`` and shared rotated key ``(..., 1, qk_rope_head_dim)``),
position ``p`` in slot ``p % slots`` (:func:`cache_slots`): a ring that a sliding-window layer
keeps at its window.

State per sequence and layer: ``2 * slots * num_kv_heads * head_dim * itemsize`` bytes, i.e.
``2 * num_kv_heads * head_dim * itemsize`` per position held. Before the ring every layer held
``max_seq_len`` positions; a sliding layer of window ``w`` now holds ``w - 1`` (the most that
any query sees of earlier steps). The Mistral fixture (2 KV heads of 8, float32: 128 bytes per
position and layer) at ``max_seq_len`` 32 and window 4: 4,096 bytes per layer before, 384
after; Gemma 3 27B's sliding layers (16 KV heads of 128, bfloat16, window 1,024) at 131,072
positions: 1 GiB per layer before, 8 MiB after."""


def cache_slots(block: TransformerBlock, length: int) -> int:
    """The positions ``block``'s cache holds: ``length`` (``max_seq_len``), or a sliding
    window ``w``'s ``w - 1`` (at least 1) where that is fewer.

    Example:
        >>> from mmnnx.modules import AttentionConfig, BlockConfig, MLPConfig
        >>> layer = BlockConfig(AttentionConfig(2, sliding_window=4), MLPConfig(16))
        >>> with nnx.use_eager_sharding(False):
        ...     block = TransformerBlock(8, layer, rngs=nnx.Rngs(0))
        >>> cache_slots(block, 32), cache_slots(block, 2)
        (3, 2)
    """
    window = getattr(block.attn, "sliding_window", None)  # a LatentAttention has none
    return length if window is None else min(max(window - 1, 1), length)


def _held(pos: jax.Array, slots: int) -> jax.Array:
    """The position in each slot before a step at ``pos``: the latest ``p < pos`` with
    ``p % slots == slot``; negative where no position was written there yet."""
    slot = jnp.arange(slots)
    return pos - 1 - jnp.mod(pos - 1 - slot, slots)


def _written(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """``cache`` with ``new`` (positions ``pos ..``) in their slots; only the last ``slots``
    of them where more come at once."""
    slots, count = cache.shape[-3], new.shape[-3]
    kept = min(count, slots)
    where = jnp.mod(pos + count - kept + jnp.arange(kept), slots)
    return cache.at[..., where, :, :].set(new[..., count - kept :, :, :].astype(cache.dtype))


def _block(
    block: TransformerBlock, x: jax.Array, cache: KV | None, pos: jax.Array, length: int
) -> tuple[jax.Array, KV]:
    """``block(x)`` (without dropout, as in evaluation) at positions ``pos ..``, its attention
    reading the earlier positions from ``cache`` and writing these into it."""
    x = constrain(x, ACTIVATIONS)
    positions = pos + jnp.arange(x.shape[-2])
    q, k, v = block.attn.project(block.norm1(x), positions)
    if cache is None:  # each its own shape: a LatentAttention's are its latent and shared key
        slots = cache_slots(block, length)
        cache = tuple(jnp.zeros((*a.shape[:-3], slots, *a.shape[-2:]), a.dtype) for a in (k, v))
    held = _held(pos, cache[0].shape[-3])
    keys = jnp.concatenate([cache[0], k.astype(cache[0].dtype)], axis=-3)
    values = jnp.concatenate([cache[1], v.astype(cache[1].dtype)], axis=-3)
    key_positions = jnp.concatenate([held, positions])
    visible = block.attn.visible(positions, key_positions) & (key_positions >= 0)
    x = x + block.attention_out(block.attn.attend(q, keys, values, visible))
    x = x + block.feed_forward(x)[0]
    return constrain(x, ACTIVATIONS), (_written(cache[0], k, pos), _written(cache[1], v, pos))


def _in_turn(items: Any, x: jax.Array, cache: Any, run: Any) -> tuple[jax.Array, tuple]:
    """``x`` through ``run(item, x, item_cache)`` for each of ``items`` in turn, and their new
    caches as a tuple (``cache`` ``None``: none yet)."""
    caches = [None] * len(items) if cache is None else cache
    new = []
    for item, item_cache in zip(items, caches, strict=True):
        x, item_cache = run(item, x, item_cache)
        new.append(item_cache)
    return x, tuple(new)


def _forward(model: Any, tokens: jax.Array, cache: Any, pos: jax.Array) -> tuple[jax.Array, Any]:
    """The last position's logits (float32) of ``tokens`` at ``pos ..``, and the new cache."""
    length = model.config.max_seq_len

    def layers(block: nnx.Module, x: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
        """:func:`_block` of a block, or of each layer of a ``GPT``'s ``Period`` (a cache each)."""
        if isinstance(block, TransformerBlock):
            return _block(block, x, cache, pos, length)
        return _in_turn(block.in_order(), x, cache, layers)

    def segment(item: tuple[nnx.Module, bool], x: jax.Array, cache: Any):
        module, stacked = item
        if not stacked:
            return layers(module, x, cache)
        scan = nnx.scan(
            lambda x, block, c: layers(block, x, c),
            in_axes=(nnx.Carry, 0, None if cache is None else 0),
            out_axes=(nnx.Carry, 0),
        )
        return scan(x, module, cache)

    x, cache = _in_turn(model.segments(), model.embed(tokens), cache, segment)
    x = model.norm(x[:, -1:])
    logits = model.embed.attend(x) if model.config.tie_embeddings else model.head(x)
    return logits[:, -1].astype(jnp.float32), cache


_ONE_DEVICE = nnx.jit(_forward)
_ON_TASKS = mm_jit(_forward)


def is_placed(model: Any) -> bool:
    """Whether ``mm.place``/``mm.init`` put any of ``model``'s Variables on a task.

    Example:
        >>> is_placed(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        False
    """
    return any(home_of(v) is not None for _, v in variables_of(model))


@functools.partial(jax.jit, static_argnames=("top_k",))
def _sample(logits: jax.Array, temperature: jax.Array, top_k: int | None, key: jax.Array):
    # the likeliest token's logit made 0 first: however small the temperature, the division
    # sends the others to -inf at worst, never a logit to +inf (where every draw is a tie)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: Any,
    prompt: jax.Array,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    rng: jax.Array | None = None,
    stop: Sequence[int] = (),
) -> jax.Array:
    """``GPT.generate``, a key/value cache per block (``max_seq_len`` positions, a sliding
    layer's window: :data:`KV`) filled by a prefill; ``temperature`` below float32's smallest
    normal number (1.2e-38) is greedy. With ``stop`` ids, each new token is read back to the
    host and decoding ends at the step where every row has generated one of them (that step's
    tokens the last column): the tokens up to it are those of a run without ``stop``.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=2, vocab_size=64), rngs=nnx.Rngs(0))
        >>> new = generate(model, jnp.array([1, 2, 3]), 4)
        >>> new.shape
        (1, 4)
        >>> generate(model, jnp.array([1, 2, 3]), 4, stop=[int(new[0, 0])]).shape  # its first
        (1, 1)
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim == 1:
        prompt = prompt[None]
    limit = model.config.max_seq_len
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"generate: the prompt must be a non-empty (batch, seq): {prompt.shape}")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"generate: a prompt of {prompt.shape[1]} tokens plus max_new_tokens "
            f"{max_new_tokens} exceeds the model's max_seq_len {limit}"
        )
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"generate: temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"generate: top_k must be >= 1, got {top_k}")
    forward = _ON_TASKS if is_placed(model) else _ONE_DEVICE
    key = jax.random.key(0) if rng is None else rng
    greedy = temperature < np.finfo(np.float32).tiny  # 0 in float32, or flushed to 0 on device
    logits, cache = forward(model, prompt, None, jnp.zeros((), jnp.int32))
    tokens = []
    stopped = np.zeros(prompt.shape[0], bool)
    for i in range(max_new_tokens):
        if greedy:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            key, draw = jax.random.split(key)
            token = _sample(logits, jnp.float32(temperature), top_k, draw)
        tokens.append(token)
        if len(stop):  # a host sync per step, only where asked
            stopped |= np.isin(np.asarray(jax.device_get(token)), stop)
            if stopped.all():
                break
        if i + 1 < max_new_tokens:
            pos = jnp.asarray(prompt.shape[1] + i, jnp.int32)
            logits, cache = forward(model, token[:, None], cache, pos)
    return jnp.stack([jax.device_get(t) for t in tokens], axis=1)
