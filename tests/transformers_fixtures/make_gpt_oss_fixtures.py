"""Writes the gpt-oss fixtures with transformers 5, and checks what mmnnx writes.
Not part of the test suite: run by hand with CPU torch and transformers 5 (never a dependency
of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_gpt_oss_fixtures.py

rewrites ``tests/transformers_fixtures/gpt-oss/``: a tiny random ``GptOssForCausalLM`` (2
layers, sliding window 4 then full attention, 4 experts of which each token takes 2, 4 heads
sharing 2 key/value heads of 8 features, gpt-oss's YaRN RoPE, attention sinks and biases, a
SwiGLU limit of 1.0 so the clamp acts) saved by transformers' own ``save_pretrained``, its
float32 ``logits.npy`` for make_fixtures.py's ``TOKENS`` and ``greedy.json`` (``generate``
with its cache from the first :data:`PROMPT` tokens of each row); and
``tests/transformers_fixtures/gpt-oss-mxfp4/``: the same weights with the experts in the
published MXFP4 layout (``*_blocks`` / ``*_scales``, ``quantization_config: {quant_method:
mxfp4}``), quantized here by :func:`mxfp4` (transformers has no CPU quantizer) as
transformers' ``convert_moe_packed_tensors`` reads it, and the float32 ``logits.npy``
transformers computes from those files (it dequantizes them on load on CPU).

The second step checks what mmnnx's ``save_pretrained`` writes:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_family_gpt_oss as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-gpt-oss-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/make_gpt_oss_fixtures.py \\
        --check /tmp/mmnnx-gpt-oss-saves

loads each ``<case>/`` in transformers 5 and keeps in ``gpt_oss_verdict.json`` the config it
wrote, what transformers loaded and the largest difference of its float32 logits from
mmnnx's (``<case>.npy``), relative to the largest logit.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
from make_fixtures import TOKENS
from oracle import check_cases, loaded
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, PreTrainedModel
from transformers.integrations.mxfp4 import FP4_VALUES

HERE = pathlib.Path(__file__).parent
PROMPT = 5
NEW_TOKENS = 8
CONFIG = GptOssConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,  # MXFP4 blocks of 32 along each input dimension
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    max_position_embeddings=64,
    swiglu_limit=1.0,
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of an ``(E, in, out)`` expert weight: per expert, output and block
    of 32 inputs, a power of two (``scales``: its exponent + 127) times FP4 codes, two a byte
    (the even input in the low nibble), nearest in :data:`FP4_VALUES`."""
    e, d, r = weight.shape
    w = weight.transpose(1, 2).reshape(e, r, d // 32, 32).double()
    exponent = torch.ceil(torch.log2(w.abs().amax(-1).clamp_min(1e-30) / 6.0))
    values = torch.tensor(FP4_VALUES, dtype=torch.float64)
    codes = (w.abs() / torch.exp2(exponent)[..., None] - values[:8, None, None, None, None]).abs()
    codes = codes.argmin(0).to(torch.uint8)  # 0..7: the magnitude's code
    codes = codes | ((w < 0).to(torch.uint8) << 3)  # the sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def write_fixtures() -> None:
    torch.manual_seed(0)
    model = GptOssForCausalLM(CONFIG).float().eval()
    with torch.no_grad():  # norms near 1, biases and sinks non-zero: all of them matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif "experts" in name:
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.1)
    out = HERE / "gpt-oss"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        prompt = tokens[:, :PROMPT]
        generated = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    np.save(out / "logits.npy", logits)
    greedy = {"prompt": prompt.tolist(), "continuation": generated[:, PROMPT:].tolist()}
    (out / "greedy.json").write_text(json.dumps(greedy) + "\n")
    print("files:", sorted(p.name for p in out.iterdir()), "greedy:", greedy)

    quantized = HERE / "gpt-oss-mxfp4"
    shutil.rmtree(quantized, ignore_errors=True)
    shutil.copytree(out, quantized)
    (quantized / "logits.npy").unlink()
    (quantized / "greedy.json").unlink()
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4(tensors.pop(name))
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            *("model.layers.*.self_attn", "model.layers.*.mlp.router"),
            *("model.embed_tokens", "lm_head"),
        ],
    }
    (quantized / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    again = AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = again(tokens).logits.float().numpy()
        w = again.model.layers[0].mlp.experts.gate_up_proj.float()
        print("mxfp4 gate_up dtype", again.model.layers[0].mlp.experts.gate_up_proj.dtype)
        print(
            "mxfp4: largest weight change",
            float((w - model.model.layers[0].mlp.experts.gate_up_proj).abs().max()),
        )
    np.save(quantized / "logits.npy", theirs)
    print("mxfp4: logits differ from float by", float(np.abs(theirs - logits).max()))


def describe(case: pathlib.Path) -> tuple[PreTrainedModel, dict]:
    """``case`` in float32 and what transformers loaded, with its ``layer_types``."""
    model, record = loaded(case)
    return model, {**record, "layer_types": model.config.layer_types}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        check_cases(pathlib.Path(sys.argv[2]), HERE / "gpt_oss_verdict.json", describe)
    else:
        write_fixtures()
