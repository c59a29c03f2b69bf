"""The Hugging Face checkpoint fixtures (tests/hf_checkpoints.py) and the references checked
against each other: the numpy float64 reference (tests/hf_reference.py) against jax-ml/bonsai's
Qwen3 and Llama 3.2 and google/tunix's Llama 3 (tests/outside/), each loaded by its own loader,
and the files against the Hub layout."""

import json

import numpy as np
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.outside import bonsai_llama, bonsai_qwen3, tunix_llama

TOKENS = np.random.default_rng(1).integers(0, 376, (2, 12))
F32 = 1e-5  # float32 computation against float64, relative to the largest logit
BF16 = 4e-2  # bfloat16 computation (parameters, activations, cache) against float64
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Llama 3.2's is 8192; 64 puts this model's frequencies in all three bands at 12 positions.
    "original_max_position_embeddings": 64,
}
OUTSIDE = {"LlamaForCausalLM": bonsai_llama, "Qwen3ForCausalLM": bonsai_qwen3}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    assert out.shape == ref.shape
    return float(np.abs(out - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(("tied", "dtype"), [(False, "float32"), (True, "bfloat16")])
@pytest.mark.parametrize("architecture", list(OUTSIDE))
def test_bonsai_matches_reference(tmp_path, architecture, tied, dtype):
    """Computed in float32 (bfloat16 files too: their numbers are exact in float32)."""
    path = write_checkpoint(tmp_path, architecture=architecture, tied=tied, dtype=dtype)
    ref = reference_logits(path, TOKENS)
    assert ref.shape == (2, 12, 384)
    assert relative_error(OUTSIDE[architecture].outside_logits(path, TOKENS), ref) < F32


@pytest.mark.parametrize("architecture", list(OUTSIDE))
def test_bonsai_in_bfloat16_near_reference(tmp_path, architecture):
    path = write_checkpoint(tmp_path, architecture=architecture, dtype="bfloat16", seed=3)
    ref = reference_logits(path, TOKENS)
    out = OUTSIDE[architecture].outside_logits(path, TOKENS, dtype="bfloat16")
    assert F32 < relative_error(out, ref) < BF16  # rounded, but not wrong


@pytest.mark.parametrize(("tied", "dtype"), [(False, "float32"), (True, "bfloat16")])
def test_tunix_llama_matches_reference(tmp_path, tied, dtype):
    path = write_checkpoint(tmp_path, tied=tied, dtype=dtype, rope_theta=tunix_llama.ROPE_THETA)
    ref = reference_logits(path, TOKENS)
    assert relative_error(tunix_llama.outside_logits(path, TOKENS), ref) < F32


def test_llama3_rope_scaling_matches_bonsai(tmp_path):
    scaled = write_checkpoint(tmp_path / "scaled", rope_scaling=LLAMA3_SCALING)
    plain = write_checkpoint(tmp_path / "plain")
    ref = reference_logits(scaled, TOKENS)
    assert relative_error(bonsai_llama.outside_logits(scaled, TOKENS), ref) < F32
    assert relative_error(reference_logits(plain, TOKENS), ref) > 100 * F32


@pytest.mark.parametrize("architecture", list(OUTSIDE))
def test_reference_sees_rope_theta_and_weights(tmp_path, architecture):
    """What the comparisons above would catch: another rope_theta, another seed."""
    base = reference_logits(write_checkpoint(tmp_path / "a", architecture=architecture), TOKENS)
    theta = write_checkpoint(tmp_path / "b", architecture=architecture, rope_theta=10_000.0)
    seed = write_checkpoint(tmp_path / "c", architecture=architecture, seed=1)
    assert relative_error(reference_logits(theta, TOKENS), base) > 100 * F32
    assert relative_error(reference_logits(seed, TOKENS), base) > BF16


def test_outside_models_refuse_a_rope_theta_they_ignore(tmp_path):
    path = write_checkpoint(tmp_path, architecture="Qwen3ForCausalLM", rope_theta=10_000.0)
    with pytest.raises(ValueError, match="rope_theta 10000.0"):
        bonsai_qwen3.outside_logits(path, TOKENS)
    with pytest.raises(ValueError, match="rope_theta 500000.0"):
        tunix_llama.outside_logits(write_checkpoint(tmp_path / "llama"), TOKENS)


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names and shapes for ``config``, Linear weights (out, in)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    layer = {
        "input_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
    }
    if config["model_type"] == "qwen3":
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    return shapes


@pytest.mark.parametrize(
    ("architecture", "tied", "dtype", "shards"),
    [
        ("LlamaForCausalLM", False, "bfloat16", 3),
        ("LlamaForCausalLM", True, "float32", 1),
        ("Qwen3ForCausalLM", True, "bfloat16", 2),
        ("Qwen3ForCausalLM", False, "float32", 1),
    ],
)
def test_files_in_the_hub_layout(tmp_path, architecture, tied, dtype, shards):
    path = write_checkpoint(
        tmp_path, architecture=architecture, tied=tied, dtype=dtype, shards=shards
    )
    config = json.loads((path / "config.json").read_text())
    family = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    assert config["architectures"] == [architecture] and config["model_type"] == family
    assert (config["tie_word_embeddings"], config["torch_dtype"]) == (tied, dtype)
    assert (config["hidden_act"], config["attention_bias"], config["rope_scaling"]) == (
        "silu",
        False,
        None,
    )
    assert config.get("mlp_bias", False) is False
    if family == "qwen3":
        assert config["num_attention_heads"] * config["head_dim"] != config["hidden_size"]

    if shards == 1:
        files = {"model.safetensors"}
        assert not (path / "model.safetensors.index.json").exists()
    else:
        files = {f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)}
        index = json.loads((path / "model.safetensors.index.json").read_text())
    assert {p.name for p in path.glob("*.safetensors")} == files
    tensors = {}
    for file in sorted(files):
        with safe_open(path / file, framework="numpy") as f:
            assert f.metadata() == {"format": "pt"}
            for name in sorted(f.keys()):
                tensors[name] = f.get_tensor(name)
                assert tensors[name].dtype.name == dtype, name
                if shards > 1:
                    assert index["weight_map"][name] == file
    assert {name: t.shape for name, t in tensors.items()} == expected_shapes(config)
    if shards > 1:
        assert set(index["weight_map"]) == set(tensors)
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for name, tensor in tensors.items():
        value = tensor.astype(np.float32)
        if name.endswith("norm.weight"):  # near 1, not 1: the norms' weights matter
            assert value.min() > 0.5 and value.max() < 1.5 and value.std() > 0.05, name
        else:
            assert abs(value.mean()) < 0.02 and 0.05 < value.std() < 0.2, name


@pytest.mark.parametrize("architecture", list(OUTSIDE))
def test_tokenizer(tmp_path, architecture):
    path = write_checkpoint(tmp_path, architecture=architecture)
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= config["vocab_size"]
    assert generation["bos_token_id"] == config["bos_token_id"]
    assert config["eos_token_id"] in np.atleast_1d(generation["eos_token_id"])
    text = "Hello, pipelined world! Ünïcödé bytes too."
    ids = tokenizer.encode(text).ids
    assert max(ids) < config["vocab_size"] and len(ids) < len(text.encode())  # merges learnt
    assert tokenizer.decode(ids) == text
    assert (ids[0] == config["bos_token_id"]) == (architecture == "LlamaForCausalLM")


def test_tokenizer_larger_than_the_model(tmp_path):
    path = write_checkpoint(tmp_path, vocab_size=300, tokenizer_size=320)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 320
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 300


def test_write_checkpoint_errors(tmp_path):
    with pytest.raises(TypeError, match="hidden_dim"):
        write_checkpoint(tmp_path, hidden_dim=32)
    with pytest.raises(ValueError, match="shards 1000"):
        write_checkpoint(tmp_path, shards=1000)
    with pytest.raises(ValueError, match="architecture 'GPT2LMHeadModel'"):
        write_checkpoint(tmp_path, architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="tokenizer size 100"):
        write_checkpoint(tmp_path, tokenizer_size=100)
    assert not any(tmp_path.iterdir())
