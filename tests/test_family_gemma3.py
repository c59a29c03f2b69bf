"""Gemma 3 (``Gemma3ForCausalLM``) against transformers 5: a tiny random checkpoint written by
transformers' own ``save_pretrained`` (tests/transformers_fixtures/gemma3/, made by
make_gemma3_fixtures.py with CPU torch): 4 layers, 3 sliding (window 4) and 1 global with
linear RoPE scaling, sequences of 12. What was read, that each Gemma setting matters, what
``save_pretrained`` writes is what transformers wrote and what transformers reads back (its
verdict, kept by the fixture script). Its logits on one device and on 2 and 4 stages, greedy
decoding and pipelined training: tests/test_family_conformance.py."""

import dataclasses
import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from mmnnx.models import from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.pretrained import FAMILIES, CheckpointError
from mmnnx.modules import LinearScaling, RopeConfig
from tests.test_transformers_fixtures import F32, _tasks, relative_error

PATH = pathlib.Path(__file__).parent / "transformers_fixtures" / "gemma3"
EXPECTED = np.load(PATH / "expected.npz")
TOKENS = jnp.asarray(EXPECTED["tokens"], jnp.int32)


def _config():
    return json.loads((PATH / "config.json").read_text())


def _edited(tmp_path, hf, name="c"):
    path = tmp_path / name
    shutil.copytree(PATH, path)
    (path / "config.json").write_text(json.dumps(hf))
    return path


def test_the_window_the_global_rope_and_the_score_scale_matter_here(tmp_path):
    """What reading the config without each Gemma setting would give: other logits."""
    theirs = EXPECTED["logits"]
    hf = _config()
    plain_rope = {"rope_type": "default", "rope_theta": 1e6}
    edits = {
        "window": {"sliding_window": 12},
        "rope": {"rope_parameters": hf["rope_parameters"] | {"full_attention": plain_rope}},
        "scale": {"query_pre_attn_scalar": 16},
    }
    for name, edit in edits.items():
        model = from_pretrained(_edited(tmp_path, hf | edit, name))
        assert relative_error(model(TOKENS), theirs) > 100 * F32, name


def test_what_was_read():
    config = pretrained_config(PATH)
    attention = [b.attention for b in config.block_configs]
    assert [a.sliding_window for a in attention] == [4, 4, 4, None]
    assert attention[0].rope == RopeConfig(1e4, None)
    assert attention[3].rope == RopeConfig(1e6, LinearScaling(8.0))
    assert {a.query_pre_attn_scalar for a in attention} == {24}
    assert {(a.qk_norm, a.qk_norm_offset) for a in attention} == {(True, 1.0)}
    block = config.block_configs[0]
    assert block.post_norms and block.norm.scale_offset == config.final_norm.scale_offset == 1
    assert block.feed_forward.activation == "gelu_pytorch_tanh" and block.feed_forward.gated
    assert config.embed_scale == 32**0.5 and config.tie_embeddings
    assert FAMILIES["Gemma3ForCausalLM"].cannot_hold(config) == []
    assert FAMILIES["LlamaForCausalLM"].cannot_hold(config) == [
        "query/key norms (LlamaForCausalLM: none)",
        "layers of different attention",
        "a sliding window (LlamaForCausalLM: full attention)",
        "a non-SiLU MLP (LlamaForCausalLM)",
        "norms after attention and MLP (LlamaForCausalLM: none)",
        "Gemma's norms or score scale (LlamaForCausalLM: none)",
        "scaled embeddings (LlamaForCausalLM: unscaled)",
    ]
    plain = dataclasses.replace(config, embed_scale=None, final_norm=None)
    assert FAMILIES["Gemma3ForCausalLM"].cannot_hold(plain) == [
        "RMSNorms without the (1 + weight) scale (Gemma3ForCausalLM: 1 + weight)",
        "embeddings not scaled by sqrt(dim) (Gemma3ForCausalLM: 5.65685)",
    ]


def test_transformers_4_keys_read_the_same(tmp_path):
    """Gemma 3's older keys, as published checkpoints have them: ``rope_theta`` and
    ``rope_scaling`` (global layers), ``rope_local_base_freq`` (sliding layers),
    ``sliding_window_pattern`` (every n-th layer global) and no ``layer_types``."""
    hf = _config()
    rope = hf.pop("rope_parameters")
    del hf["layer_types"], hf["dtype"]
    full = rope["full_attention"]
    hf |= {
        "rope_theta": full["rope_theta"],
        "rope_scaling": {"rope_type": "linear", "factor": full["factor"]},
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
        "sliding_window_pattern": 4,
        "torch_dtype": "float32",
    }
    old = _edited(tmp_path, hf, "v4")
    assert pretrained_config(old) == pretrained_config(PATH)
    written = save_pretrained(from_pretrained(old), tmp_path / "again")
    again = json.loads((written / "config.json").read_text())
    assert again == _config()  # the older keys replaced by those transformers 5 writes
    defaults = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_local_base_freq")}
    del defaults["rope_scaling"]
    blocks = pretrained_config(_edited(tmp_path, defaults, "defaults")).block_configs
    assert [b.attention.rope.theta for b in blocks] == [1e4, 1e4, 1e4, 1e6]  # transformers'


def test_a_loaded_model_is_written_back_as_transformers_wrote_it(tmp_path):
    model = from_pretrained(PATH, tasks=_tasks(2), max_seq_len=32)
    same = save_pretrained(model, tmp_path / "same")
    assert json.loads((same / "config.json").read_text()) == _config()
    half = save_pretrained(model, tmp_path / "half", dtype=jnp.bfloat16)
    assert json.loads((half / "config.json").read_text()) == _config() | {"dtype": "bfloat16"}


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True is not"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        (
            {"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]},
            r"layer_types: \['chunked_attention'\] are not supported",
        ),
        ({"sliding_window": None}, "sliding_window: null, but layer_types has"),
        ({"sliding_window": 0}, "sliding_window: 0 is not an int >= 1"),
        ({"hidden_activation": "relu"}, "hidden_activation: 'relu' is not supported"),
        ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar: -1 is not a finite number > 0"),
        (
            {"rope_parameters": {"rope_type": "default"}},
            r"rope_parameters: \['rope_type'\] are not",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}},
            'rope_parameters.full_attention: rope_type "dynamic" is not supported',
        ),
        ({"rope_local_base_freq": "1e4"}, 'rope_local_base_freq: "1e4" is not a finite number'),
        ({"sliding_window_pattern": 0}, "sliding_window_pattern: 0 is not an int >= 1"),
        (
            {"rope_parameters": {"full_attention": {}, "sliding_attention": 1e4}},
            "rope_parameters.sliding_attention: 10000.0 is not an object",
        ),
    ],
)
def test_what_mmnnx_does_not_compute_is_refused_naming_the_key_and_file(tmp_path, edit, message):
    hf = _config() | edit
    if "sliding_window_pattern" in edit or "rope_local_base_freq" in edit:  # the older keys
        hf = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    path = _edited(tmp_path, hf)
    with pytest.raises(CheckpointError, match=message) as error:
        pretrained_config(path)
    assert f"{path}/config.json" in str(error.value)


def save_saves(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """What make_gemma3_fixtures.py --check gives transformers 5 (and PEFT): the fixture loaded
    and re-saved in bfloat16 (``bf16``), then with LoRA adapters of random ``b`` on every
    ``Linear``, merged (``lora-merged``) and as PEFT's adapter (``lora-adapter``); beside each,
    ``<case>.npy``: mmnnx's logits of ``TOKENS`` from the files it wrote (the adapter's: of the
    merged model)."""
    import jax
    from flax import nnx

    from mmnnx.models import save_adapter
    from mmnnx.modules import add_lora

    out = {"bf16": save_pretrained(from_pretrained(PATH), root / "bf16", dtype=jnp.bfloat16)}
    model = add_lora(from_pretrained(PATH), rank=2, alpha=4)
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    for _, lora in nnx.iter_graph(model):
        if hasattr(lora, "b") and hasattr(lora, "a") and hasattr(lora, "rank"):
            lora.b[...] = 0.1 * jax.random.normal(next(keys), lora.b[...].shape)
    out["lora-merged"] = save_pretrained(model, root / "lora-merged")
    out["lora-adapter"] = save_adapter(model, root / "lora-adapter")
    for case, path in out.items():
        source = out["lora-merged"] if case == "lora-adapter" else path
        np.save(root / f"{case}.npy", np.asarray(from_pretrained(source)(TOKENS)))
    return out


def test_transformers_reads_what_save_pretrained_writes(tmp_path):
    """make_gemma3_fixtures.py --check loaded what ``save_saves`` writes in transformers 5 and
    PEFT: the same config, dtype and RoPE per layer type, and logits equal to mmnnx's."""
    verdict = json.loads((PATH / "verdict.json").read_text())["cases"]
    written = save_saves(tmp_path)
    assert sorted(verdict) == sorted(written)
    for case, seen in verdict.items():
        assert seen["logits_error"] < F32, case
        if case == "lora-adapter":
            config = json.loads((written[case] / "adapter_config.json").read_text())
            assert {k: v for k, v in config.items() if k != "base_model_name_or_path"} == {
                k: v for k, v in seen["adapter_config"].items() if k != "base_model_name_or_path"
            }
            continue
        config = json.loads((written[case] / "config.json").read_text())
        assert config == seen["config"], case  # what transformers read is what is written now
        assert seen["dtype"] == config["dtype"], case
        assert seen["rope_parameters"] == config["rope_parameters"], case
        assert seen["layer_types"] == config["layer_types"], case
    merged = np.load(tmp_path / "lora-merged.npy")  # the adapters change the logits
    assert relative_error(merged, EXPECTED["logits"]) > 100 * F32


def test_the_embedding_scale_is_rounded_to_the_tables_dtype():
    """As transformers' ``Gemma3TextScaledWordEmbedding``: ``sqrt(3072)`` (Gemma 3 4B's width)
    is 55.4256 in float32 and 55.5 in bfloat16 (its comment), multiplied in the table's dtype."""
    from flax import nnx

    from mmnnx.modules import Embed

    scaled = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        with nnx.use_eager_sharding(False):
            embed = Embed(2, 4, scale=3072**0.5, param_dtype=dtype, rngs=nnx.Rngs(0))
        embed.embedding[...] = jnp.ones((2, 4), dtype)
        out = embed(jnp.array([1]))
        assert out.dtype == dtype
        scaled[dtype] = float(out[0, 0])
    assert scaled[jnp.bfloat16] == 55.5
    assert scaled[jnp.float32] == float(np.float32(3072**0.5))
