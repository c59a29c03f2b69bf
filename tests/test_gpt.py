"""The reference GPT: shapes, the loss against a hand-written cross-entropy, tying, training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmnnx.models import GPT, GPTConfig
from mmnnx.models.stages import _attention_dims
from mmnnx.modules import (
    Embed,
    LayerNorm,
    Linear,
    RMSNorm,
    RopeConfig,
    RopeScaling,
    TransformerBlock,
)

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


# ------------------------------------------------------------------ Llama 3.x / Qwen3 knobs
# A float64 NumPy decoder written from Hugging Face's LlamaForCausalLM / Qwen3ForCausalLM
# (modeling_llama.py, modeling_qwen3.py, modeling_rope_utils.py), reading weights by their
# Hugging Face names in their (out, in) layout.

LLAMA3 = RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=16.0, original_max_position_embeddings=256
)  # with head_dim 16 and theta 1e6: wavelengths 6.3 (kept), 35 and 199 (smoothed), 1117.. (/4)
KNOBS = GPTConfig(
    vocab_size=64,
    dim=32,
    depth=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,  # 4 * 16 != 32
    qk_norm=True,
    rope_theta=1e6,
    rope_scaling=LLAMA3,
    norm_eps=1e-5,
    mlp_hidden=48,
    mlp_bias=False,
    gated_mlp=True,
    max_seq_len=16,
)


def hf_config(c):
    return {
        "hidden_size": c.dim,
        "num_hidden_layers": c.depth,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None
        if c.rope_scaling is None
        else {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)},
        "tie_word_embeddings": c.tie_embeddings,
        "qk_norm": c.qk_norm,  # Qwen3's attention, Llama's without
    }


def ref_inv_freq(cfg):
    hd, scaling = cfg["head_dim"], cfg["rope_scaling"]
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    llama = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * llama / factor + smooth * llama
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, llama)


def ref_rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weight


def ref_rotate_half(x):
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def ref_decoder_logits(w, cfg, tokens):
    """Logits (batch, seq, vocab) of token ids (batch, seq), float64."""
    h, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    b, t = tokens.shape
    freqs = np.arange(t)[:, None] * ref_inv_freq(cfg)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)  # (t, hd)
    cos, sin = np.cos(emb)[None, None], np.sin(emb)[None, None]  # over (b, heads, t, hd)
    mask = np.where(np.tril(np.ones((t, t))) > 0, 0.0, -np.inf)
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = ref_rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, h, hd)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, kv, hd)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, kv, hd)
        if cfg["qk_norm"]:
            q = ref_rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = ref_rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k, v = (y.transpose(0, 2, 1, 3) for y in (q, k, v))  # (b, heads, t, hd)
        q, k = q * cos + ref_rotate_half(q) * sin, k * cos + ref_rotate_half(k) * sin
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) * hd**-0.5 + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, h * hd)
        x = x + y @ w[p + "self_attn.o_proj.weight"].T
        a = ref_rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate = a @ w[p + "mlp.gate_proj.weight"].T
        up = a @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = ref_rms_norm(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight" if cfg["tie_word_embeddings"] else "lm_head.weight"]
    return x @ head.T


HF_NAMES = {  # our path under blocks/<i>/ -> Hugging Face's under model.layers.<i>.
    "norm1/scale": "input_layernorm.weight",
    "attn/q/kernel": "self_attn.q_proj.weight",
    "attn/k/kernel": "self_attn.k_proj.weight",
    "attn/v/kernel": "self_attn.v_proj.weight",
    "attn/out/kernel": "self_attn.o_proj.weight",
    "attn/q_norm/scale": "self_attn.q_norm.weight",
    "attn/k_norm/scale": "self_attn.k_norm.weight",
    "norm2/scale": "post_attention_layernorm.weight",
    "mlp/gate/kernel": "mlp.gate_proj.weight",
    "mlp/up/kernel": "mlp.up_proj.weight",
    "mlp/down/kernel": "mlp.down_proj.weight",
}


def params_of(model):
    return {
        "/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def hf_weights(model):
    """The unrolled ``model``'s parameters by Hugging Face name, float64, kernels as (out, in)."""
    out = {}
    for path, v in params_of(model).items():
        value = np.asarray(v.get_value(), dtype=np.float64)
        if path.startswith("blocks/"):
            _, i, rest = path.split("/", 2)
            name = f"model.layers.{i}.{HF_NAMES[rest]}"
        else:
            name = {
                "embed/embedding": "model.embed_tokens.weight",
                "norm/scale": "model.norm.weight",
                "head/kernel": "lm_head.weight",
            }[path]
        out[name] = value.T if path.endswith("kernel") else value
    return out


def randomize_knobs(model, seed=3):
    """Every Param random: kernels ~ N(0, 1/fan_in), norm scales ~ 1 + N(0, 0.2), and an
    embedding of RMS 0.003, so the first norms' eps (1e-5) moves the result well above 1e-5."""
    key = jax.random.key(seed)
    for path, v in params_of(model).items():
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, v.shape, jnp.float32)
        if path.endswith("kernel"):
            value = noise / np.sqrt(v.shape[-2])
        elif path.endswith("scale"):
            value = 1 + 0.2 * noise
        else:
            value = 0.003 * noise
        v.set_value(value.astype(v.get_value().dtype))
    return model


def relative_error(ours, ref):
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_qwen3_knobs_match_a_float64_reference(tied):
    config = dataclasses.replace(KNOBS, tie_embeddings=tied)
    model = randomize_knobs(make(config))
    tokens = np.asarray(jax.random.randint(jax.random.key(4), (2, 12), 0, 64))
    ours = logits_of(model, jnp.asarray(tokens))
    weights, cfg = hf_weights(model), hf_config(config)
    assert relative_error(ours, ref_decoder_logits(weights, cfg, tokens)) < 1e-5
    # every knob moves the logits far beyond that tolerance
    for change in (
        dict(qk_norm=False),
        dict(rope_scaling=None),
        dict(rope_theta=1e4),
        dict(rms_norm_eps=1e-6),
    ):
        other = ref_decoder_logits(weights, {**cfg, **change}, tokens)
        assert relative_error(ours, other) > 1e-3, change
    # Llama 3.x: no q/k norms
    llama = randomize_knobs(make(dataclasses.replace(config, qk_norm=False)))
    assert not any("q_norm" in path or "k_norm" in path for path in params_of(llama))
    weights, cfg = hf_weights(llama), hf_config(llama.config)
    ours = logits_of(llama, jnp.asarray(tokens))
    assert relative_error(ours, ref_decoder_logits(weights, cfg, tokens)) < 1e-5
    regrouped = {**cfg, "head_dim": 8, "num_attention_heads": 8, "num_key_value_heads": 4}
    assert relative_error(ours, ref_decoder_logits(weights, regrouped, tokens)) > 1e-3


def test_knob_parameter_paths_and_shapes():
    """The paths a Hugging Face name map is written against (kernels are (in, out))."""
    shapes = {path: v.shape for path, v in params_of(make(KNOBS)).items()}
    block = {
        "norm1/scale": (32,),
        "attn/q/kernel": (32, 4 * 16),
        "attn/k/kernel": (32, 2 * 16),
        "attn/v/kernel": (32, 2 * 16),
        "attn/q_norm/scale": (16,),
        "attn/k_norm/scale": (16,),
        "attn/out/kernel": (4 * 16, 32),
        "norm2/scale": (32,),
        "mlp/gate/kernel": (32, 48),
        "mlp/up/kernel": (32, 48),
        "mlp/down/kernel": (48, 32),
    }
    expected = {f"blocks/{i}/{path}": shape for i in range(2) for path, shape in block.items()}
    expected |= {"embed/embedding": (64, 32), "norm/scale": (32,), "head/kernel": (32, 64)}
    assert shapes == expected
    scanned = make(dataclasses.replace(KNOBS, scan_layers=True, tie_embeddings=True))
    assert {path: v.shape for path, v in params_of(scanned).items()} == {
        **{f"blocks/{path}": (2, *shape) for path, shape in block.items()},
        "embed/embedding": (64, 32),
        "norm/scale": (32,),
    }
    attn = make(KNOBS).blocks[0].attn
    assert attn.q_norm.scale.get_metadata()["out_sharding"] == (None,)
    assert (attn.q_norm.eps, attn.rope) == (1e-5, RopeConfig(1e6, LLAMA3))
    # FLOPs of stage_rules count the attention's width, num_heads * head_dim, not dim
    assert _attention_dims(make(KNOBS).blocks[0]) == 64


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_scanned_knobs_give_the_unrolled_logits(tied):
    config = dataclasses.replace(KNOBS, tie_embeddings=tied)
    unrolled = randomize_knobs(make(config))
    scanned = make(dataclasses.replace(config, scan_layers=True), seed=1)
    weights = params_of(unrolled)
    for path, v in params_of(scanned).items():
        if path.startswith("blocks/"):
            rest = path.removeprefix("blocks/")
            layers = [weights[f"blocks/{i}/{rest}"].get_value() for i in range(config.depth)]
            v.set_value(jnp.stack(layers))
        else:
            v.set_value(weights[path].get_value())
    tokens = jax.random.randint(jax.random.key(5), (2, 12), 0, 64)
    close = np.testing.assert_allclose
    close(logits_of(scanned, tokens), logits_of(unrolled, tokens), rtol=1e-5, atol=1e-6)


def test_bfloat16_parameters():
    config = dataclasses.replace(KNOBS, param_dtype="bfloat16")
    model = make(config)
    assert {v.get_value().dtype for v in params_of(model).values()} == {jnp.dtype(jnp.bfloat16)}
    # computing in float32, it is the float32 model whose weights are rounded to bfloat16
    reference = randomize_knobs(make(KNOBS))
    weights = params_of(reference)
    for path, v in params_of(model).items():
        rounded = weights[path].get_value().astype(jnp.bfloat16)
        v.set_value(rounded)
        weights[path].set_value(rounded.astype(jnp.float32))
    tokens = jax.random.randint(jax.random.key(6), (2, 12), 0, 64)
    logits = logits_of(model, tokens)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, logits_of(reference, tokens), rtol=1e-5, atol=1e-6)
    batch = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
    grads = nnx.jit(nnx.grad(lambda m: m.loss(batch)))(model)
    leaves = jax.tree.leaves(grads)
    assert {g.dtype for g in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    both = make(dataclasses.replace(config, dtype="bfloat16", scan_layers=True))
    assert bool(jnp.isfinite(loss_of(both, batch)))  # jitted: eager, seconds of compiles


def test_config_is_frozen_and_hashable():
    assert hash(KNOBS) == hash(dataclasses.replace(KNOBS))
    with pytest.raises(dataclasses.FrozenInstanceError):
        KNOBS.head_dim = 8  # type: ignore[misc]


SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


@pytest.mark.parametrize(
    "make_bad, message",
    [
        (lambda: GPTConfig(head_dim=7), "GPTConfig: AttentionConfig.head_dim must be even"),
        (lambda: GPTConfig(head_dim=0), r"AttentionConfig.head_dim must be None or an int >= 1"),
        (lambda: GPTConfig(mlp_hidden=2.5), r"GPTConfig: MLPConfig.hidden must be an int >= 1"),
        (lambda: GPTConfig(norm_eps=-1e-5), r"GPTConfig: NormConfig.eps must be None or a finite"),
        (lambda: GPTConfig(norm_eps=float("nan")), r"NormConfig.eps"),
        (lambda: GPTConfig(rope_theta=0.0), r"RopeConfig.theta must be a finite number > 0"),
        (lambda: GPTConfig(param_dtype="float16"), "GPTConfig.param_dtype must be 'float32' or"),
        (lambda: GPTConfig(qk_norm=1), "GPTConfig: AttentionConfig.qk_norm must be a bool"),
        (
            lambda: GPTConfig(rope_scaling={"rope_type": "llama3", **SCALING}),
            r"GPTConfig: RopeConfig.scaling must be None, a mmnnx.modules.RopeScaling or Yarn",
        ),
        (
            lambda: RopeScaling(**{**SCALING, "high_freq_factor": 1.0}),
            r"RopeScaling.high_freq_factor \(1.0\) must be greater than low_freq_factor \(1.0\)",
        ),
        (
            lambda: RopeScaling(**{**SCALING, "factor": 0.0}),
            r"RopeScaling.factor must be a finite number > 0, got 0.0",
        ),
        (
            lambda: RopeScaling(**{**SCALING, "original_max_position_embeddings": 0}),
            r"RopeScaling.original_max_position_embeddings must be an int >= 1, got 0",
        ),
        (lambda: make(GPTConfig(dim=36, num_heads=4)), "RoPE needs an even head_dim, got 9"),
        (lambda: RMSNorm(4, eps=-1.0), r"RMSNorm: eps must be a finite number > 0, got -1.0"),
        (lambda: GPTConfig(max_seq_len=-5), r"GPTConfig.max_seq_len must be an int >= 1, got -5"),
        (lambda: GPTConfig(vocab_size=0), r"GPTConfig.vocab_size must be an int >= 1, got 0"),
        (lambda: GPTConfig(depth=True), r"GPTConfig.depth must be an int >= 1, got True"),
    ],
    ids=[
        "odd-head_dim",
        "zero-head_dim",
        "float-mlp_hidden",
        "negative-eps",
        "nan-eps",
        "zero-theta",
        "float16-params",
        "int-qk_norm",
        "dict-scaling",
        "equal-freq-factors",
        "zero-factor",
        "zero-original-max",
        "odd-default-head_dim",
        "negative-rmsnorm-eps",
        "negative-max_seq_len",
        "zero-vocab",
        "bool-depth",
    ],
)
def test_bad_knobs_raise(make_bad, message):
    with pytest.raises(ValueError, match=message):
        make_bad()


@pytest.mark.parametrize("scan_layers", [False, True])
def test_nested_layers_build_the_same_model_as_the_flat_knobs(scan_layers):
    flat = dataclasses.replace(KNOBS, scan_layers=scan_layers, dropout=0.1)
    nested = GPTConfig(
        vocab_size=64, dim=32, depth=2, num_heads=4, num_kv_heads=2,
        norm_eps=1e-5, max_seq_len=16, scan_layers=scan_layers, layers=flat.block_configs,
    )  # fmt: skip
    assert nested.block_configs == flat.block_configs and len(set(flat.block_configs)) == 1
    layer = flat.block_configs[0]
    assert (layer.attention.head_dim, layer.attention.qk_norm, layer.attention.rope) == (
        16, True, RopeConfig(1e6, LLAMA3)
    )  # fmt: skip
    assert (layer.feed_forward.hidden, layer.norm.eps, layer.dropout) == (48, 1e-5, 0.1)
    with nnx.use_eager_sharding(False):
        a, b = (GPT(c, rngs=nnx.Rngs(0, dropout=1)) for c in (flat, nested))
    pa, pb = params_of(a), params_of(b)
    assert list(pa) == list(pb)
    for path in pa:
        np.testing.assert_array_equal(pa[path].get_value(), pb[path].get_value())
    batch = jnp.arange(18, dtype=jnp.int32).reshape(2, 9) % 64
    assert float(loss_of(a, batch)) == float(loss_of(b, batch))


def test_nested_layers_are_checked():
    layer = KNOBS.block_configs[0]
    sized = dict(vocab_size=64, dim=32, depth=2, num_heads=4, num_kv_heads=2)
    for make_bad, message in [
        (lambda: GPTConfig(**sized, layers=(layer,)), r"GPTConfig.layers must be None or a tuple "
         r"of depth \(2\) BlockConfigs"),
        (lambda: GPTConfig(**sized, layers=[layer, layer]), r"GPTConfig.layers must be"),
        (lambda: GPTConfig(**sized, layers=(layer, layer), qk_norm=True),
         r"GPTConfig: layers= sets every layer; leave out \['qk_norm'\]"),
        (lambda: GPTConfig(**{**sized, "num_kv_heads": None}, layers=(layer, layer)),
         r"GPTConfig: num_heads, num_kv_heads \(4, 4\) are not the layers' \[\(4, 2\)\]"),
        (lambda: GPTConfig(**sized, scan_layers=True,
                           layers=(layer, dataclasses.replace(layer, dropout=0.5))),
         r"GPTConfig: scan_layers scans runs of a repeated period of layers, but layers differ "
         r"and no run of these 2 layers repeats"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            make_bad()
