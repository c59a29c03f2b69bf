"""Model code of your own filled from a Hugging Face checkpoint with ``mmnnx.models.load_tensors``:
jax-ml/bonsai's Qwen3 (vendored in tests/outside/vendored/bonsai_qwen3_modeling.py, its
attention projections ``nnx.Einsum`` kernels of shape ``(D, N, H)`` / ``(N, H, D)``), built
abstractly and read straight onto two pipeline stages, against bonsai's own loader and model on
one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import TensorRule, load_tensors
from mmnnx.models.pretrained.files import CheckpointFiles
from tests.hf_checkpoints import write_checkpoint
from tests.outside import bonsai_qwen3, read_config
from tests.outside.vendored import bonsai_qwen3_modeling as modeling

TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


def bonsai_rules(cfg: modeling.ModelConfig) -> list[TensorRule]:
    """Which Qwen3 tensor fills which Variable of bonsai's ``Qwen3``: Linear weights ``(out, in)``
    transposed, the attention's ``(heads * head_dim, D)`` weights transposed and reshaped into
    the einsum kernels."""
    d, n, k, h = cfg.emb_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer, at = "model.layers.{layer}.", "layers/{layer}/"
    t = (1, 0)
    return [
        TensorRule("model.embed_tokens.weight", "embedder/embedding"),
        TensorRule(layer + "self_attn.q_proj.weight", at + "attn/q_proj/kernel", t, (d, n, h)),
        TensorRule(layer + "self_attn.k_proj.weight", at + "attn/k_proj/kernel", t, (d, k, h)),
        TensorRule(layer + "self_attn.v_proj.weight", at + "attn/v_proj/kernel", t, (d, k, h)),
        TensorRule(layer + "self_attn.o_proj.weight", at + "attn/o_proj/kernel", t, (n, h, d)),
        TensorRule(layer + "self_attn.q_norm.weight", at + "attn/q_norm/scale"),
        TensorRule(layer + "self_attn.k_norm.weight", at + "attn/k_norm/scale"),
        TensorRule(layer + "mlp.gate_proj.weight", at + "mlp/gate_proj/kernel", t),
        TensorRule(layer + "mlp.up_proj.weight", at + "mlp/up_proj/kernel", t),
        TensorRule(layer + "mlp.down_proj.weight", at + "mlp/down_proj/kernel", t),
        TensorRule(layer + "input_layernorm.weight", at + "input_layernorm/scale"),
        TensorRule(
            layer + "post_attention_layernorm.weight", at + "post_attention_layernorm/scale"
        ),
        TensorRule("model.norm.weight", "final_norm/scale"),
        TensorRule("lm_head.weight", "lm_head/kernel", t),
    ]


def bonsai_config(path) -> modeling.ModelConfig:
    hf = read_config(path, "Qwen3ForCausalLM")
    return modeling.ModelConfig(
        num_layers=hf["num_hidden_layers"],
        vocab_size=hf["vocab_size"],
        emb_dim=hf["hidden_size"],
        mlp_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=hf["rope_theta"],
        rope_scaling_factor=1.0,
        local_rope_theta=1e4,
        norm_eps=hf["rms_norm_eps"],
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    return write_checkpoint(path, architecture="Qwen3ForCausalLM")


def _tasks():
    return [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4))) for i in (0, 1)]


def test_bonsai_qwen3_on_two_stages_equals_bonsais_own_loader(checkpoint):
    cfg = bonsai_config(checkpoint)
    built = []

    def factory():  # notes whether it runs traced (abstractly) or computes arrays
        built.append(isinstance(jnp.zeros(()), jax.core.Tracer))
        return modeling.Qwen3(cfg, rngs=nnx.Rngs(params=0))

    tasks = _tasks()
    with nnx.use_eager_sharding(False):
        rules = mm.stage_rules(nnx.eval_shape(factory), tasks, blocks="layers", report=False)
    assert rules[0][0].startswith("^embedder/") and "^lm_head/" in rules[1][0]
    built.clear()
    model = load_tensors(factory, checkpoint, bonsai_rules(cfg), rules=rules)
    assert built == [True]  # built once, inside load_tensors, abstractly: never on one host

    q = model.layers[0].attn.q_proj.kernel
    assert mm.task_of(q).name == "s0" and mm.task_of(model.lm_head.kernel).name == "s1"
    raw = CheckpointFiles(checkpoint).read("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_array_equal(np.asarray(q[...]), raw.T.reshape(q.shape))

    cache = nnx.List(modeling.init_cache(cfg, *TOKENS.shape, generate_steps=0, dtype=jnp.float32))
    stage = [next(t for r, t in rules if re.search(r, f"layers/{i}/")) for i in range(len(cache))]
    cache = mm.place(cache, [(f"^{i}/", task) for i, task in enumerate(stage)])  # its layer's

    @mm.jit
    def logits_of(model, cache, tokens):
        return model(tokens, cache=cache, segment_ids=jnp.ones_like(tokens))

    logits = logits_of(model, cache, jnp.asarray(TOKENS))
    assert {d.id for d in logits.devices()} <= set(range(4, 8))  # the head's stage
    theirs = bonsai_qwen3.outside_logits(checkpoint, TOKENS)
    assert logits.shape == theirs.shape
    ours = np.asarray(logits, np.float64)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    assert int(cache[cfg.num_layers - 1].cur_ind[...]) == TOKENS.shape[1]  # written back
