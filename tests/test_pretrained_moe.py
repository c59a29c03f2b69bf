"""Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``) through ``from_pretrained`` / ``save_pretrained``
on tiny random checkpoints in the Hugging Face layout (tests/hf_checkpoints.py): logits against
google/tunix's Qwen3 MoE (vendored in tests/outside/) and the float64 reference
(tests/hf_reference.py) on one device, on two pipeline stages of expert-parallel meshes and
stacked; what each expert-parallel device reads; the copy written back; the checkpoints refused;
``mmnnx train --init-from`` with LoRA and ``mmnnx export``."""

import collections
import contextlib
import io
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.models import from_pretrained, save_adapter, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained import load as load_module
from mmnnx.models.pretrained.files import CheckpointFiles, write_shards
from mmnnx.modules import MoE, add_lora
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.outside import tunix_qwen3_moe

MOE = "Qwen3MoeForCausalLM"
TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
EXPERTS = 8
RULES = mm.logical_rules(batch="data", expert="expert")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Every layer MoE; layer 0 dense (``mlp_only_layers``), in float32 and in bfloat16 (its
    head tied); every other layer MoE (``decoder_sparse_step`` 2) without renormalised
    weights."""
    root = tmp_path_factory.mktemp("hf-moe")
    dense0 = dict(architecture=MOE, mlp_only_layers=[0])
    return {
        "float32": write_checkpoint(root / "f32", architecture=MOE),
        "dense0": write_checkpoint(root / "dense0", **dense0),
        "dense0-bfloat16": write_checkpoint(root / "bf16", **dense0, dtype="bfloat16", tied=True),
        "step2": write_checkpoint(
            root / "step2", architecture=MOE, decoder_sparse_step=2, norm_topk_prob=False
        ),
    }


# jitted: eager, each operation of a MoE's forward compiled on its own took seconds
logits_of = nnx.jit(lambda model, tokens: model(tokens))


def _close(ours, theirs, rtol=1e-5):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() <= rtol * scale, np.abs(ours - theirs).max() / scale


def ep_stages():
    """Two pipeline stages, each a 2 x 2 ``expert x data`` mesh: 4 experts per device."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "expert", "data"))
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=RULES) for i in range(2)]


def test_one_device_logits_equal_tunix_and_the_reference(checkpoints):
    path = checkpoints["float32"]
    model = from_pretrained(path)
    assert [type(b.mlp) for b in model.blocks] == [MoE] * 4
    assert model.config.layers == model.config.block_configs  # built from nested configs
    moe = model.config.block_configs[0].feed_forward
    assert (moe.num_experts, moe.top_k, moe.hidden, moe.norm_topk_prob) == (8, 2, 32, True)
    logits = logits_of(model, TOKENS)
    _close(logits, tunix_qwen3_moe.outside_logits(path, TOKENS))
    _close(logits, reference_logits(path, TOKENS))
    assert model.pretrained.architecture == MOE


@pytest.mark.parametrize(
    "kind, layers", [("dense0", "DMMM"), ("dense0-bfloat16", "DMMM"), ("step2", "DMDM")]
)
def test_dense_layers_and_sparse_steps_equal_the_reference(checkpoints, kind, layers):
    model = from_pretrained(checkpoints[kind])
    assert "".join("M" if isinstance(b.mlp, MoE) else "D" for b in model.blocks) == layers
    assert model.config.block_configs[1].feed_forward.norm_topk_prob == (kind != "step2")
    _close(logits_of(model, TOKENS), reference_logits(checkpoints[kind], TOKENS))


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
    source = checkpoints["dense0" if dtype == "float32" else "dense0-bfloat16"]
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
    original = json.loads((source / "config.json").read_text())  # transformers 4's keys
    renamed = {"torch_dtype": "dtype", "num_experts": "num_local_experts"}
    rope = {"rope_theta": original.pop("rope_theta"), "rope_type": "default"}
    assert original.pop("rope_scaling") is None
    assert {renamed.get(k, k): v for k, v in original.items()} | {"rope_parameters": rope} == config
    assert original["output_router_logits"] is False  # so no load-balancing loss in training
    assert from_pretrained(out).config.router_aux_loss_coef == 0


def test_a_model_not_loaded_is_written_with_qwen3_moe_keys(checkpoints, tmp_path):
    model = from_pretrained(checkpoints["step2"], max_seq_len=16)
    model.pretrained = None  # as a GPT built with mm.init would be: no config.json to keep
    out = save_pretrained(model, tmp_path / "m", architecture=MOE)
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == [MOE] and hf["model_type"] == "qwen3_moe"
    want = dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[],
                router_aux_loss_coef=0.0, output_router_logits=False,
                intermediate_size=128)  # fmt: skip
    assert {k: hf[k] for k in want} == want
    assert from_pretrained(out, max_seq_len=16).config == model.config
    before, after = CheckpointFiles(checkpoints["step2"]), CheckpointFiles(out)
    assert sorted(before.tensors) == sorted(after.tensors)


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
    ids=["fewer-experts", "more-experts", "one-missing", "dense-layer", "hidden", "no-k"],
)
def test_checkpoints_that_do_not_fit_their_config_are_refused(checkpoints, tmp_path, edit, message):
    path = _edit(checkpoints["float32"], tmp_path / "edited", **edit)
    with pytest.raises(CheckpointError, match=message) as error:
        from_pretrained(path, tasks=ep_stages())
    assert str(path) in str(error.value)


def test_dense_then_moe_layers_scan_in_segments_and_are_written_back(checkpoints, tmp_path):
    """Layers dense, MoE, MoE, MoE scan as the dense one unrolled and the three MoE stacked;
    the same tensors fill them, the logits are the unscanned model's, and they are written
    back under their own names."""
    source = checkpoints["dense0"]
    model = from_pretrained(source, scan_layers=True)
    assert [(g.start, g.repeats) for g in model.config.segments] == [(0, 1), (1, 3)]
    assert isinstance(model.blocks[1].mlp, MoE) and model.blocks[1].mlp.router.kernel.shape[0] == 3
    tokens = jnp.asarray(TOKENS)
    unscanned = logits_of(from_pretrained(source), tokens)
    np.testing.assert_allclose(logits_of(model, tokens), unscanned, rtol=1e-5, atol=1e-5)
    out = save_pretrained(model, tmp_path / "out")
    before, after = CheckpointFiles(source), CheckpointFiles(out)
    assert sorted(before.tensors) == sorted(after.tensors)
    for name in before.tensors:
        np.testing.assert_array_equal(after.read(name), before.read(name), err_msg=name)


def test_a_scanned_period_of_dense_and_moe_layers_trains_with_its_router_metrics_captured():
    """Qwen3-MoE's dense, MoE, dense, MoE scanned as 2 x [dense, MoE] (a ``Period``): the loss
    and gradients under ``nnx.capture(..., nnx.Intermediate)`` (as ``mmnnx train`` logs the
    routers) equal the unscanned model's, and so do the captured tokens per expert (with the
    period's layers in an ``nnx.List``, Flax 0.12.8's ``nnx.scan`` failed under the capture)."""
    from tests.test_transformers_fixtures import FIXTURES

    path = FIXTURES / "deep" / "qwen3-moe"
    batch = jnp.asarray(np.load(path / "expected.npz")["tokens"])

    @nnx.jit
    def loss_and_grads(model):
        def loss(m):
            return nnx.capture(lambda m: m.loss(batch), nnx.Intermediate)(m)

        return nnx.value_and_grad(loss, has_aux=True)(model)

    def loss_grads_and_counts(model):
        (value, captured), grads = loss_and_grads(model)
        counts = [
            v.get_value() for p, v in nnx.to_flat_state(captured) if p[-1] == "tokens_per_expert"
        ]
        return value, grads, np.concatenate([np.asarray(c).reshape(-1) for c in counts])

    scanned = from_pretrained(path, scan_layers=True, max_seq_len=16)
    assert [(g.start, g.repeats, len(g.period)) for g in scanned.config.segments] == [(0, 2, 2)]
    loss, grads, counts = loss_grads_and_counts(scanned)
    loss_1, grads_1, counts_1 = loss_grads_and_counts(from_pretrained(path, max_seq_len=16))
    np.testing.assert_allclose(loss, loss_1, rtol=1e-6)
    np.testing.assert_allclose(np.sort(counts), np.sort(counts_1))
    unscanned_norm = sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads_1))
    assert np.isclose(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grads)), unscanned_norm)


def test_init_from_a_qwen3_moe_with_lora_trains_and_exports_qwen3_moe_names(tmp_path):
    source = write_checkpoint(
        tmp_path / "moe", architecture=MOE, num_hidden_layers=2, mlp_only_layers=[0]
    )
    (tmp_path / "text.txt").write_text("A pipeline splits a model into stages. " * 100)
    run, out = tmp_path / "run", tmp_path / "out"
    argv = ["train", "--init-from", str(source), "--lora-rank", "4", "--stages", "2",
            "--data-axis", "1", "--model-axis", "2", "--seq-len", "16", "--batch-size", "4",
            "--microbatches", "2", "--steps", "1", "--eval-every", "1", "--eval-batches", "1",
            "--timeline-step", "0", "--warmup-steps", "0", "--lr", "1e-2", "--no-tensorboard",
            "--text", str(tmp_path / "text.txt"), "--output-dir", str(run)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0  # layer 0 dense, layer 1 MoE: experts' hidden over "model"
        assert main(["export", "--run", str(run), "--output", str(out)]) == 0
    before, after = CheckpointFiles(source), CheckpointFiles(out)
    assert sorted(after.tensors) == sorted(before.tensors)  # Qwen3-MoE's names, every one
    exported, hf = (json.loads((d / "config.json").read_text()) for d in (out, source))
    assert exported["architectures"] == [MOE]
    assert exported["max_position_embeddings"] == hf["max_position_embeddings"]  # not --seq-len
    adapted = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for name in before.tensors:  # LoRA merged where adapted, the rest frozen
        changed = not np.array_equal(after.read(name), before.read(name))
        is_adapted = name.split(".")[-2] in adapted and ".experts." not in name
        assert changed == is_adapted, name  # no adapter on the router nor the experts


def test_init_from_a_moe_whose_layers_do_not_repeat_cannot_scan_them(tmp_path, capsys):
    source = write_checkpoint(
        tmp_path / "moe", architecture=MOE, num_hidden_layers=2, mlp_only_layers=[0]
    )
    assert main(["train", "--init-from", str(source), "--scan-layers"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("mmnnx train: error: --init-from: ") and error.count("\n") == 1
    assert "some layers are MoE and some dense and no run of these 2 layers repeats" in error


def test_lora_adapts_what_the_layers_have_and_the_router_only_when_named(checkpoints, tmp_path):
    every_layer_moe = add_lora(from_pretrained(checkpoints["float32"], max_seq_len=16), rank=2)
    adapted = nnx.to_flat_state(nnx.state(every_layer_moe, nnx.LoRAParam))
    assert {path[-3] for path, _ in adapted} == {"q", "k", "v", "out"}  # no MLP Linear left
    model = from_pretrained(checkpoints["step2"], max_seq_len=16)
    out = save_adapter(add_lora(model, rank=2, targets=("q", "router")), tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["target_modules"] == ["gate", "q_proj"]  # PEFT's name of the router
    tensors = CheckpointFiles(out).tensors
    a, b = (tensors[f"base_model.model.model.layers.1.mlp.gate.lora_{f}.weight"] for f in "AB")
    assert (a.shape, b.shape) == ((2, 64), (EXPERTS, 2))  # (r, in), (out, r)
    assert not any("layers.0.mlp.gate." in n for n in tensors)  # layer 0 is dense: no router
