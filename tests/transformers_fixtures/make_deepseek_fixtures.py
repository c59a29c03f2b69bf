"""Writes the DeepSeek-V3 fixtures: a tiny random ``DeepseekV3ForCausalLM`` saved by
transformers' own ``save_pretrained``, its float32 logits and greedy continuation, and the same
weights in DeepSeek's published FP8 layout. Not part of the test suite: run by hand with the
oracle venv (CPU torch, transformers 5; never a dependency of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_deepseek_fixtures.py

and, to keep transformers' verdict on what mmnnx's ``save_pretrained`` writes:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_family_deepseek as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-deepseek-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/make_deepseek_fixtures.py \\
        --check /tmp/mmnnx-deepseek-saves

It rewrites ``tests/transformers_fixtures/deepseek_v3/`` (``config.json``,
``model.safetensors``, ``generation_config.json`` as transformers writes them; ``logits.npy``,
float32 ``(2, 16, vocab)`` for :data:`TOKENS`; ``greedy.json``, the prompt and transformers'
greedy continuation) and ``deepseek_v3_fp8/``: every projection weight quantized to
``float8_e4m3fn`` in blocks of ``weight_block_size`` with its float32 ``<name>_scale_inv``
(``ceil(rows / b) x ceil(cols / b)``, the last blocks partial), ``quantization_config`` as
DeepSeek-V3's ``config.json`` has it, and ``logits.npy``: transformers' logits with the weights
dequantized here in torch (``fp8 * scale_inv``, each block by its own scale).
``deepseek_v3_unshared/``: 2 layers of experts without a shared expert (``n_shared_experts`` 0:
transformers writes its tensors with no elements) and their ``logits.npy``.
"""

import dataclasses
import json
import logging
import math
import pathlib
import shutil
import sys

import numpy as np
import torch
from oracle import as_saved, check_cases, in_float32
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

HERE = pathlib.Path(__file__).parent
TOKENS = np.array(
    [[3, 17, 120, 9, 101, 77, 5, 42, 11, 0, 99, 64, 31, 8, 127, 2], list(range(1, 17))],
    np.int64,
)
PROMPT = [[3, 17, 120, 9, 101, 77]]
NEW_TOKENS = 8
BLOCK = 8  # weight_block_size of the FP8 fixture (DeepSeek-V3 publishes 128)
CONFIG = DeepseekV3Config(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 mixtures of experts
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    # YaRN as DeepSeek-V3 publishes it (factor 40, original 4096, mscale 1, mscale_all_dim 1),
    # on a short original context: at 16 positions the ramp and both scales matter
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=8,
        mscale=0.707,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    ),
)
QUANTIZED = (  # the weights DeepSeek-V3 publishes in FP8: every projection but the router's
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
    "gate_proj", "up_proj", "down_proj",
)  # fmt: skip


def randomize(model: DeepseekV3ForCausalLM) -> None:
    with torch.no_grad():  # norms near 1, not 1: their weights matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice, not the weights
                b.copy_(0.3 * torch.randn_like(b))


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` in float8_e4m3fn blocks of BLOCK x BLOCK and each block's dequantizing scale."""
    rows, cols = w.shape
    scales = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            scale = block.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK] = (block / scale).to(
                torch.float8_e4m3fn
            )
            scales[i, j] = scale
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    full = scales.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * full


def write_fp8(source: pathlib.Path, model: DeepseekV3ForCausalLM) -> None:
    out = HERE / "deepseek_v3_fp8"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    tensors = load_file(source / "model.safetensors")
    stored, floats = {}, {}
    for name, w in tensors.items():
        if name.split(".")[-2] in QUANTIZED and name.endswith(".weight"):
            q, s = quantize(w)
            stored[name], stored[name + "_scale_inv"] = q, s
            floats[name] = dequantize(q, s)
        else:
            stored[name] = w
            floats[name] = w
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    dequantized = DeepseekV3ForCausalLM.from_pretrained(source).float().eval()
    with torch.no_grad():
        dequantized.load_state_dict(
            {**dequantized.state_dict(), **_fused(floats, dequantized)}, strict=True
        )
        logits = dequantized(torch.tensor(TOKENS)).logits.float().numpy()
    np.save(out / "logits.npy", logits)
    print("fp8:", sorted(p.name for p in out.iterdir()), "of", len(stored), "tensors")


def _fused(floats: dict, model: DeepseekV3ForCausalLM) -> dict:
    """The checkpoint's per-expert tensors as the module's fused ``gate_up_proj``/``down_proj``."""
    state = {}
    for name in model.state_dict():
        if name in floats:
            state[name] = floats[name]
        elif name.endswith("experts.gate_up_proj"):
            prefix, n = name[: -len("gate_up_proj")], CONFIG.n_routed_experts
            state[name] = torch.stack(
                [
                    torch.cat(
                        [
                            floats[f"{prefix}{e}.gate_proj.weight"],
                            floats[f"{prefix}{e}.up_proj.weight"],
                        ]
                    )
                    for e in range(n)
                ]  # fmt: skip
            )
        elif name.endswith("experts.down_proj"):
            prefix, n = name[: -len("down_proj")], CONFIG.n_routed_experts
            state[name] = torch.stack([floats[f"{prefix}{e}.down_proj.weight"] for e in range(n)])
    return state


def main() -> None:
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(CONFIG).float().eval()
    randomize(model)
    out = HERE / "deepseek_v3"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    model.generation_config.eos_token_id = None  # every step argmax, none stopped or masked
    with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.float().numpy()
        greedy = model.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False)
        greedy = greedy[:, len(PROMPT[0]) :]
    np.save(out / "logits.npy", logits)
    (out / "greedy.json").write_text(
        json.dumps({"prompt": PROMPT, "continuation": greedy.tolist()}) + "\n"
    )
    again = DeepseekV3ForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        reread = again(torch.tensor(TOKENS)).logits.float().numpy()
    print("reloaded by transformers, max |logit diff|:", np.abs(reread - logits).max())
    print("files:", sorted(p.name for p in out.iterdir()))
    write_fp8(out, model)
    write_unshared()


def write_unshared() -> None:
    """``deepseek_v3_unshared/``: 2 layers of experts and no shared expert (``n_shared_experts``
    0, which transformers writes as shared-expert tensors of no elements), and its logits."""
    torch.manual_seed(1)
    config = dataclasses.replace(
        CONFIG, num_hidden_layers=2, first_k_dense_replace=0, n_shared_experts=0
    )
    model = DeepseekV3ForCausalLM(config).float().eval()
    randomize(model)
    out = HERE / "deepseek_v3_unshared"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    with torch.no_grad():
        np.save(out / "logits.npy", model(torch.tensor(TOKENS)).logits.float().numpy())


def describe(case: pathlib.Path) -> tuple[DeepseekV3ForCausalLM | None, dict]:
    """What mmnnx's ``save_pretrained`` wrote (tests/test_family_deepseek.py's ``save_saves``)
    in float32 and its record: the config mmnnx wrote and the dtype transformers loads it in
    (``deepseek_v3/saves_verdict.json``). A checkpoint transformers refuses (its CPU FP8
    dequantizer takes no partial edge blocks, as DeepSeek-V3 publishes and the FP8 fixture has)
    records the errors it logged, ``load_errors``, and no model; the FP8 fixture itself is tried
    as ``fixture-fp8``."""
    config = json.loads((case / "config.json").read_text())
    if errors := _load_errors(case):
        return None, {"config": config, "load_errors": errors}
    return in_float32(case, DeepseekV3ForCausalLM)[0], as_saved(case, DeepseekV3ForCausalLM)[1]


def _load_errors(case: pathlib.Path) -> list[str]:
    """The conversion errors transformers logs loading ``case`` on CPU (``[]``: it loads)."""
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        DeepseekV3ForCausalLM.from_pretrained(case, dtype=torch.float32)
    except RuntimeError:
        lines = (line.strip() for message in logged for line in message.splitlines())
        return sorted({line for line in lines if line.startswith("Weight shape")})
    finally:
        logger.removeHandler(handler)
    return []


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        fp8 = {"fixture-fp8": {"load_errors": _load_errors(HERE / "deepseek_v3_fp8")}}
        verdict = HERE / "deepseek_v3" / "saves_verdict.json"
        check_cases(pathlib.Path(sys.argv[2]), verdict, describe, tokens=TOKENS, cases=fp8)
    else:
        main()
