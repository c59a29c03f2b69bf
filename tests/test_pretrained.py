"""``mm.models.from_pretrained`` / ``save_pretrained`` on tiny random checkpoints in the Hugging
Face layout (tests/hf_checkpoints.py), against implementations the project did not write:
jax-ml/bonsai's Qwen3 and Llama 3.2 (vendored in tests/outside/) and a float64 numpy reference
written from transformers' formulas (tests/hf_reference.py)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, save_pretrained
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


@pytest.mark.parametrize("arch, stages", [(LLAMA, 2), (QWEN3, 4)])
def test_pipelined_logits_and_loss_equal_one_device(checkpoints, arch, stages):
    path = checkpoints[arch, False, "float32"]
    model = from_pretrained(path, tasks=_tasks(stages))
    homes = {mm.task_of(v).name for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    assert homes == {f"s{i}" for i in range(stages)}
    assert mm.task_of(model.embed.embedding).name == "s0"
    assert mm.task_of(model.head.kernel).name == f"s{stages - 1}"
    logits = mm.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS))
    _close(logits, OUTSIDE[arch].outside_logits(path, TOKENS))
    one = from_pretrained(path)
    batch = jnp.asarray(np.concatenate([TOKENS, TOKENS[:, :1]], axis=1))
    loss = mm.jit(lambda m, b: m.loss(b))(model, batch)
    np.testing.assert_allclose(float(loss), float(one.loss(batch)), rtol=1e-5)


def test_scan_layers_and_bfloat16_parameters(checkpoints):
    path = checkpoints[QWEN3, True, "bfloat16"]
    scanned = from_pretrained(path, scan_layers=True, tasks=_tasks(2))
    assert scanned.blocks.attn.q.kernel.shape[0] == 4  # one stacked Variable per parameter
    assert mm.stack_of(scanned.blocks.attn.q.kernel).name == "s0+s1"
    logits = mm.jit(lambda m, t: m(t))(scanned, jnp.asarray(TOKENS))
    _close(logits, bonsai_qwen3.outside_logits(path, TOKENS))
    half = from_pretrained(path, param_dtype=jnp.bfloat16)
    assert half.blocks[0].mlp.up.kernel[...].dtype == jnp.bfloat16
    raw = CheckpointFiles(path).read("model.layers.0.mlp.up_proj.weight")
    np.testing.assert_array_equal(np.asarray(half.blocks[0].mlp.up.kernel[...]), raw.T)


def test_generate_on_stages_equals_one_device(checkpoints):
    path = checkpoints[LLAMA, True, "float32"]
    prompt = jnp.asarray(TOKENS[:1, :5])
    placed = from_pretrained(path, tasks=_tasks(2), max_seq_len=16)
    one = from_pretrained(path, max_seq_len=16)
    tokens = placed.generate(prompt, 6)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(one.generate(prompt, 6)))
    # greedy: each token is the argmax of the full-sequence logits of what came before
    seq = np.asarray(prompt)
    for t in np.asarray(tokens)[0]:
        assert t == int(np.argmax(reference_logits(path, seq)[0, -1]))
        seq = np.concatenate([seq, [[t]]], axis=1)


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
    original = json.loads((source / "config.json").read_text())
    assert {k: config[k] for k in original} == original
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
            dict(config={"architectures": ["MistralForCausalLM"]}),
            "MistralForCausalLM is not supported; mmnnx builds LlamaForCausalLM, Qwen3ForCausalLM",
        ),
        (dict(config={"hidden_act": "gelu"}), "hidden_act='gelu' is not supported"),
        (dict(config={"mlp_bias": True}), "mlp_bias=True is not supported"),
        (
            dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
            "rope_scaling of type 'yarn'",
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
