"""DeepSeek-V3 (and Kimi K2) against transformers 5: a tiny ``DeepseekV3ForCausalLM`` written by
transformers' own ``save_pretrained`` (tests/transformers_fixtures/make_deepseek_fixtures.py)
gives mmnnx transformers' logits on one device and on two pipeline stages, and its greedy
continuation from a cache of latents; the same weights in DeepSeek's published FP8 layout give
transformers' logits of the dequantized weights; what ``save_pretrained`` writes transformers
reads back (its verdict kept by the fixture script's ``--check``)."""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.decoding import _ONE_DEVICE
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained.files import CheckpointFiles, write_shards
from mmnnx.models.pretrained.fp8 import Fp8Files
from mmnnx.modules import DeepSeekMoE, LatentAttention, RouterBias
from mmnnx.train.config import RunConfig
from mmnnx.train.run_model import model_config
from mmnnx.train.tokenizers import HFTokenizer

FIXTURES = pathlib.Path(__file__).parent / "transformers_fixtures"
FLOAT, FP8 = FIXTURES / "deepseek_v3", FIXTURES / "deepseek_v3_fp8"
TOKENS = jnp.asarray(json.loads((FIXTURES / "versions.json").read_text())["tokens"], jnp.int32)
F32 = 1e-5  # relative to the largest logit


def relative_error(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def model():
    return from_pretrained(FLOAT, max_seq_len=32)


def test_logits_and_greedy_decoding_from_latents_equal_transformers(model):
    assert relative_error(model(TOKENS), np.load(FLOAT / "logits.npy")) < F32
    greedy = json.loads((FLOAT / "greedy.json").read_text())
    prompt = jnp.asarray(greedy["prompt"], jnp.int32)
    assert model.generate(prompt, 8).tolist() == greedy["continuation"]
    _, cache = _ONE_DEVICE(model, prompt, None, jnp.zeros((), jnp.int32))
    # each layer caches its latent (kv_lora_rank 16) and shared rotated key (4), not 4 heads'
    # keys (12) and values (8)
    assert [tuple(a.shape for a in layer) for layer in cache] == [
        ((1, 32, 1, 16), (1, 32, 1, 4))
    ] * 3
    attn, moe = model.blocks[1].attn, model.blocks[1].mlp
    assert isinstance(attn, LatentAttention) and isinstance(moe, DeepSeekMoE)
    assert type(model.blocks[0].mlp).__name__ == "MLP"  # first_k_dense_replace 1
    bias = CheckpointFiles(FLOAT).read("model.layers.1.mlp.gate.e_score_correction_bias")
    assert isinstance(moe.correction_bias, RouterBias) and not np.all(bias == 0)
    np.testing.assert_array_equal(moe.correction_bias[...], bias)
    trained = [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    assert not [p for p in trained if "correction_bias" in p]  # no optimizer moves it
    assert moe.router.kernel.dtype == jnp.float32


def test_no_shared_expert_reads_past_the_empty_tensors_transformers_writes_for_it(tmp_path):
    """``n_shared_experts`` 0: transformers writes each layer's shared expert as tensors of no
    elements (``(0, 32)``), which fill nothing; refused before as tensors filling no Variable."""
    unshared = FIXTURES / "deepseek_v3_unshared"
    model = from_pretrained(unshared, max_seq_len=32)
    assert not any(b.mlp.shared for b in model.blocks)
    assert relative_error(model(TOKENS), np.load(unshared / "logits.npy")) < F32
    again = from_pretrained(save_pretrained(model, tmp_path / "saved"), max_seq_len=32)
    assert relative_error(again(TOKENS), np.load(unshared / "logits.npy")) < F32


def test_fp8_checkpoint_gives_transformers_logits_of_its_dequantized_weights(model):
    fp8 = from_pretrained(FP8, max_seq_len=32)
    assert relative_error(fp8(TOKENS), np.load(FP8 / "logits.npy")) < F32
    # against the float weights it came from: within float8_e4m3's precision of each block
    ours, theirs = fp8.blocks[1].attn.kv_a.kernel[...], model.blocks[1].attn.kv_a.kernel[...]
    assert 0 < float(jnp.abs(ours - theirs).max()) < 2**-4 * float(jnp.abs(theirs).max())
    assert json.loads((FP8 / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [8, 8]  # 20-row kv_a_proj_with_mqa: blocks of 8, 8 and 4 rows


def _copy_fp8(tmp_path, edit=lambda tensors: None, config_edit=lambda c: None):
    files = Fp8Files(CheckpointFiles(FP8), (8, 8))
    tensors = {}
    for name, info in files.files.tensors.items():
        if info.dtype == "F8_E4M3":
            tensors[name] = files._quantized(name, slice(None), slice(None))
        else:
            tensors[name] = files.files.read(name)
    edit(tensors)
    out = tmp_path / "fp8"
    out.mkdir()
    write_shards(out, tensors)
    config = json.loads((FP8 / "config.json").read_text())
    config_edit(config)
    (out / "config.json").write_text(json.dumps(config))
    return out


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


@pytest.mark.parametrize(
    "case, message",
    [
        ("no scale", f"quantized tensor '{KV_A}' (F8_E4M3) has no '{KV_A}_scale_inv'"),
        ("scale shape", f"scale '{KV_A}_scale_inv' is F32 (2, 4), not a float of shape (3, 4)"),
        ("method", 'quantization_config.quant_method "gptq" is not supported'),
        ("block size", "quantization_config.weight_block_size: [8] is not two ints >= 1"),
    ],
)
def test_a_bad_fp8_checkpoint_is_refused_in_one_line_naming_tensor_and_file(
    tmp_path, case, message
):
    scale = KV_A + "_scale_inv"
    edits = {
        "no scale": (lambda t: t.pop(scale), lambda c: None),
        "scale shape": (lambda t: t.update({scale: t[scale][:2]}), lambda c: None),
        "method": (lambda t: None, lambda c: c["quantization_config"].update(quant_method="gptq")),
        "block size": (
            lambda t: None,
            lambda c: c["quantization_config"].update(weight_block_size=[8]),
        ),
    }
    path = _copy_fp8(tmp_path, *edits[case])
    with pytest.raises(CheckpointError) as raised:
        from_pretrained(path, max_seq_len=32)
    text = str(raised.value)
    assert message in text and str(path) in text and "\n" not in text


def test_a_loaded_model_is_written_back_as_transformers_wrote_it(tmp_path, model):
    same = save_pretrained(model, tmp_path / "same")
    written = json.loads((same / "config.json").read_text())
    theirs = json.loads((FLOAT / "config.json").read_text())
    assert written == theirs | {"num_nextn_predict_layers": 0}  # mmnnx writes no MTP layer
    ours = dict(nnx.to_flat_state(nnx.state(model)))
    again = dict(nnx.to_flat_state(nnx.state(from_pretrained(same, max_seq_len=32))))
    assert sorted(ours) == sorted(again)
    for path, value in ours.items():
        np.testing.assert_array_equal(value.get_value(), again[path].get_value())


def _verdict():
    return json.loads((FLOAT / "saves_verdict.json").read_text())


def save_saves(root: pathlib.Path, logits: bool = True) -> dict[str, pathlib.Path]:
    """What the fixture script's ``--check`` gives transformers 5: the float fixture re-saved in
    bfloat16, the FP8 one re-saved (dequantized, float32) and (``*-quantized``) in FP8 again,
    and the float one saved in FP8 blocks of 4 (every block whole); with ``logits``, beside each
    ``<case>.npy``: mmnnx's logits for the fixtures' tokens from the files it wrote."""
    fp8 = from_pretrained(FP8)
    out = {
        "deepseek-bf16": save_pretrained(
            from_pretrained(FLOAT), root / "deepseek-bf16", dtype=jnp.bfloat16
        ),
        "deepseek-from-fp8": save_pretrained(fp8, root / "deepseek-from-fp8"),
        "deepseek-fp8-saved-quantized": save_pretrained(
            fp8, root / "deepseek-fp8-saved-quantized", quantized=True
        ),
        "deepseek-blocks-of-4-quantized": save_pretrained(
            from_pretrained(FLOAT),
            root / "deepseek-blocks-of-4-quantized",
            quantized=json.loads((FP8 / "config.json").read_text())["quantization_config"]
            | {"weight_block_size": [4, 4]},
        ),
    }
    for case, path in out.items() if logits else ():
        np.save(root / f"{case}.npy", np.asarray(from_pretrained(path)(TOKENS)))
    return out


def test_transformers_reads_what_save_pretrained_writes(tmp_path):
    """make_deepseek_fixtures.py --check loaded what ``save_saves`` writes in transformers 5:
    logits equal, FP8 in blocks of 4 too; FP8 in the fixture's blocks of 8 (partial edge
    blocks, as DeepSeek-V3 publishes) is refused by transformers' CPU dequantizer exactly as
    the fixture itself is (``Weight shape (20, 32) not divisible by scale grid (3, 4)``)."""
    verdict = _verdict()
    written = save_saves(tmp_path, logits=False)
    published = verdict["cases"].pop("fixture-fp8")["load_errors"]
    assert published == ["Weight shape (20, 32) not divisible by scale grid (3, 4)."]
    assert sorted(verdict["cases"]) == sorted(written)
    for case, seen in verdict["cases"].items():
        config = json.loads((written[case] / "config.json").read_text())
        assert config == seen["config"], case
        assert ("quantization_config" in config) == case.endswith("-quantized"), case
        if case == "deepseek-fp8-saved-quantized":
            assert seen["load_errors"] == published
            continue
        assert seen["logits_error"] < F32 and seen["dtype"] == config["dtype"], case


def test_kimi_k2_reads_as_deepseek_v3_and_its_tiktoken_tokenizer_is_refused(tmp_path):
    kimi = tmp_path / "kimi"
    shutil.copytree(FLOAT, kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))
    assert pretrained_config(kimi) == pretrained_config(FLOAT)
    (kimi / "tiktoken.model").write_text("IQ== 0\n")
    with pytest.raises(ValueError, match="tiktoken.model, without a tokenizer.json") as raised:
        HFTokenizer.from_file(kimi / "tokenizer.json")
    assert "TikTokenConverter" in str(raised.value) and "\n" not in str(raised.value)
    (kimi / "config.json").write_text(json.dumps(config | {"model_type": "deepseek_v2"}))
    with pytest.raises(CheckpointError, match="model_type 'deepseek_v2' is not one mmnnx reads"):
        pretrained_config(kimi)


def test_a_checkpoint_as_deepseek_publishes_it_reads_the_same(tmp_path, model):
    """transformers 4 keys (``rope_scaling`` of ``type: yarn``, top-level ``rope_theta``,
    ``torch_dtype``) and the multi-token prediction layer after the last (``model.layers.3``
    here, 61 in DeepSeek-V3), whose tensors fill nothing, as transformers ignores them."""
    published = tmp_path / "published"
    published.mkdir()
    files = CheckpointFiles(FLOAT)
    tensors = {name: files.read(name) for name in files.tensors}
    for name in ("enorm.weight", "eh_proj.weight", "self_attn.kv_b_proj.weight",
                 "mlp.experts.7.down_proj.weight", "mlp.gate.e_score_correction_bias"):  # fmt: skip
        tensors[f"model.layers.3.{name}"] = np.ones(2, np.float32)
    write_shards(published, tensors)
    config = json.loads((FLOAT / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config |= {"rope_theta": rope.pop("rope_theta"), "torch_dtype": config.pop("dtype")}
    config |= {"rope_scaling": {"type": rope.pop("rope_type"), **rope}, "topk_method": "noaux_tc"}
    (published / "config.json").write_text(json.dumps(config))
    assert pretrained_config(published) == pretrained_config(FLOAT)
    loaded = from_pretrained(published, max_seq_len=32)
    for layer in (0, 2):
        ours, theirs = loaded.blocks[layer].attn.kv_b.kernel, model.blocks[layer].attn.kv_b.kernel
        np.testing.assert_array_equal(ours[...], theirs[...])


def test_router_bias_rate_moves_each_correction_bias_against_its_load_after_a_step():
    """DeepSeek-V3's auxiliary-loss-free balancing in ``make_steps``' train step (``mm.jit``, 2
    microbatches): each layer's bias moves by rate * sign(mean load - load), the loads those of
    the step's routing (each layer's ``RouterStats`` before the step, lr 0)."""
    import optax

    from mmnnx.train.loop import TrainConfig, make_steps

    task = mm.Task("t", mesh=mm.TaskMesh(devices=[0]))
    model = from_pretrained(FLOAT, tasks=[task], max_seq_len=16, router_bias_rate=0.01)
    before = {i: model.blocks[i].mlp.correction_bias[...] for i in (1, 2)}

    @nnx.jit  # eager, each operation compiled on its own took seconds
    def routed(model, tokens):
        x, loads = model.embed(tokens), {}
        for i, block in enumerate(model.blocks):
            h = x + block.attn(block.norm1(x))
            if i in before:
                loads[i] = block.mlp.forward(block.norm2(h))[1].tokens_per_expert
            x = block(x)
        return loads

    loads = routed(model, TOKENS[:, :-1])
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    train, _ = make_steps(TrainConfig(microbatches=2))
    assert np.isfinite(float(train(model, opt, TOKENS)))
    for i, load in loads.items():
        moved = model.blocks[i].mlp.correction_bias[...] - before[i]
        expected = 0.01 * np.sign(np.mean(load) - np.asarray(load, np.float32))
        np.testing.assert_allclose(moved, expected, atol=1e-7)
        assert np.any(expected != 0)
    with pytest.raises(CheckpointError, match="router_bias_rate moves the correction biases"):
        pretrained_config(FIXTURES / "llama", router_bias_rate=0.01)
    run = RunConfig.of({"init_from": str(FLOAT), "router_bias_rate": 0.01, "seq_len": 16})
    assert model_config(run, 128).router_bias_rate == 0.01  # mmnnx train --router-bias-rate


def test_the_sequence_wise_balance_loss_is_deepseeks_and_gpt_adds_it(model):
    """``RouterStats.seq_balance`` of a layer against DeepSeek-V3's formula from the layer's own
    routing (``f_i = E / (K T)`` times a row's choices of expert ``i``, ``P_i`` the row's mean
    normalised score), and ``GPT.loss`` adding ``router_seq_aux_loss_coef`` times it (shapes of
    the first test's: its compiled ops reused)."""
    import dataclasses

    moe = model.blocks[1].mlp
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16, 32)), jnp.float32)
    _, stats = moe.forward(x)
    _, (_, indices, probs) = moe.route(x.reshape(-1, 32))
    indices, probs = np.asarray(indices).reshape(2, 16, 2), np.asarray(probs).reshape(2, 16, 8)
    expected = 0.0
    for row in range(2):
        chosen = np.bincount(indices[row].reshape(-1), minlength=8)
        expected += np.sum(chosen * 8 / (2 * 16) * probs[row].mean(axis=0)) / 2
    np.testing.assert_allclose(float(stats.seq_balance), expected, rtol=1e-6)
    tuned = from_pretrained(FLOAT, max_seq_len=32)
    tuned.config = dataclasses.replace(tuned.config, router_seq_aux_loss_coef=0.1)
    tokens = jnp.concatenate([TOKENS, TOKENS[:, :1]], axis=1)  # inputs of 16, as before
    logp, stats = tuned.next_token_log_probs(tokens)
    np.testing.assert_allclose(
        float(tuned.loss(tokens)), float(-logp.mean() + 0.1 * stats.seq_balance), rtol=1e-6
    )
    assert float(stats.seq_balance) > 0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    ],
)
def test_mscale_all_dim_beside_a_scaling_other_than_yarn_is_refused(tmp_path, rope):
    """transformers' ``yarn_apply_mscale`` squares ``mscale_all_dim``'s factor into the scores'
    scale for every ``rope_type`` but ``default`` (logits 1.0 apart on the fixture with linear
    scaling); mmnnx applies it with YaRN only, so another type beside it is refused."""
    case = tmp_path / "scaled"
    shutil.copytree(FLOAT, case)
    config = json.loads((case / "config.json").read_text())
    params = {"rope_theta": 10000.0, "mscale_all_dim": 1.0, **rope}
    (case / "config.json").write_text(json.dumps(config | {"rope_parameters": params}))
    refused = r"rope_parameters\.mscale_all_dim: 1\.0 with rope_type"
    with pytest.raises(CheckpointError, match=refused):
        pretrained_config(case)
    del params["mscale_all_dim"]  # without it, the same scaling reads
    (case / "config.json").write_text(json.dumps(config | {"rope_parameters": params}))
    assert pretrained_config(case).block_configs[0].attention.rope.scaling is not None


def test_a_yarn_attention_factor_of_0_is_refused_not_read_as_absent(tmp_path):
    """transformers computes YaRN's attention factor only when ``attention_factor`` is ``None``
    (a 0 zeroes every rotated query and key); mmnnx read a 0 as absent and used the computed
    factor, silently: it is refused naming the key."""
    case = tmp_path / "yarn"
    shutil.copytree(FLOAT, case)
    config = json.loads((case / "config.json").read_text())
    params = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "attention_factor": 0}
    params["original_max_position_embeddings"] = 8
    (case / "config.json").write_text(json.dumps(config | {"rope_parameters": params}))
    with pytest.raises(CheckpointError, match=r"rope_parameters\.attention_factor: 0"):
        pretrained_config(case)
    params["attention_factor"] = 0.5
    (case / "config.json").write_text(json.dumps(config | {"rope_parameters": params}))
    scaling = pretrained_config(case).block_configs[0].attention.rope.scaling
    assert scaling.attention_scale == 0.5


def test_a_latent_attention_model_is_refused_by_every_family_without_it(tmp_path):
    # a Llama's, Qwen3's, Mistral's or Gemma 3's files hold multi-head attention only: saving a
    # model of latent attention as one raised AttributeError / TypeError from the family's
    # config writer, or named a Variable no tensor rule writes
    from mmnnx.models import GPT, GPTConfig
    from mmnnx.models.pretrained.families import FAMILIES
    from mmnnx.modules import BlockConfig, LatentAttentionConfig, MLPConfig

    latent = LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8)  # fmt: skip
    layer = BlockConfig(latent, MLPConfig(64, gated=True, bias=False))
    config = GPTConfig(dim=32, depth=2, num_heads=2, vocab_size=64, layers=(layer, layer))
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    for name in FAMILIES:
        if name in ("DeepseekV3ForCausalLM", "GptOssForCausalLM"):
            continue  # DeepSeek-V3 holds it; gpt-oss names its attention's biases and sinks
        with pytest.raises(CheckpointError, match=f"{name} checkpoint cannot hold .*an "
                           "attention other than AttentionConfig"):  # fmt: skip
            save_pretrained(model, tmp_path / name, architecture=name)
    assert not list(tmp_path.iterdir())


def test_deepseek_v3_refuses_what_its_files_cannot_say():
    # each was saved and loaded back as another model (logits off by 0.8-4.3)
    from mmnnx.models import GPTConfig
    from mmnnx.models.pretrained.families.deepseek import DEEPSEEK_V3
    from mmnnx.modules import BlockConfig, LatentAttentionConfig, MLPConfig, NormConfig

    latent = LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8)  # fmt: skip
    mlp = MLPConfig(64, gated=True, bias=False)

    def refused(layer=None, **model):
        layer = layer or BlockConfig(latent, mlp)
        config = GPTConfig(dim=32, depth=2, num_heads=2, layers=(layer, layer), **model)
        return DEEPSEEK_V3.cannot_hold(config)

    assert refused() == []
    gelu = MLPConfig(64, gated=True, bias=False, activation="gelu_pytorch_tanh")
    assert refused(BlockConfig(latent, gelu)) == ["a non-SiLU MLP (DeepseekV3ForCausalLM)"]
    gemma = ["Gemma's (1 + weight) norms (DeepseekV3ForCausalLM: none)"]
    assert refused(BlockConfig(latent, mlp, NormConfig(scale_offset=1.0))) == gemma
    assert refused(final_norm=NormConfig(scale_offset=1.0)) == gemma
    assert refused(embed_scale=2.0) == ["scaled embeddings (DeepseekV3ForCausalLM: unscaled)"]
    assert refused(BlockConfig(latent, mlp, post_norms=True)) == [
        "norms after attention and MLP (DeepseekV3ForCausalLM: none)"
    ]
