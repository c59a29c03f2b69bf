"""mmnnx.modules against hand-written reference math, and a GPT built from them under mm.jit."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig
from mmnnx.modules import (
    MLP,
    Attention,
    AttentionConfig,
    BlockConfig,
    Embed,
    LayerNorm,
    Linear,
    MLPConfig,
    MoE,
    MoEConfig,
    NormConfig,
    RMSNorm,
    RopeConfig,
    RopeScaling,
    TransformerBlock,
    apply_rope,
    constrain,
    rope_frequencies,
)

DIM, SEQ = 32, 8


def build(cls, *args, **kwargs):
    with nnx.use_eager_sharding(False):
        return cls(*args, **kwargs)


HEADS4, MLP4, RMS = AttentionConfig(4), MLPConfig(4 * DIM), NormConfig()


def make_block(attention=HEADS4, feed_forward=MLP4, norm=RMS, **kw):
    """A ``TransformerBlock`` of width ``DIM`` built from its component configs."""
    config = BlockConfig(attention, feed_forward, norm)
    return build(TransformerBlock, DIM, config, rngs=nnx.Rngs(0), **kw)


def arr(x):
    return np.asarray(x, dtype=np.float64)


def close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def randomize(module, seed=1):
    """Replaces every Param (norm scales and biases included) by random values."""
    key = jax.random.key(seed)
    for _, v in nnx.iter_graph(module):
        if isinstance(v, nnx.Param):
            key, sub = jax.random.split(key)
            v.set_value(0.5 * jax.random.normal(sub, v.shape))
    return module


@pytest.fixture
def x():
    return jax.random.normal(jax.random.key(0), (2, SEQ, DIM))


# ----------------------------------------------------------------------------- reference math


def ref_linear(x, layer):
    y = arr(x) @ arr(layer.kernel.get_value())
    return y + arr(layer.bias.get_value()) if layer.bias is not None else y


def ref_gelu(x):  # jax.nn.gelu's default (tanh) approximation
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def ref_silu(x):
    return x / (1 + np.exp(-x))


def ref_softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ref_rope(x, base=10000.0, inv_freq=None):
    """Direct formula: pair (i, i + d/2) at position p rotated by p * base**(-2i/d) (or by
    p * inv_freq[i])."""
    x = arr(x)
    out = x.copy()
    seq, d = x.shape[-3], x.shape[-1]
    for p in range(seq):
        for i in range(d // 2):
            theta = p * (base ** (-2 * i / d) if inv_freq is None else inv_freq[i])
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., p, :, i], x[..., p, :, i + d // 2]
            out[..., p, :, i] = c * a - s * b
            out[..., p, :, i + d // 2] = s * a + c * b
    return out


def ref_attention(x, attn, rope=True, inv_freq=None):
    """Per-head loops with an explicit causal mask and softmax (and per-head q/k norms)."""
    x = arr(x)
    b, t, _ = x.shape
    h, kv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = ref_linear(x, attn.q).reshape(b, t, h, hd)
    k = ref_linear(x, attn.k).reshape(b, t, kv, hd)
    v = ref_linear(x, attn.v).reshape(b, t, kv, hd)
    if attn.q_norm is not None:
        q, k = ref_rms(q, attn.q_norm), ref_rms(k, attn.k_norm)
    if rope:
        q, k = ref_rope(q, inv_freq=inv_freq), ref_rope(k, inv_freq=inv_freq)
    out = np.zeros((b, t, h, hd))
    for head in range(h):
        g = head // (h // kv)
        for i in range(b):
            scores = q[i, :, head] @ k[i, :, g].T / math.sqrt(hd)
            scores = np.where(np.tril(np.ones((t, t))) > 0, scores, -np.inf)
            out[i, :, head] = ref_softmax(scores) @ v[i, :, g]
    return ref_linear(out.reshape(b, t, h * hd), attn.out)


def ref_rms(x, norm):
    x = arr(x)
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + norm.eps) * arr(norm.scale.get_value())


def ref_layer(x, norm):
    x = arr(x)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + norm.eps) * arr(norm.scale.get_value()) + arr(
        norm.bias.get_value()
    )


# ----------------------------------------------------------------------------- layers


@pytest.mark.parametrize("use_bias", [True, False])
def test_linear(x, use_bias):
    layer = randomize(build(Linear, DIM, 48, use_bias=use_bias, rngs=nnx.Rngs(0)))
    assert (layer.bias is None) == (not use_bias)
    close(layer(x), ref_linear(x, layer))
    assert layer.kernel.shape == (DIM, 48)


def test_embed_lookup_and_attend():
    embed = build(Embed, 16, DIM, rngs=nnx.Rngs(0))
    tokens = jnp.array([[3, 0, 15], [7, 7, 1]])
    table = arr(embed.embedding.get_value())
    close(embed(tokens), table[np.asarray(tokens)])
    h = np.random.default_rng(0).normal(size=(2, 3, DIM))
    close(embed.attend(jnp.asarray(h, jnp.float32)), h @ table.T, rtol=1e-4)


def test_norms(x):
    rms = randomize(build(RMSNorm, DIM))
    layer = randomize(build(LayerNorm, DIM))
    close(rms(x), ref_rms(x, rms))
    close(layer(x), ref_layer(x, layer))
    assert (rms.eps, layer.eps) == (1e-6, 1e-5)
    # fresh norms normalise: unit RMS, or zero mean and unit variance
    y = arr(build(RMSNorm, DIM)(x))
    close((y**2).mean(-1), 1.0, rtol=1e-4)
    z = arr(build(LayerNorm, DIM)(x))
    close(z.mean(-1), 0.0, atol=1e-5)
    close(z.var(-1), 1.0, rtol=1e-3)


def test_mlp_plain_and_gated(x):
    mlp = randomize(build(MLP, DIM, MLPConfig(64), rngs=nnx.Rngs(0)))
    assert mlp.gate is None and mlp.activation is jax.nn.gelu
    close(mlp(x), ref_linear(ref_gelu(ref_linear(x, mlp.up)), mlp.down), rtol=1e-4, atol=1e-4)

    gated = randomize(build(MLP, DIM, MLPConfig(64, gated=True), rngs=nnx.Rngs(0)))
    assert gated.activation is jax.nn.silu
    h = ref_silu(ref_linear(x, gated.gate)) * ref_linear(x, gated.up)
    close(gated(x), ref_linear(h, gated.down), rtol=1e-4, atol=1e-4)

    relu = build(MLP, DIM, MLPConfig(64), activation=jax.nn.relu, rngs=nnx.Rngs(0))
    close(relu(x), ref_linear(np.maximum(ref_linear(x, relu.up), 0), relu.down), atol=1e-4)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_attention_matches_reference(x, rope, num_kv_heads):
    config = AttentionConfig(4, num_kv_heads, rope=RopeConfig() if rope else None)
    attn = build(Attention, DIM, config, rngs=nnx.Rngs(0))
    assert attn.k.kernel.shape == (DIM, (num_kv_heads or 4) * DIM // 4)
    close(attn(x), ref_attention(x, attn, rope=rope), rtol=1e-4, atol=1e-5)


def test_attention_is_causal(x):
    attn = build(Attention, DIM, HEADS4, rngs=nnx.Rngs(0))
    y = attn(x)
    changed = x.at[:, 5:].set(jax.random.normal(jax.random.key(9), (2, SEQ - 5, DIM)))
    y2 = attn(changed)
    close(y2[:, :5], y[:, :5], atol=1e-6)  # the past does not see the future
    assert not np.allclose(y2[:, 5:], y[:, 5:])


def test_rope_direct_formula_and_relative_positions():
    q = jax.random.normal(jax.random.key(1), (2, SEQ, 3, 8))
    close(apply_rope(q), ref_rope(q), atol=1e-5)
    close(apply_rope(q, base=100.0), ref_rope(q, base=100.0), atol=1e-5)
    close(apply_rope(q)[:, 0], q[:, 0])  # position 0 is not rotated

    # q . k after rotation depends only on the position difference
    qv, kv = jax.random.normal(jax.random.key(2), (2, 16))

    def dot(m, n):
        rq = apply_rope(qv[None, None, :], jnp.array([m]))
        rk = apply_rope(kv[None, None, :], jnp.array([n]))
        return float(jnp.sum(rq * rk))

    for m, n in [(0, 3), (2, 7), (9, 1)]:
        for shift in (1, 5, 40):
            assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), rel=1e-4, abs=1e-4)
    assert dot(0, 3) != pytest.approx(dot(0, 4), rel=1e-3)
    # norms are preserved (a rotation)
    close(jnp.linalg.norm(apply_rope(q), axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="even"):
        apply_rope(jnp.ones((1, 2, 1, 3)))


def test_gqa_equals_mha_with_repeated_kv_weights(x):
    h, kv = 4, 2
    gqa = build(Attention, DIM, AttentionConfig(h, kv), rngs=nnx.Rngs(0))
    mha = build(Attention, DIM, AttentionConfig(h), rngs=nnx.Rngs(1))
    hd = DIM // h
    mha.q.kernel.set_value(gqa.q.kernel.get_value())
    mha.out.kernel.set_value(gqa.out.kernel.get_value())
    for name in ("k", "v"):
        w = getattr(gqa, name).kernel.get_value().reshape(DIM, kv, hd)
        getattr(mha, name).kernel.set_value(jnp.repeat(w, h // kv, axis=1).reshape(DIM, h * hd))
    close(gqa(x), mha(x), atol=1e-6)
    with pytest.raises(ValueError, match="num_kv_heads"):
        AttentionConfig(4, num_kv_heads=3)


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("gated", [False, True])
def test_transformer_block_is_pre_norm_residual(x, norm, gated):
    block = randomize(
        make_block(
            AttentionConfig(4, num_kv_heads=2), MLPConfig(4 * DIM, gated=gated), NormConfig(norm)
        )
    )
    assert isinstance(block.norm1, RMSNorm if norm == "rms" else LayerNorm)
    assert block.mlp.hidden == 4 * DIM and block.mlp.gated == gated
    ref_norm = ref_rms if norm == "rms" else ref_layer
    h = arr(x) + ref_attention(ref_norm(x, block.norm1), block.attn)
    if gated:
        mlp = block.mlp
        u = ref_linear(ref_norm(h, block.norm2), mlp.up)
        m = ref_linear(ref_silu(ref_linear(ref_norm(h, block.norm2), mlp.gate)) * u, mlp.down)
    else:
        m = ref_linear(ref_gelu(ref_linear(ref_norm(h, block.norm2), block.mlp.up)), block.mlp.down)
    close(block(x), h + m, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="NormConfig.kind must be 'rms' or 'layer', got 'batch'"):
        NormConfig("batch")


def test_logical_names_in_metadata():
    gated = make_block(AttentionConfig(4, num_kv_heads=2), MLPConfig(4 * DIM, gated=True))
    names = {
        "/".join(map(str, p)): v.get_metadata()["out_sharding"]
        for p, v in nnx.iter_graph(gated)
        if isinstance(v, nnx.Variable)
    }
    assert names == {
        "norm1/scale": ("embed",),
        "norm2/scale": ("embed",),
        "attn/q/kernel": ("embed", "heads"),
        "attn/k/kernel": ("embed", "heads"),
        "attn/v/kernel": ("embed", "heads"),
        "attn/out/kernel": ("heads", "embed"),
        "mlp/up/kernel": ("embed", "mlp"),
        "mlp/up/bias": ("mlp",),
        "mlp/gate/kernel": ("embed", "mlp"),
        "mlp/gate/bias": ("mlp",),
        "mlp/down/kernel": ("mlp", "embed"),
        "mlp/down/bias": ("embed",),
    }
    assert build(Embed, 8, DIM, rngs=nnx.Rngs(0)).embedding.get_metadata()["out_sharding"] == (
        "vocab",
        "embed",
    )
    ln = build(LayerNorm, DIM)
    assert ln.bias.get_metadata()["out_sharding"] == ("embed",)
    lin = build(Linear, 4, 8, axes=("heads", None), rngs=nnx.Rngs(0))
    assert lin.kernel.get_metadata()["out_sharding"] == ("heads", None)
    assert lin.bias.get_metadata()["out_sharding"] == (None,)


def test_constrain_is_identity_outside_mm_jit(x):
    assert constrain(x, ("batch", "seq", "embed")) is x
    default = make_block()
    eager = default(x)
    close(jax.jit(lambda a: constrain(a, ("batch", "seq", "embed")))(x), x)
    close(nnx.jit(lambda m, a: m(a))(default, x), eager, atol=1e-5)


# ----------------------------------------------------------------------------- under mm.jit

CONFIG = GPTConfig(vocab_size=64, dim=DIM, depth=2, num_heads=4, num_kv_heads=2, max_seq_len=SEQ)


def make_gpt():
    with nnx.use_eager_sharding(False):
        return GPT(CONFIG, rngs=nnx.Rngs(0))


def train_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
    opt.update(model, grads)
    return loss


@pytest.fixture(scope="module")
def two_task_run():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    rules = mm.logical_rules(
        batch="data", mlp="model", heads="model", vocab="model", embed=None, seq=None
    )
    tasks = [mm.Task(f"s{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules) for i in range(2)]
    model = make_gpt()
    model = mm.place(model, mm.stage_rules(model, tasks, report=False))
    tx = optax.adamw(1e-2)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ref = make_gpt()
    ref_opt = nnx.Optimizer(ref, tx, wrt=nnx.Param)
    batch = jax.random.randint(jax.random.key(1), (4, SEQ + 1), 0, CONFIG.vocab_size)
    step = mm.jit(train_step)
    ref_step = nnx.jit(train_step)
    # two adamw steps, and a third whose loss shows the second update
    losses = [(step(model, opt, batch), ref_step(ref, ref_opt, batch)) for _ in range(3)]
    plan = step.plan(model, opt, batch)  # compiled: with the layouts the compiler chose
    return dict(tasks=tasks, model=model, plan=plan, losses=losses, step=step)


def test_gpt_on_two_tasks_trains_like_one_device(two_task_run):
    run = two_task_run
    for loss, ref_loss in run["losses"]:
        np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-5)
    assert run["losses"][2][1] < run["losses"][0][1]  # it learns
    assert run["step"].trace_count == 1
    placement = mm.placement(run["model"])
    assert placement["embed/embedding"] == ("s0", P("model", None))
    assert placement["blocks/0/attn/q/kernel"] == ("s0", P(None, "model"))
    assert placement["blocks/1/mlp/down/kernel"] == ("s1", P("model", None))
    assert placement["head/kernel"] == ("s1", P(None, "model"))


def test_activation_constraints_are_active_inside_mm_jit(two_task_run):
    plan = two_task_run["plan"]
    assert {t.name for t in plan.tasks} == {"s0", "s1"}
    batch_inputs = [t for t in plan.transfers if t.source is None and t.shape == (4, SEQ + 1)]
    assert batch_inputs
    assert all(t.sharding.spec == P("data", None) for t in batch_inputs)
    # the activation crossing the stage boundary is batch-sharded, as the blocks constrain it
    acts = [t for t in plan.transfers if t.source is not None and t.shape == (4, SEQ, DIM)]
    assert acts
    assert all(tuple(t.sharding.spec)[:1] == ("data",) for t in acts)


def test_each_stage_slices_the_token_batch_itself(two_task_run):
    """Inputs (batch[:, :-1]) and targets (batch[:, 1:]) are cut where they are read: the batch
    goes to both stages, and only activations and cotangents cross between them."""
    plan = two_task_run["plan"]
    batch_inputs = [t for t in plan.transfers if t.source is None and t.shape == (4, SEQ + 1)]
    assert sorted(t.target.name for t in batch_inputs) == ["s0", "s1"]
    between = [t for t in plan.transfers if t.source is not None and t.nbytes > 4]
    assert sorted((t.source.name, t.target.name, t.shape) for t in between) == [
        ("s0", "s1", (4, SEQ, DIM)),
        ("s1", "s0", (4, SEQ, DIM)),
    ]


# ----------------------------------------------------------------------------- Llama 3 / Qwen3


def ref_llama3_inv_freq(head_dim, base, factor, low, high, old):
    """transformers' _compute_llama3_parameters, in float64."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    out = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, (1 - smooth) * out / factor + smooth * out, out)


def test_rope_frequencies_of_llama_3_1():
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, scaling)
    assert plain.dtype == scaled.dtype == np.float32 and scaled.shape == (64,)
    close(plain, 500000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-6, atol=0)
    close(scaled, ref_llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192), rtol=1e-6, atol=0)
    # the three bands: kept (short wavelengths), interpolated, divided by 8 (long ones)
    ratio = arr(plain) / arr(scaled)
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, 8.0)
    assert kept[0] and divided[-1] and (~kept & ~divided).any()
    # apply_rope rotates by those frequencies
    q = jax.random.normal(jax.random.key(1), (2, SEQ, 3, 8))
    small = RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=64
    )
    inv_freq = ref_llama3_inv_freq(8, 100.0, 4.0, 1.0, 2.0, 64)
    close(apply_rope(q, base=100.0, scaling=small), ref_rope(q, inv_freq=inv_freq), atol=1e-5)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_frequencies(5)


def test_attention_with_head_dim_and_qk_norm_matches_reference(x):
    scaling = RopeScaling(
        factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0, original_max_position_embeddings=16
    )
    rope = RopeConfig(1e6, scaling)
    config = AttentionConfig(4, 2, head_dim=12, qk_norm=True, qk_norm_eps=1e-5, rope=rope)
    attn = build(Attention, DIM, config, rngs=nnx.Rngs(0))
    attn = randomize(attn)
    assert (attn.q.kernel.shape, attn.k.kernel.shape, attn.out.kernel.shape) == (
        (DIM, 48),
        (DIM, 24),
        (48, DIM),
    )
    assert attn.q_norm.scale.shape == attn.k_norm.scale.shape == (12,)
    assert attn.q_norm.eps == 1e-5
    inv_freq = ref_llama3_inv_freq(12, 1e6, 4.0, 1.0, 2.0, 16)
    close(attn(x), ref_attention(x, attn, inv_freq=inv_freq), rtol=1e-4, atol=1e-5)
    # project at later positions, then attend over the keys so far: the last rows of attn(x)
    q, k, v = attn.project(x[:, 5:], jnp.arange(5, SEQ))
    _, k0, v0 = attn.project(x[:, :5])
    keys, values = jnp.concatenate([k0, k], axis=1), jnp.concatenate([v0, v], axis=1)
    visible = jnp.arange(5, SEQ)[:, None] >= jnp.arange(SEQ)[None, :]
    close(attn.attend(q, keys, values, visible), attn(x)[:, 5:], atol=1e-5)


def test_knobs_reach_every_module():
    knobs = make_block(
        AttentionConfig(4, head_dim=16, qk_norm=True, qk_norm_eps=1e-5),
        MLPConfig(40, gated=True, bias=False),
        NormConfig(eps=1e-5),
        param_dtype=jnp.bfloat16,
    )
    variables = {
        "/".join(map(str, p)): v for p, v in nnx.iter_graph(knobs) if isinstance(v, nnx.Variable)
    }
    assert {v.get_value().dtype for v in variables.values()} == {jnp.dtype(jnp.bfloat16)}
    assert not any(path.endswith("bias") for path in variables)
    assert variables["attn/q_norm/scale"].get_metadata()["out_sharding"] == (None,)
    assert variables["mlp/up/kernel"].shape == (DIM, 40)
    assert knobs.norm1.eps == knobs.norm2.eps == knobs.attn.k_norm.eps == 1e-5
    assert knobs(jnp.ones((1, 3, DIM))).dtype == jnp.float32
    assert build(NormConfig("layer").build, 4).eps == 1e-5
    assert build(NormConfig("layer", eps=1e-6).build, 4).eps == 1e-6
    embed = build(Embed, 8, DIM, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert embed.embedding.get_value().dtype == jnp.bfloat16
    assert build(LayerNorm, 4, param_dtype=jnp.bfloat16).bias.get_value().dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "make_bad, message",
    [
        (lambda: AttentionConfig(0), r"AttentionConfig.num_heads must be an int >= 1, got 0"),
        (
            lambda: AttentionConfig(4, 3),
            r"num_kv_heads must be None or a divisor of num_heads \(4\)",
        ),
        (
            lambda: AttentionConfig(4, head_dim=6.0),
            r"AttentionConfig.head_dim must be None or an int",
        ),
        (lambda: AttentionConfig(4, head_dim=5), r"AttentionConfig.head_dim must be even"),
        (lambda: AttentionConfig(4, qk_norm_eps=0.0), r"AttentionConfig.qk_norm_eps must be a"),
        (
            lambda: AttentionConfig(4, rope=1e4),
            r"AttentionConfig.rope must be None or a RopeConfig",
        ),
        (
            lambda: RopeConfig(float("inf")),
            r"RopeConfig.theta must be a finite number > 0, got inf",
        ),
        (
            lambda: RopeConfig(scaling={"factor": 8}),
            r"RopeConfig.scaling must be None, a mmnnx.modules.RopeScaling or YarnScaling",
        ),
        (lambda: NormConfig("batch"), r"NormConfig.kind must be 'rms' or 'layer', got 'batch'"),
        (lambda: NormConfig(eps=-1.0), r"NormConfig.eps must be None or a finite number > 0"),
        (lambda: MLPConfig(2.5), r"MLPConfig.hidden must be an int >= 1, got 2.5"),
        (lambda: MLPConfig(8, gated=1), r"MLPConfig.gated must be a bool, got 1"),
        (lambda: MLPConfig(8, bias=None), r"MLPConfig.bias must be a bool, got None"),
        (lambda: MoEConfig(8, 0), r"MoEConfig.num_experts must be an int >= 1, got 0"),
        (lambda: MoEConfig(0, 4), r"MoEConfig.hidden must be an int >= 1, got 0"),
        (lambda: MoEConfig(8, 4, 5), r"MoEConfig.top_k must be an int in 1..num_experts \(4\)"),
        (lambda: MoEConfig(8, 4, norm_topk_prob=0), r"MoEConfig.norm_topk_prob must be a bool"),
        (lambda: MoEConfig(8, 4, capacity_factor=0), r"MoEConfig.capacity_factor must be None"),
        (lambda: BlockConfig(4, MLP4), r"BlockConfig.attention must be a component config"),
        (lambda: BlockConfig(HEADS4, 64), r"BlockConfig.feed_forward must be a component config"),
        (lambda: BlockConfig(HEADS4, MLP4, "rms"), r"BlockConfig.norm must be a NormConfig"),
        (lambda: BlockConfig(HEADS4, MLP4, dropout=1.0), r"BlockConfig.dropout must be a number"),
    ],
)
def test_bad_component_configs_raise_naming_the_field(make_bad, message):
    with pytest.raises(ValueError, match=message):
        make_bad()


def test_component_configs_are_frozen_hashable_and_build_their_modules():
    moe = MoEConfig(16, num_experts=4, top_k=2, norm_topk_prob=False)
    config = BlockConfig(AttentionConfig(4, 2, qk_norm=True), moe, NormConfig("layer"), 0.1)
    assert hash(config) == hash(BlockConfig(AttentionConfig(4, 2, qk_norm=True), moe,
                                            NormConfig("layer"), 0.1))  # fmt: skip
    with pytest.raises(AttributeError):
        config.dropout = 0.0  # type: ignore[misc]
    block = build(config.build, DIM, rngs=nnx.Rngs(0, dropout=1))
    assert isinstance(block.norm1, LayerNorm) and isinstance(block.mlp, MoE)
    assert (block.attn.num_kv_heads, block.mlp.top_k, block.mlp.norm_topk_prob) == (2, 2, False)
    assert block.dropout.rate == 0.1 and block.attn.q_norm is not None
    # jitted: eager, each of the MoE block's operations compiled on its own took seconds
    y, stats = nnx.jit(lambda b, x: b.forward(x))(block, jnp.ones((2, 3, DIM)))
    assert y.shape == (2, 3, DIM) and int(stats.tokens_per_expert.sum()) == 2 * 3 * 2


class ScaledIdentity(nnx.Module):
    """A made-up feed-forward: what a new component needs is a module and a config's build."""

    def __init__(self, dim, config, *, param_dtype=jnp.float32, rngs):
        self.scale = nnx.Param(jnp.full((dim,), config.scale, param_dtype))

    def __call__(self, x):
        return x * self.scale[...]


@dataclasses.dataclass(frozen=True)
class ScaledIdentityConfig:
    scale: float = 2.0

    def build(self, dim, **kw):
        return ScaledIdentity(dim, self, **kw)


def test_a_new_component_plugs_into_the_block_and_the_gpt_unchanged():
    layer = BlockConfig(HEADS4, ScaledIdentityConfig(), NormConfig())
    block = build(layer.build, DIM, rngs=nnx.Rngs(0))
    assert isinstance(block.mlp, ScaledIdentity) and block.forward(jnp.ones((1, 2, DIM)))[1] is None
    config = GPTConfig(dim=DIM, depth=2, vocab_size=16, layers=(layer, layer))
    model = build(GPT, config, rngs=nnx.Rngs(0))
    assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 16)
