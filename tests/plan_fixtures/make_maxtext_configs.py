"""Writes configs/maxtext-<N>b/config.json: MaxText's v5p benchmark models
(src/maxtext/configs/tpu/v5p/<N>b.sh: ``global_parameter_scale=N`` over base.yml's
``decoder_block: llama2`` with ``base_emb_dim 2048``, ``base_num_query_heads`` and
``base_num_kv_heads 16``, ``base_mlp_dim 7168``, ``base_num_decoder_layers 16``, ``head_dim
128``, ``vocab_size 32000``, ``mlp_activations [silu, linear]``, untied logits), scaled as
MaxText's ``get_individual_scales`` does (pyconfig: heads and MLP, then the width, then the
layers double in turn), written as the Llama ``config.json`` a plan reads. No torch needed.

Run: python tests/plan_fixtures/make_maxtext_configs.py
"""

import json
import math
import pathlib

HERE = pathlib.Path(__file__).parent


def scales(scale: int) -> tuple[int, int, int, int]:
    """MaxText's ``get_individual_scales``: log2 multipliers of width, heads, MLP, layers."""
    base, rem = divmod(int(math.log2(scale)), 3)
    heads = base + int(rem > 0)
    return base + int(rem > 1), heads, heads, base


def config(scale: int) -> dict:
    emb, heads, mlp, layers = scales(scale)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048 * 2**emb,
        "num_attention_heads": 16 * 2**heads,
        "num_key_value_heads": 16 * 2**heads,
        "head_dim": 128,
        "intermediate_size": 7168 * 2**mlp,
        "num_hidden_layers": 16 * 2**layers,
        "vocab_size": 32000,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


if __name__ == "__main__":
    for scale in (32, 64, 128, 256, 512, 1024):
        folder = HERE / "configs" / f"maxtext-{scale}b"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config(scale), indent=2) + "\n")
