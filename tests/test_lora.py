"""LoRA adapters (``mmnnx.modules.add_lora``) on placed and stacked GPTs, merged and PEFT
exports, checked against numpy."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, save_adapter, save_pretrained
from mmnnx.models.pretrained.files import CheckpointFiles
from mmnnx.modules import add_lora
from tests.hf_checkpoints import write_checkpoint

TOKENS = jnp.asarray(np.arange(16, dtype=np.int32).reshape(2, 8) * 7 % 300)


def _tasks(n=2):
    per = 8 // n
    return [
        mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(per * i, per * (i + 1)))) for i in range(n)
    ]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("lora") / "llama", architecture="LlamaForCausalLM"
    )


def _perturb(model, seed=1):
    """Random ``b`` factors, so the adapters change the model."""
    key = jax.random.key(seed)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, mm.modules.LoRA):
            key, draw = jax.random.split(key)
            b = m.b[...]
            m.b[...] = jax.device_put(0.05 * jax.random.normal(draw, b.shape), b.sharding)


def test_adapters_live_on_their_kernels_tasks_and_start_as_no_change(llama):
    model = from_pretrained(llama, tasks=_tasks())
    before = mm.jit(lambda m, t: m(t))(model, TOKENS)
    add_lora(model, rank=4, alpha=8.0, targets=("q", "v", "down"))
    for i, block in enumerate(model.blocks):
        for linear in (block.attn.q, block.attn.v, block.mlp.down):
            assert mm.task_of(linear.lora.a) is mm.task_of(linear.kernel)
            assert mm.task_of(linear.lora.b).name == ("s0" if i < 2 else "s1")
        assert block.attn.k.lora is None
    assert model.blocks[0].attn.q.lora.a.shape == (64, 4)
    after = mm.jit(lambda m, t: m(t))(model, TOKENS)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))


def test_stacked_layers_get_stacked_adapters(llama):
    model = from_pretrained(llama, tasks=_tasks(), scan_layers=True)
    add_lora(model, rank=2, targets=("up",))
    a = model.blocks.mlp.up.lora.a
    assert a.shape == (4, 64, 2) and mm.stack_of(a).name == "s0+s1"
    _perturb(model)
    unrolled = from_pretrained(llama)
    add_lora(unrolled, rank=2, targets=("up",))
    for i, block in enumerate(unrolled.blocks):
        block.mlp.up.lora.a[...] = jnp.asarray(np.asarray(model.blocks.mlp.up.lora.a[...])[i])
        block.mlp.up.lora.b[...] = jnp.asarray(np.asarray(model.blocks.mlp.up.lora.b[...])[i])
    np.testing.assert_allclose(
        np.asarray(mm.jit(lambda m, t: m(t))(model, TOKENS)),
        np.asarray(unrolled(TOKENS)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_only_adapters_get_gradients_and_optimizer_state(llama):
    model = add_lora(from_pretrained(llama, tasks=_tasks()), rank=4)
    opt = nnx.Optimizer(model, __import__("optax").adam(1e-3), wrt=nnx.LoRAParam)
    trainable = nnx.DiffState(0, nnx.LoRAParam)

    @mm.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch), argnums=trainable)(model)
        opt.update(model, grads)
        return loss

    kernel = np.asarray(model.blocks[3].mlp.up.kernel[...])
    batch = jnp.concatenate([TOKENS, TOKENS[:, :1]], axis=1)
    step(model, opt, batch)
    step(model, opt, batch)
    np.testing.assert_array_equal(np.asarray(model.blocks[3].mlp.up.kernel[...]), kernel)
    assert np.abs(np.asarray(model.blocks[3].mlp.up.lora.b[...])).max() > 0
    shapes = {
        tuple(v.shape)
        for _, v in nnx.iter_graph(nnx.state(opt, nnx.OptState))
        if isinstance(v, nnx.Variable) and v.shape
    }
    assert shapes <= {(64, 4), (4, 64), (4, 128), (128, 4), (4, 32), (32, 4), (4, 16), (16, 4)}


def test_merged_and_adapter_exports_agree_with_numpy(llama, tmp_path):
    model = add_lora(from_pretrained(llama, tasks=_tasks()), rank=4, alpha=16.0)
    _perturb(model)
    logits = mm.jit(lambda m, t: m(t))(model, TOKENS)
    merged = save_pretrained(model, tmp_path / "merged")
    again = from_pretrained(merged)
    np.testing.assert_allclose(np.asarray(again(TOKENS)), np.asarray(logits), rtol=1e-5, atol=1e-5)
    adapter = save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    assert config["base_model_name_or_path"] == str(llama)
    base, lora, out = CheckpointFiles(llama), CheckpointFiles(adapter), CheckpointFiles(merged)
    prefix = "base_model.model.model.layers.2.self_attn.o_proj"
    a, b = lora.read(f"{prefix}.lora_A.weight"), lora.read(f"{prefix}.lora_B.weight")
    assert a.shape == (4, 64) and b.shape == (64, 4)  # (r, in) and (out, r), as PEFT
    w = base.read("model.layers.2.self_attn.o_proj.weight")
    np.testing.assert_allclose(
        out.read("model.layers.2.self_attn.o_proj.weight"), w + (16.0 / 4) * b @ a, rtol=1e-6
    )
    assert len(lora.tensors) == 4 * 7 * 2


def test_bad_targets_and_twice(llama):
    model = from_pretrained(llama)
    with pytest.raises(ValueError, match=r"'q_proj' names no Linear of GPT; its Linear layers"):
        add_lora(model, rank=2, targets=("q_proj",))
    add_lora(model, rank=2, targets=("q",))
    with pytest.raises(ValueError, match="blocks/0/attn/q already has an adapter"):
        add_lora(model, rank=2, targets=("q",))
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        add_lora(from_pretrained(llama), rank=0)
