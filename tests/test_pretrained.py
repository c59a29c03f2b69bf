"""``mm.models.from_pretrained`` / ``save_pretrained`` on tiny random checkpoints in the Hugging
Face layout (tests/hf_checkpoints.py), against implementations the project did not write:
jax-ml/bonsai's Qwen3 and Llama 3.2 (vendored in tests/outside/) and a float64 numpy reference
written from transformers' formulas (tests/hf_reference.py)."""

import dataclasses
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig, from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained.files import CheckpointFiles
from mmnnx.modules import MLPConfig
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.outside import bonsai_llama, bonsai_qwen3

TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
LLAMA, QWEN3 = "LlamaForCausalLM", "Qwen3ForCausalLM"
OUTSIDE = {LLAMA: bonsai_llama, QWEN3: bonsai_qwen3}


def _tasks(n):
    per = 8 // n
    return [
        mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(per * i, per * (i + 1)))) for i in range(n)
    ]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        (arch, tied, dtype): write_checkpoint(
            root / f"{arch}-{tied}-{dtype}", architecture=arch, tied=tied, dtype=dtype
        )
        for arch in (LLAMA, QWEN3)
        for tied in (False, True)
        for dtype in ("float32", "bfloat16")
    }


def _close(ours, theirs, rtol=1e-5):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= rtol * scale, np.abs(ours - theirs).max() / scale


@pytest.mark.parametrize("arch", [LLAMA, QWEN3])
@pytest.mark.parametrize("tied, dtype", [(False, "float32"), (True, "bfloat16")])
def test_one_device_logits_equal_outside_implementations(checkpoints, arch, tied, dtype):
    path = checkpoints[arch, tied, dtype]
    model = from_pretrained(path)
    logits = model(jnp.asarray(TOKENS))
    assert logits.shape == (2, 8, json.loads((path / "config.json").read_text())["vocab_size"])
    _close(logits, OUTSIDE[arch].outside_logits(path, TOKENS))
    _close(logits, reference_logits(path, TOKENS))
    assert model.pretrained.architecture == arch
    layers = model.config.layers  # the family's nested component configs, one per layer
    assert len(layers) == model.config.depth and layers[0].attention.qk_norm == (arch == QWEN3)
    assert layers[0].feed_forward == MLPConfig(
        layers[0].feed_forward.hidden, gated=True, bias=False
    )


def test_bfloat16_parameters(checkpoints):
    """(Pipelined, scanned and staged decoding: tests/test_family_conformance.py, against
    transformers.)"""
    path = checkpoints[QWEN3, True, "bfloat16"]
    half = from_pretrained(path, param_dtype=jnp.bfloat16)
    assert half.blocks[0].mlp.up.kernel[...].dtype == jnp.bfloat16
    raw = CheckpointFiles(path).read("model.layers.0.mlp.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(half.blocks[0].mlp.up.kernel[...]), raw.T)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_then_save_is_bit_exact(checkpoints, tmp_path, dtype):
    source = checkpoints[QWEN3, False, dtype]
    model = from_pretrained(source, tasks=_tasks(2), param_dtype=dtype)
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=20_000)
    before, after = CheckpointFiles(source), CheckpointFiles(out)
    assert sorted(before.tensors) == sorted(after.tensors)
    assert len({i.file for i in after.tensors.values()}) > 2  # sharded, with an index
    for name, info in before.tensors.items():
        assert after.tensors[name].dtype == info.dtype
        np.testing.assert_array_equal(after.read(name), before.read(name))
    config = json.loads((out / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())  # transformers 4's keys
    old = {"torch_dtype", "rope_theta", "rope_scaling"}  # written as transformers 5 writes them
    assert {k: config[k] for k in original if k not in old} == {
        k: v for k, v in original.items() if k not in old
    }
    assert not old & set(config)
    assert config["dtype"] == original["torch_dtype"] == dtype
    rope = {"rope_theta": original["rope_theta"], "rope_type": "default"}
    assert config["rope_parameters"] == rope
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    again = from_pretrained(out)
    _close(again(jnp.asarray(TOKENS)), reference_logits(source, TOKENS))


def test_a_tied_checkpoint_that_also_stores_the_head(checkpoints, tmp_path):
    source = checkpoints[LLAMA, True, "float32"]
    model = from_pretrained(source)
    out = save_pretrained(model, tmp_path / "tied")
    assert "lm_head.weight" not in CheckpointFiles(out).tensors


def _edit(source, tmp_path, *, config=None, drop=None, add=None, change=None):
    import shutil

    from mmnnx.models.pretrained.files import write_shards

    target = tmp_path / "edited"
    shutil.copytree(source, target)
    if config:
        hf = json.loads((target / "config.json").read_text())
        hf.update(config)
        (target / "config.json").write_text(json.dumps(hf))
    if drop or add or change:
        files = CheckpointFiles(target)
        tensors = {n: files.read(n) for n in files.tensors}
        tensors.pop(drop, None)
        tensors.update(add or {})
        tensors.update(change or {})
        for p in list(target.glob("*.safetensors")) + [target / "model.safetensors.index.json"]:
            p.unlink()
        write_shards(target, tensors)
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            dict(config={"architectures": ["FalconForCausalLM"]}),
            "FalconForCausalLM is not supported; mmnnx builds LlamaForCausalLM, Qwen3ForCausalLM",
        ),
        (
            dict(config={"model_type": "falcon"}),  # transformers would build a Falcon from it
            "model_type 'falcon' is not one mmnnx reads as LlamaForCausalLM \\(llama\\)",
        ),
        (
            dict(config={"architectures": [], "model_type": "falcon"}),
            "architecture \\(none given; model_type 'falcon'\\) is not supported",
        ),
        (dict(config={"hidden_act": "gelu"}), "hidden_act='gelu' is not supported"),
        (dict(config={"mlp_bias": True}), "mlp_bias=True is not supported"),
        (
            dict(config={"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}),
            """rope_scaling: rope_type "longrope" is not supported""",
        ),
        (
            dict(drop="model.layers.2.mlp.up_proj.weight"),
            r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'",
        ),
        (
            dict(add={"model.layers.0.mlp.extra.weight": np.zeros(2, np.float32)}),
            r"tensor 'model\.layers\.0\.mlp\.extra\.weight' fills no",
        ),
        (
            dict(config={"intermediate_size": 96}),
            r"tensor 'model\.layers\.\d\.mlp\.\w+_proj\.weight' has shape \((128, 64|64, 128)\)",
        ),
        (dict(config={"num_hidden_layers": 3}), r"tensor 'model\.layers\.3\..*' fills no"),
        (
            dict(config={"vocab_size": 200}),
            r"tokenizer's vocabulary has 376 tokens, more than the model's vocab_size 200",
        ),
    ],
)
def test_bad_checkpoints_fail_before_anything_is_placed(checkpoints, tmp_path, edit, message):
    path = _edit(checkpoints[LLAMA, False, "float32"], tmp_path, **edit)
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(path, tasks=_tasks(2))
    assert str(path) in str(error.value)


def test_a_config_without_architectures_is_read_by_its_model_type(checkpoints, tmp_path):
    # as transformers' AutoModelForCausalLM does: it picks the model by model_type
    source = checkpoints[QWEN3, False, "float32"]
    path = _edit(source, tmp_path, config={"architectures": None})
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    ours = from_pretrained(path, max_seq_len=16)(tokens)
    np.testing.assert_array_equal(ours, from_pretrained(source, max_seq_len=16)(tokens))


def test_no_safetensors_and_no_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [LLAMA]}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        from_pretrained(tmp_path / "missing")


def test_save_pretrained_needs_an_architecture_and_a_dtype_safetensors_holds(tmp_path):
    from mmnnx.models import GPT, GPTConfig

    with nnx.use_eager_sharding(False):
        model = GPT(
            GPTConfig(dim=32, depth=1, vocab_size=64, gated_mlp=True, mlp_bias=False),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(CheckpointError, match="name the model's architecture"):
        save_pretrained(model, tmp_path / "a")
    with pytest.raises(CheckpointError, match="written in float32, bfloat16"):
        save_pretrained(model, tmp_path / "b", architecture=LLAMA, dtype=jnp.int8)
    with pytest.raises(CheckpointError, match="Qwen3ForCausalLM checkpoint cannot hold no query"):
        save_pretrained(model, tmp_path / "c", architecture="Qwen3ForCausalLM")
    assert not list(tmp_path.iterdir())


def test_a_save_failing_as_it_renames_into_place_keeps_the_earlier_one(
    checkpoints, tmp_path, monkeypatch
):
    import pathlib

    model = from_pretrained(checkpoints[LLAMA, False, "float32"])
    out = save_pretrained(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    rename = pathlib.Path.rename

    def failing(self, target):
        if self.name.endswith(".partial"):
            raise OSError(f"cannot rename {self}")
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", failing)
    with pytest.raises(OSError, match="cannot rename"):
        save_pretrained(model, out, dtype=jnp.bfloat16, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging, no old copy


FIXTURE = pathlib.Path(__file__).parent / "transformers_fixtures" / "llama"  # transformers 5's
FIXTURE_TOKENS = json.loads((FIXTURE.parent / "versions.json").read_text())["tokens"]
SCALED = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _llama(tmp_path, edit=None, *, raw=None, file="config.json"):
    """The transformers 5 Llama fixture with ``edit`` merged into its ``config.json`` (a key
    mapped to ``None`` removed), or ``raw`` text as ``file``."""
    import shutil

    target = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, target)
    if raw is not None:
        (target / file).write_text(raw)
    if edit is not None:
        hf = json.loads((target / "config.json").read_text()) | edit
        (target / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v != ...}))
    return target


@pytest.mark.parametrize(
    "edit, raw, message",
    [
        (
            {"hidden_size": "32"},
            None,
            r'config\.json \(LlamaForCausalLM\): hidden_size: "32" is not an int >= 1',
        ),
        ({"hidden_size": -32}, None, "hidden_size: -32 is not an int >= 1"),
        ({"hidden_size": 32.0}, None, "hidden_size: 32.0 is not an int >= 1"),
        ({"rms_norm_eps": "abc"}, None, 'rms_norm_eps: "abc" is not a finite number > 0'),
        ({"num_key_value_heads": 0}, None, "num_key_value_heads: 0 is not an int >= 1"),
        (
            {"num_key_value_heads": 3},
            None,
            "num_attention_heads: 4 is not a multiple of num_key_value_heads 3",
        ),
        ({"max_position_embeddings": 0}, None, "max_position_embeddings: 0 is not an int >= 1"),
        ({"tie_word_embeddings": "no"}, None, 'tie_word_embeddings: "no" is not true or false'),
        ({"dtype": "float99"}, None, 'dtype: "float99" is not one of "float32"'),
        ({"torch_dtype": 32, "dtype": ...}, None, "torch_dtype: 32 is not one of"),
        ({"rope_scaling": "abc"}, None, 'rope_scaling: "abc" is not an object'),
        ({"rope_parameters": ["abc"]}, None, 'rope_parameters: \\["abc"\\] is not an object'),
        (
            {"rope_parameters": SCALED},
            None,
            "rope_parameters: no 'factor' \\(rope_type 'llama3' needs it\\)",
        ),
        ({"rope_scaling": SCALED}, None, "rope_scaling: no 'factor'"),
        ({"rope_parameters": SCALED | {"factor": "8"}}, None, 'rope_parameters.factor: "8" is not'),
        (
            {"rope_parameters": SCALED | {"factor": 8, "high_freq_factor": 0.5}},
            None,
            "high_freq_factor: 0.5 is not greater than low_freq_factor",
        ),
        (
            {"rope_parameters": {"rope_theta": -1}},
            None,
            "rope_parameters.rope_theta: -1 is not a finite number > 0",
        ),
        (
            {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            None,
            "partial_rotary_factor: 0.5 is not supported",
        ),
        ({"layer_types": ["full_attention"]}, None, "layer_types: 1 entries, not one per layer"),
        (
            {"layer_types": "full_attention"},
            None,
            'layer_types: "full_attention" is not a list of strings',
        ),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            None,
            "layer_types=.* is not supported",
        ),
        (
            {"architectures": "LlamaForCausalLM"},
            None,
            'architectures: "LlamaForCausalLM" is not a list of strings',
        ),
        ({"attention_bias": "false"}, None, 'attention_bias: "false" is not true or false'),
        ({"vocab_size": None}, None, "no 'vocab_size'"),
        (None, "[1, 2]", "config.json: holds a JSON list, not an object of config keys"),
        (None, "{'hidden_size': 32}", "config.json: not JSON: Expecting property name"),
        (None, "", "config.json: not JSON: Expecting value"),
    ],
)
def test_config_values_are_checked_before_anything_is_built(tmp_path, edit, raw, message):
    path = _llama(tmp_path, edit, raw=raw)
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(path, tasks=_tasks(2))
    assert f"{path}/config.json" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(CheckpointError, match=message):
        pretrained_config(path)


def test_an_index_that_is_not_json(tmp_path):
    path = _llama(tmp_path, raw="weight_map = {}", file="model.safetensors.index.json")
    (path / "model.safetensors").unlink()  # else read alone, the index unread (as transformers)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not JSON") as error:
        from_pretrained(path)
    assert str(path) in str(error.value)


def test_model_safetensors_is_read_alone_beside_an_index_and_its_shards(tmp_path):
    """transformers 5 reads ``model.safetensors`` where a directory holds it, before any
    ``model.safetensors.index.json`` (the shards of an earlier save, say): mmnnx read the
    shards instead, silently other weights (logits 3.8 apart on a checkpoint of both)."""
    from mmnnx.models.pretrained.files import write_shards

    path = _llama(tmp_path)
    files = CheckpointFiles(path)
    names = sorted(files.tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": {} for i in range(2)}
    for i, name in enumerate(names):  # other weights in the shards
        shards[f"model-0000{i % 2 + 1}-of-00002.safetensors"][name] = 2 * files.read(name)
    write_shards(path, shards)
    index = {"weight_map": {n: f for f, ts in shards.items() for n in ts}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert CheckpointFiles(path).tensors == files.tensors
    logits = from_pretrained(path)(jnp.asarray(FIXTURE_TOKENS))
    _close(logits, np.load(FIXTURE / "logits.npy"))  # transformers' of model.safetensors
    (path / "model.safetensors").unlink()  # the shards alone are read through the index
    assert {i.file for i in CheckpointFiles(path).tensors.values()} == set(shards)


def test_a_tied_config_beside_a_stored_head_of_other_values_is_refused(tmp_path):
    """transformers 5.24 unties a ``tie_word_embeddings: true`` checkpoint whose stored
    ``lm_head.weight`` differs from the embedding and computes with that head (a warning says
    so); mmnnx tied it, the stored head ignored (logits 20 apart on a tiny Llama). A stored copy
    equal to the embedding is read as before."""
    from mmnnx.models.pretrained.files import write_shards

    path = _llama(tmp_path, {"tie_word_embeddings": True})  # the fixture's head is untied
    refused = "'lm_head.weight' is stored with other values than 'model.embed_tokens.weight'"
    with pytest.raises(CheckpointError, match=refused + "; transformers then unties them") as e:
        from_pretrained(path)
    assert "tie_word_embeddings to false" in str(e.value) and str(path) in str(e.value)
    files = CheckpointFiles(path)
    tensors = {n: files.read(n) for n in files.tensors}
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    write_shards(path, tensors)
    model = from_pretrained(path)
    assert model.config.tie_embeddings


def test_integer_weights_and_wrong_shapes_name_the_tensor_and_file(tmp_path):
    from mmnnx.models.pretrained.files import write_shards

    path = _llama(tmp_path)
    files = CheckpointFiles(path)
    tensors = {n: files.read(n) for n in files.tensors}
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name].astype(np.int32)
    write_shards(path, tensors)
    with pytest.raises(CheckpointError, match=f"{path}/model.safetensors: tensor '{name}' is "
                       r"stored as I32 \(int32\), not floating point, and cannot fill Variable "
                       r"'blocks/1/mlp/up/kernel' of GPT \(float32\)"):  # fmt: skip
        from_pretrained(path)
    tensors[name] = np.zeros((40, 32), np.float32)  # stored (out, in): (48, 32) expected
    write_shards(path, tensors)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \(40, 32\), not "
                       r"\(48, 32\), the shape that fills Variable 'blocks/1/mlp/up/kernel' of "
                       r"GPT \(shape \(32, 48\)\)"):  # fmt: skip
        from_pretrained(path)


def test_save_pretrained_names_a_dtype_that_is_none(tmp_path):
    model = from_pretrained(FIXTURE)
    message = "dtype 'float99' is not a dtype; Hugging Face checkpoints are written in float32"
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'out'}: {message}"):
        save_pretrained(model, tmp_path / "out", dtype="float99")
    assert not list(tmp_path.iterdir())


def test_a_loaded_checkpoint_is_written_with_its_tokenizer_and_generation_files(tmp_path):
    # issue 69: an export kept tokenizer.json alone: AutoTokenizer lost its bos/eos and
    # generate its stopping token
    base = write_checkpoint(tmp_path / "base", architecture="LlamaForCausalLM")
    carried = {
        "tokenizer_config.json": json.dumps({"bos_token": "<s>", "eos_token": "</s>"}),
        "special_tokens_map.json": json.dumps({"eos_token": "</s>"}),
        "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    for name, text in carried.items():
        (base / name).write_text(text)
    carried["generation_config.json"] = (base / "generation_config.json").read_text()
    carried["tokenizer.json"] = (base / "tokenizer.json").read_text()
    out = save_pretrained(from_pretrained(base), tmp_path / "out")
    for name, text in carried.items():
        assert (out / name).read_text() == text, name


def test_save_refuses_layers_one_config_json_cannot_describe(tmp_path):
    """config.json holds one attention, one dense MLP and one mixture for every layer: a GPT of
    per-layer configs that differ (another rope base, another MLP size) or that drop RoPE is
    refused, naming what, before anything is written (the first layer's were written)."""
    from mmnnx.modules import AttentionConfig, BlockConfig, NormConfig, RopeConfig

    attention = AttentionConfig(4, 2, 8, rope=RopeConfig(5e5, None))
    norm, mlp = NormConfig("rms", 1e-5), MLPConfig(64, gated=True, bias=False)
    other = dataclasses.replace(attention, rope=RopeConfig(1e4, None))
    cases = [
        ((BlockConfig(attention, mlp, norm), BlockConfig(other, mlp, norm)), "different attention"),
        (
            (BlockConfig(attention, mlp, norm), BlockConfig(attention, MLPConfig(32), norm)),
            "feed-forwards of different sizes",
        ),
        ((BlockConfig(dataclasses.replace(attention, rope=None), mlp, norm),) * 2, "without RoPE"),
    ]
    for layers, said in cases:
        config = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=4, num_kv_heads=2,
                           layers=layers)  # fmt: skip
        with nnx.use_eager_sharding(False):
            model = GPT(config, rngs=nnx.Rngs(0))
        with pytest.raises(CheckpointError, match=said):
            save_pretrained(model, tmp_path / "out", architecture="LlamaForCausalLM")
        assert not (tmp_path / "out").exists()
