"""Saves models of every combination of components as every family, by hand (about a minute;
not part of the suite): each save must be refused with ``CheckpointError`` before anything is
written, or load back with the same logits. Prints what breaks that rule.

Run: python -m tests.save_probe
"""

import dataclasses
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmnnx.models import GPT, GPTConfig, from_pretrained, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained.families import FAMILIES
from mmnnx.modules import (
    AttentionConfig,
    BlockConfig,
    ClampedMoEConfig,
    DeepSeekMoEConfig,
    LatentAttentionConfig,
    MLPConfig,
    MoEConfig,
    NormConfig,
    RopeConfig,
)
from mmnnx.modules.rope import LinearScaling, RopeScaling, YarnScaling

A = AttentionConfig(2, num_kv_heads=1, head_dim=16)
ATTENTIONS = {
    "gqa": A,
    "qk norms": dataclasses.replace(A, qk_norm=True),
    "qk norms of another eps": dataclasses.replace(A, qk_norm=True, qk_norm_eps=1e-5),
    "sliding": dataclasses.replace(A, sliding_window=4),
    "sinks and biases": dataclasses.replace(A, sinks=True, bias=True),
    "gemma": dataclasses.replace(A, qk_norm=True, qk_norm_offset=1.0, query_pre_attn_scalar=16.0),
    "latent": LatentAttentionConfig(
        2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8
    ),
    "no rope": dataclasses.replace(A, rope=None),
    "llama3 rope": dataclasses.replace(A, rope=RopeConfig(5e5, RopeScaling(8.0, 1.0, 4.0, 8))),
    "linear rope": dataclasses.replace(A, rope=RopeConfig(1e4, LinearScaling(2.0))),
    "yarn rope": dataclasses.replace(A, rope=RopeConfig(1e4, YarnScaling(4.0, 8))),
    "wide heads": AttentionConfig(2, num_kv_heads=2, head_dim=24),
}
FEED_FORWARDS = {
    "gated": MLPConfig(64, gated=True, bias=False),
    "gelu gated": MLPConfig(64, gated=True, bias=False, activation="gelu_pytorch_tanh"),
    "moe": MoEConfig(32, 4, top_k=2),
    "moe unnormalised": MoEConfig(32, 4, top_k=2, norm_topk_prob=False),
    "clamped": ClampedMoEConfig(32, 4, top_k=2),
    "deepseek": DeepSeekMoEConfig(32, 4, top_k=2, shared_hidden=32),
}
NORMS = {"rms": NormConfig(), "gemma": NormConfig(scale_offset=1.0)}
MODEL = {  # model-level variants, over the plain layers only
    "": {},
    "+scaled": {"embed_scale": 32**0.5},
    "+gemma output norm": {"final_norm": NormConfig(scale_offset=1.0)},
    "+tied": {"tie_embeddings": True},
}


def models():
    for (an, a), (fn, f), (nn_, n) in (
        (x, y, z) for x in ATTENTIONS.items() for y in FEED_FORWARDS.items() for z in NORMS.items()
    ):
        for post in (False, True):
            for mn, extra in MODEL.items():
                if (post or mn) and (fn not in ("gated", "deepseek") or nn_ != "rms"):
                    continue
                layer = BlockConfig(a, f, n, post_norms=post)
                kv = getattr(a, "num_kv_heads", None) or 2
                config = GPTConfig(dim=32, depth=2, num_heads=2, num_kv_heads=kv, vocab_size=64,
                                   layers=(layer, layer), max_seq_len=16, **extra)  # fmt: skip
                yield f"{an}/{fn}/{nn_}{'+post' if post else ''}{mn}", config


def main() -> None:
    tokens = jnp.arange(12)[None] % 64
    problems, count = [], 0
    for name, config in models():
        with nnx.use_eager_sharding(False):
            model = GPT(config, rngs=nnx.Rngs(0))
        logits, count = np.asarray(model(tokens)), count + 1
        for arch in FAMILIES:
            root = tempfile.mkdtemp()
            what = f"{name} as {arch}"
            try:
                out = save_pretrained(model, os.path.join(root, "m"), architecture=arch)
            except CheckpointError:
                if os.listdir(root):
                    problems.append(f"{what}: refused, but wrote {os.listdir(root)}")
                continue
            except Exception as e:  # noqa: BLE001
                problems.append(f"{what}: {type(e).__name__}: {e}")
                continue
            error = np.abs(np.asarray(from_pretrained(out)(tokens)) - logits).max()
            if not error < 1e-4:
                problems.append(f"{what}: loads back with logits off by {error:.3g}")
    print(f"{count} models x {len(FAMILIES)} families: {len(problems)} problems")
    print("\n".join(problems))


if __name__ == "__main__":
    main()
