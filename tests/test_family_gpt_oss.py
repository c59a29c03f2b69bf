"""gpt-oss (``GptOssForCausalLM``) against transformers 5: its fixtures (written by
tests/transformers_fixtures/make_gpt_oss_fixtures.py) read in float32 and in the published
MXFP4 layout, decoded with the cache, packed, pipelined and written back."""

import dataclasses
import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import mmnnx as mm
from mmnnx.models import from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained.families.gpt_oss import GPT_OSS
from mmnnx.models.pretrained.families.llama import LLAMA
from mmnnx.models.pretrained.files import CheckpointFiles
from mmnnx.modules import ClampedMoEConfig, Packing, YarnScaling
from tests.test_pretrained_moe import ep_stages
from tests.test_transformers_fixtures import F32, FIXTURES, TOKENS, relative_error

FLOAT, MXFP4 = FIXTURES / "gpt-oss", FIXTURES / "gpt-oss-mxfp4"
_logits = nnx.jit(lambda model, tokens: model(tokens))
_packed = nnx.jit(lambda model, tokens, packing: model(tokens, packing))


def _ep_tp_stages() -> list[mm.Task]:
    """Two pipeline stages, each a 2 x 2 ``expert x model`` mesh: 2 experts a device, each
    expert's hidden features and the attention heads (and their sinks) split over ``model``."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "expert", "model"))
    rules = mm.logical_rules(expert="expert", mlp="model", heads="model")
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=rules) for i in range(2)]


def _config(path: pathlib.Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_gpt_oss_equals_transformers_on_one_device_packed_and_on_stages():
    """Logits equal transformers' (sinks, biases, sliding then full layers, YaRN, the clamped
    SwiGLU of biased experts); two examples packed in a row give each one's logits; two
    pipeline stages whose experts and their hidden features and attention heads are split give
    the same logits. (Greedy decoding from the cache: tests/test_family_conformance.py.)"""
    theirs = np.load(FLOAT / "logits.npy")
    model = from_pretrained(FLOAT, max_seq_len=32)
    blocks = model.config.block_configs
    assert [b.attention.sliding_window for b in blocks] == [4, None]
    assert all(b.attention.sinks and b.attention.bias for b in blocks)
    rope = blocks[0].attention.rope
    assert rope.theta == 150000.0
    assert rope.scaling == YarnScaling(32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
    assert blocks[0].feed_forward == ClampedMoEConfig(32, 4, 2, alpha=1.702, limit=1.0)
    tokens = jnp.asarray(TOKENS)
    assert relative_error(_logits(model, tokens), theirs) < F32

    cut = 6  # row 0's first 6 tokens, then row 1's first 10, as two examples of one row
    row = jnp.concatenate([tokens[:1, :cut], tokens[1:, : 16 - cut]], axis=1)
    segments = jnp.asarray([[1] * cut + [2] * (16 - cut)])
    positions = jnp.asarray([list(range(cut)) + list(range(16 - cut))])
    packed = _packed(model, row, Packing(segments, positions))
    assert relative_error(packed[0, :cut], theirs[0, :cut]) < F32
    assert relative_error(packed[0, cut:], theirs[1, : 16 - cut]) < F32

    staged = from_pretrained(FLOAT, tasks=_ep_tp_stages(), max_seq_len=32)
    gate_up = staged.blocks[1].mlp.experts.gate_up
    assert mm.task_of(gate_up).name == "s1"
    assert {s.data.shape for s in gate_up[...].addressable_shards} == {(2, 32, 32)}
    assert {s.data.shape for s in staged.blocks[1].attn.sinks[...].addressable_shards} == {(2,)}
    logits = mm.jit(lambda m, t: m(t))(staged, tokens)
    assert relative_error(logits, theirs) < F32


def test_mxfp4_as_published_equals_transformers_dequantized(tmp_path):
    """The experts' ``*_blocks`` / ``*_scales`` read by slices (two experts a device) give
    transformers' logits of the same files; written back, they are float tensors of the fused
    names under a config without ``quantization_config``."""
    theirs = np.load(MXFP4 / "logits.npy")
    staged = from_pretrained(MXFP4, tasks=ep_stages(), max_seq_len=32)
    logits = mm.jit(lambda m, t: m(t))(staged, jnp.asarray(TOKENS))
    assert relative_error(logits, theirs) < F32
    assert relative_error(logits, np.load(FLOAT / "logits.npy")) > 100 * F32  # it was quantized
    out = save_pretrained(staged, tmp_path / "bf16", dtype=jnp.bfloat16)
    config = _config(out)
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert {k: v for k, v in config.items() if k not in ("dtype",)} == {
        k: v for k, v in _config(MXFP4).items() if k not in ("dtype", "quantization_config")
    }
    files = CheckpointFiles(out)
    assert sorted(files.tensors) == sorted(CheckpointFiles(FLOAT).tensors)
    assert files.tensors["model.layers.0.mlp.experts.gate_up_proj"].dtype == "BF16"


def _quantized_copy(tmp_path: pathlib.Path, edit) -> pathlib.Path:
    path = shutil.copytree(MXFP4, tmp_path / "edited")
    tensors = load_file(path / "model.safetensors")
    config = _config(path)
    edit(tensors, config)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


_E = "model.layers.1.mlp.experts"


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t, c: t.pop(f"{_E}.down_proj_scales"),
            f"MXFP4 blocks '{_E}.down_proj_blocks' have no scales '{_E}.down_proj_scales'",
        ),
        (
            lambda t, c: t.update({f"{_E}.down_proj_scales": t[f"{_E}.down_proj_scales"][:, :8]}),
            rf"MXFP4 scales '{_E}.down_proj_scales' are U8 \(4, 8, 1\), not uint8 of shape "
            rf"\(4, 32, 1\)",
        ),
        (
            lambda t, c: t.update({f"{_E}.down_proj_blocks": t[f"{_E}.down_proj_blocks"][..., :8]}),
            f"MXFP4 blocks '{_E}.down_proj_blocks' are U8 \\(4, 32, 1, 8\\), not uint8 of shape",
        ),
        (
            lambda t, c: t.pop(f"{_E}.gate_up_proj_blocks"),
            f"scales '{_E}.gate_up_proj_scales' have no blocks '{_E}.gate_up_proj_blocks'",
        ),
        (
            lambda t, c: c.update(quantization_config={"quant_method": "gptq"}),
            'quantization_config.quant_method "gptq" is not supported \\(only "fp8", "mxfp4"\\)',
        ),
    ],
    ids=["no-scales", "scales-shape", "blocks-shape", "no-blocks", "quant-method"],
)
def test_bad_quantized_input_is_refused_naming_tensor_and_file(tmp_path, edit, message):
    path = _quantized_copy(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_loaded_model_is_written_back_as_transformers_wrote_it(tmp_path):
    model = from_pretrained(FLOAT, max_seq_len=32)
    same = save_pretrained(model, tmp_path / "same")
    assert _config(same) == _config(FLOAT)
    assert sorted(CheckpointFiles(same).tensors) == sorted(CheckpointFiles(FLOAT).tensors)
    assert GPT_OSS.cannot_hold(model.config) == []
    assert LLAMA.cannot_hold(model.config)  # a Llama's files cannot hold it


def test_transformers_reads_what_save_pretrained_writes(tmp_path):
    """make_gpt_oss_fixtures.py --check loaded the checkpoints ``save_saves`` writes in
    transformers 5: every tensor, none left over, its layer types, logits equal."""
    verdict = json.loads((FIXTURES / "gpt_oss_verdict.json").read_text())
    written = save_saves(tmp_path, logits=False)
    assert sorted(verdict["cases"]) == sorted(written)
    for case, seen in verdict["cases"].items():
        config = _config(written[case])
        assert config == seen["config"], case
        assert seen["missing"] == seen["unexpected"] == seen["mismatched"] == [], case
        assert seen["class"] == "GptOssForCausalLM", case
        assert seen["layer_types"] == config["layer_types"], case
        assert seen["logits_error"] < F32, case


def save_saves(root: pathlib.Path, logits: bool = True) -> dict[str, pathlib.Path]:
    """The checkpoints make_gpt_oss_fixtures.py --check gives transformers 5: the float
    fixture re-saved in float32 and in MXFP4, the MXFP4 one in bfloat16 and in MXFP4 again;
    beside each (with ``logits``), ``<case>.npy``: mmnnx's float32 logits for :data:`TOKENS`
    from the files it wrote."""
    mxfp4 = from_pretrained(MXFP4)
    out = {
        "gpt-oss-f32": save_pretrained(from_pretrained(FLOAT), root / "gpt-oss-f32"),
        "gpt-oss-f32-mxfp4": save_pretrained(
            from_pretrained(FLOAT), root / "gpt-oss-f32-mxfp4", quantized={"quant_method": "mxfp4"}
        ),
        "gpt-oss-mxfp4-bf16": save_pretrained(
            mxfp4, root / "gpt-oss-mxfp4-bf16", dtype=jnp.bfloat16
        ),
        "gpt-oss-mxfp4-again-mxfp4": save_pretrained(
            mxfp4, root / "gpt-oss-mxfp4-again-mxfp4", quantized=True
        ),
    }
    for case, path in out.items() if logits else ():
        np.save(root / f"{case}.npy", np.asarray(from_pretrained(path)(jnp.asarray(TOKENS))))
    return out


def test_gpt_oss_config_keys_are_checked(tmp_path):
    path = shutil.copytree(FLOAT, tmp_path / "edited")
    for edit, message in (
        ({"swiglu_limit": 0}, "swiglu_limit: 0 is not a finite number > 0"),
        ({"attention_bias": False}, "attention_bias: false is not supported"),
        ({"sliding_window": None}, "sliding_window: null, but layer_types has"),
        ({"layer_types": ["chunked_attention", "full_attention"]}, "chunked_attention"),
    ):
        (path / "config.json").write_text(json.dumps(_config(FLOAT) | edit))
        with pytest.raises(CheckpointError, match=message) as error:
            pretrained_config(path)
        assert f"{path}/config.json" in str(error.value)
    published = _config(FLOAT)  # transformers 4's spelling, as openai/gpt-oss-20b has it
    rope = published.pop("rope_parameters")
    published |= {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"},
                  "rope_theta": rope["rope_theta"], "experts_per_token": 2}  # fmt: skip
    del published["num_experts_per_tok"], published["layer_types"]
    (path / "config.json").write_text(json.dumps(published))
    assert pretrained_config(path) == pretrained_config(FLOAT)


def test_a_model_built_here_saves_the_norm_epsilon_it_computes_with(tmp_path):
    # gpt-oss's config.json was written with rms_norm_eps 1e-5 for norms left at RMSNorm's
    # 1e-6: the checkpoint loaded as another model (logits off by 1.36 here)
    from mmnnx.models import GPT, GPTConfig
    from mmnnx.modules import AttentionConfig, BlockConfig, NormConfig

    attention = AttentionConfig(2, num_kv_heads=1, head_dim=16, bias=True, sinks=True)
    layer = BlockConfig(attention, ClampedMoEConfig(32, 4, top_k=2))
    config = GPTConfig(dim=32, depth=2, num_heads=2, num_kv_heads=1, vocab_size=64,
                       max_seq_len=16, layers=(layer, layer))  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    tokens = jnp.arange(12)[None] % 64
    out = save_pretrained(model, tmp_path / "m", architecture="GptOssForCausalLM")
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-6
    np.testing.assert_array_equal(from_pretrained(out)(tokens), model(tokens))
    # norms of two epsilons: one rms_norm_eps cannot hold them, refused before writing
    other = BlockConfig(attention, layer.feed_forward, NormConfig(eps=1e-5))
    with nnx.use_eager_sharding(False):
        mixed = GPT(dataclasses.replace(config, layers=(other, other)), rngs=nnx.Rngs(0))
    with pytest.raises(CheckpointError, match=r"norms of different epsilons \[1e-06, 1e-05\]"):
        save_pretrained(mixed, tmp_path / "mixed", architecture="GptOssForCausalLM")
    assert not (tmp_path / "mixed").exists()


def test_a_model_of_full_attention_alone_is_written_with_a_window(tmp_path):
    """transformers' gpt-oss builds its sliding mask whether or not a layer slides, and raises
    "Could not find a `sliding_window` argument in the config" without one: a model whose
    layers all attend fully is written with the loaded file's window (GptOssConfig's default
    where none was loaded), not ``null``."""
    full = tmp_path / "full"
    shutil.copytree(FIXTURES / "deep" / "gpt-oss", full)
    config = json.loads((full / "config.json").read_text())
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    (full / "config.json").write_text(json.dumps(config))
    model = from_pretrained(full)
    assert {b.attention.sliding_window for b in model.config.block_configs} == {None}
    written = json.loads((save_pretrained(model, tmp_path / "out") / "config.json").read_text())
    assert written["layer_types"] == config["layer_types"]
    assert written["sliding_window"] == config["sliding_window"] == 4
    hf = GPT_OSS.hf_config(model.config, "float32")  # no file loaded
    assert hf["sliding_window"] == 128
