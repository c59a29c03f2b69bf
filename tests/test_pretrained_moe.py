"""Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``) through ``from_pretrained`` / ``save_pretrained``
on tiny random checkpoints in the Hugging Face layout (tests/hf_checkpoints.py): logits against
google/tunix's Qwen3 MoE (vendored in tests/outside/) and the float64 reference
(tests/hf_reference.py) on one device, on two pipeline stages of expert-parallel meshes and
stacked; what each expert-parallel device reads; the copy written back; the checkpoints refused;
``mmnnx train --init-from`` with LoRA and ``mmnnx export``."""

import collections
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained import load as load_module
from mmnnx.models.pretrained.files import CheckpointFiles, write_shards
from mmnnx.modules import MoE
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.outside import tunix_qwen3_moe

MOE = "Qwen3MoeForCausalLM"
TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
EXPERTS = 8
RULES = mm.logical_rules(batch="data", expert="expert")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every layer MoE (float32 untied, bfloat16 tied); layer 0 dense (``mlp_only_layers``);
    every other layer MoE (``decoder_sparse_step`` 2) without renormalised weights."""
    root = tmp_path_factory.mktemp("hf-moe")
    return {
        "float32": write_checkpoint(root / "f32", architecture=MOE),
        "bfloat16": write_checkpoint(root / "bf16", architecture=MOE, tied=True, dtype="bfloat16"),
        "dense0": write_checkpoint(root / "dense0", architecture=MOE, mlp_only_layers=[0]),
        "step2": write_checkpoint(
            root / "step2", architecture=MOE, decoder_sparse_step=2, norm_topk_prob=False
        ),
    }


def _close(ours, theirs, rtol=1e-5):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= rtol * scale, np.abs(ours - theirs).max() / scale


def ep_stages():
    """Two pipeline stages, each a 2 x 2 ``expert x data`` mesh: 4 experts per device."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "expert", "data"))
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=RULES) for i in range(2)]


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_one_device_logits_equal_tunix_and_the_reference(checkpoints, kind):
    path = checkpoints[kind]
    model = from_pretrained(path)
    assert [type(b.mlp) for b in model.blocks] == [MoE] * 4
    c = model.config
    assert (c.experts, c.experts_per_token, c.expert_hidden, c.norm_topk_prob) == (8, 2, 32, True)
    logits = model(jnp.asarray(TOKENS))
    _close(logits, tunix_qwen3_moe.outside_logits(path, TOKENS))
    _close(logits, reference_logits(path, TOKENS))
    assert model.pretrained.architecture == MOE


@pytest.mark.parametrize("kind, layers", [("dense0", "DMMM"), ("step2", "DMDM")])
def test_dense_layers_and_sparse_steps_equal_the_reference(checkpoints, kind, layers):
    model = from_pretrained(checkpoints[kind])
    assert "".join("M" if isinstance(b.mlp, MoE) else "D" for b in model.blocks) == layers
    assert model.config.norm_topk_prob == (kind == "dense0")
    _close(model(jnp.asarray(TOKENS)), reference_logits(checkpoints[kind], TOKENS))


@pytest.fixture
def reads(monkeypatch):
    """Each shard read of a Variable (``read_part``): its path, index and the tensors read."""
    calls = []
    read, read_part = CheckpointFiles.read, load_module.read_part

    def spying_read(self, name, index=(), **kwargs):
        calls[-1][2].append(name)
        return read(self, name, index, **kwargs)

    def spying_part(files, source, index, dtype):
        calls.append((source.path, index, []))
        return read_part(files, source, index, dtype)

    monkeypatch.setattr(CheckpointFiles, "read", spying_read)
    monkeypatch.setattr(load_module, "read_part", spying_part)
    return calls


@pytest.mark.parametrize("scan_layers", [False, True], ids=["blocks", "scanned"])
def test_expert_parallel_stages_read_their_own_experts_and_equal_tunix(
    checkpoints, reads, scan_layers
):
    path = checkpoints["float32"]
    model = from_pretrained(path, tasks=ep_stages(), scan_layers=scan_layers)
    experts = model.blocks.mlp.experts if scan_layers else model.blocks[3].mlp.experts
    shards = experts.down[...].addressable_shards
    assert {s.data.shape[scan_layers] for s in shards} == {EXPERTS // 2}  # EP 2
    home = mm.stack_of(experts.down) if scan_layers else mm.task_of(experts.down)
    assert home.name == ("s0+s1" if scan_layers else "s1")
    logits = mm.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS))
    _close(logits, tunix_qwen3_moe.outside_logits(path, TOKENS))

    expert_reads = [(p, i, names) for p, i, names in reads if "/experts/" in p]
    assert len(expert_reads) == (2 if scan_layers else 4) * 3 * 2  # Variables x expert halves
    for variable, index, names in expert_reads:
        kind = variable.rsplit("/", 1)[1]
        if scan_layers:  # (layer, expert) chunks: a stage's 2 layers, half the experts
            layers, mine = range(*index[0].indices(4)), range(*index[1].indices(EXPERTS))
            assert len(layers) == 2
        else:
            layers, mine = [int(variable.split("/")[1])], range(*index[0].indices(EXPERTS))
        assert len(mine) == EXPERTS // 2
        want = [
            f"model.layers.{i}.mlp.experts.{e}.{kind}_proj.weight" for i in layers for e in mine
        ]
        assert sorted(names) == sorted(want), (variable, index)
    counts = collections.Counter(n for _, _, names in expert_reads for n in names)
    assert set(counts.values()) == {1}  # the data axis's copies read nothing more
    assert len(counts) == 4 * EXPERTS * 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_then_save_is_bit_exact(checkpoints, tmp_path, dtype):
    source = checkpoints["dense0"]
    if dtype == "bfloat16":  # the same checkpoint, its tensors in bfloat16
        source = write_checkpoint(tmp_path / "src", architecture=MOE, mlp_only_layers=[0],
                                  dtype="bfloat16")  # fmt: skip
    model = from_pretrained(source, tasks=ep_stages(), param_dtype=dtype)
    out = save_pretrained(model, tmp_path / "out", max_shard_bytes=40_000)
    before, after = CheckpointFiles(source), CheckpointFiles(out)
    assert sorted(before.tensors) == sorted(after.tensors)
    assert "model.layers.0.mlp.up_proj.weight" in after.tensors
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in after.tensors
    for name, info in before.tensors.items():
        assert after.tensors[name].dtype == info.dtype
        np.testing.assert_array_equal(after.read(name), before.read(name))
    config = json.loads((out / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert {k: config[k] for k in original} == original


def test_a_model_not_loaded_is_written_with_qwen3_moe_keys(tmp_path):
    from mmnnx.models import GPT, GPTConfig

    config = GPTConfig(
        vocab_size=64, dim=32, depth=2, num_heads=4, qk_norm=True, gated_mlp=True,
        mlp_bias=False, experts=4, experts_per_token=2, expert_hidden=16, dense_layers=(0,),
    )  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    out = save_pretrained(model, tmp_path / "m", architecture=MOE)
    hf = json.loads((out / "config.json").read_text())
    assert hf["model_type"] == "qwen3_moe" and hf["mlp_only_layers"] == [0]
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (4, 2, 16)
    again = from_pretrained(out, max_seq_len=16)
    assert again.config.dense_layers == (0,) and again.config.expert_hidden == 16
    np.testing.assert_array_equal(
        np.asarray(again.blocks[1].mlp.experts.gate[...]),
        np.asarray(model.blocks[1].mlp.experts.gate[...]),
    )


def _edit(source, target, *, config=None, drop=None):
    shutil.copytree(source, target)
    if config:
        hf = json.loads((target / "config.json").read_text())
        hf.update(config)
        (target / "config.json").write_text(json.dumps(hf))
    if drop:
        files = CheckpointFiles(target)
        tensors = {n: files.read(n) for n in files.tensors if n != drop}
        for p in list(target.glob("*.safetensors")) + [target / "model.safetensors.index.json"]:
            p.unlink()
        write_shards(target, tensors)
    return target


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            dict(config={"num_experts": 4}),
            r"tensor 'model\.layers\.\d\.mlp\.experts\.4\.\w+_proj\.weight' fills no Variable "
            r"of GPT \(Variable 'blocks/\d/mlp/experts/\w+' stacks 4 tensors, one per expert\)",
        ),
        (
            dict(config={"num_experts": 16}),
            r"missing tensor 'model\.layers\.\d\.mlp\.experts\.8\.\w+_proj\.weight' \(for "
            r"Variable 'blocks/\d/mlp/experts/\w+' of GPT, 16 tensors, one per expert\)",
        ),
        (
            dict(drop="model.layers.2.mlp.experts.7.down_proj.weight"),
            r"missing tensor 'model\.layers\.2\.mlp\.experts\.7\.down_proj\.weight'",
        ),
        (
            dict(config={"mlp_only_layers": [1]}),
            r"missing tensor 'model\.layers\.1\.mlp\.\w+_proj\.weight' \(for Variable "
            r"'blocks/1/mlp",
        ),
        (
            dict(config={"moe_intermediate_size": 16}),
            r"tensor 'model\.layers\.\d\.mlp\.experts\.\d\.\w+_proj\.weight' has shape",
        ),
        (dict(config={"num_experts_per_tok": None}), r"no 'num_experts_per_tok'"),
    ],
)
def test_checkpoints_that_do_not_fit_their_config_are_refused(checkpoints, tmp_path, edit, message):
    path = _edit(checkpoints["float32"], tmp_path / "edited", **edit)
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(path, tasks=ep_stages())
    assert str(path) in str(error.value)


def test_stacked_layers_must_all_be_moe(checkpoints):
    with pytest.raises(CheckpointError, match=r"config\.json .*some layers are MoE and some dense"):
        from_pretrained(checkpoints["dense0"], scan_layers=True)
