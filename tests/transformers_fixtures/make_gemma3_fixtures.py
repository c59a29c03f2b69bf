"""Writes the Gemma 3 fixtures, and checks what mmnnx writes, with transformers 5. Not part of
the test suite: run by hand with CPU torch and transformers 5 (never a dependency of mmnnx or
its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_gemma3_fixtures.py

writes ``tests/transformers_fixtures/gemma3/``: a tiny random ``Gemma3ForCausalLM`` saved by
transformers' own ``save_pretrained`` (``config.json``, ``model.safetensors``,
``generation_config.json``) with 4 layers, 3 sliding (window 4) and 1 global, linear RoPE
scaling on the global layer, a tied head, and ``expected.npz``: :data:`TOKENS` ``(2, 12)``, their
float32 logits ``(2, 12, 128)``, and the greedy continuation (``continuation``, ``(2, 8)``) of
their first :data:`PROMPT` tokens (``generate``, its key/value cache windowed in sliding layers).

    /work/main/.venv/bin/python -c "import pathlib, tests.test_family_gemma3 as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-gemma3-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/make_gemma3_fixtures.py \\
        --check /tmp/mmnnx-gemma3-saves

loads each checkpoint mmnnx wrote (beside it, ``<case>.npy``: mmnnx's logits of ``TOKENS``
from those files) in transformers and keeps the verdict as ``gemma3/verdict.json``: the
``config.json`` read, the dtype and ``rope_parameters`` transformers resolves, and its float32
logits' largest difference from mmnnx's, relative to the largest logit; for a directory with
``adapter_config.json``, PEFT loads it onto its base and the logits are compared the same way.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from oracle import as_saved, check_cases, in_float32
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

HERE = pathlib.Path(__file__).parent
OUT = HERE / "gemma3"
TOKENS = np.array(
    [[3, 17, 120, 9, 101, 77, 5, 42, 11, 0, 99, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]],
    np.int64,
)
PROMPT = 5  # tokens before the greedy continuation
NEW_TOKENS = 8  # a prompt and continuation of 13 tokens, past the window of 4
CONFIG = Gemma3TextConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # heads x head_dim != hidden_size
    query_pre_attn_scalar=24,  # not head_dim: the score scale matters
    sliding_window=4,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def make() -> None:
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(CONFIG).float().eval()
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: weights near 0, not 0
        for name, p in model.named_parameters():
            p.normal_(0, 0.2 if name.endswith("norm.weight") else 0.1)
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT)
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = model(tokens).logits.float().numpy()
        generated = model.generate(
            tokens[:, :PROMPT],
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            attention_mask=torch.ones_like(tokens[:, :PROMPT]),
        )
    continuation = generated[:, PROMPT:].numpy()
    np.savez(
        OUT / "expected.npz",
        tokens=TOKENS,
        logits=logits,
        prompt=np.array(PROMPT),
        continuation=continuation,
    )
    again = Gemma3ForCausalLM.from_pretrained(OUT)
    print("rope_parameters:", again.config.rope_parameters, "layers:", again.config.layer_types)
    print("files:", sorted(p.name for p in OUT.iterdir()), "continuation:", continuation.tolist())
    (OUT / "versions.json").write_text(
        json.dumps({"transformers": transformers.__version__, "torch": torch.__version__}) + "\n"
    )


def describe(case: pathlib.Path) -> tuple[torch.nn.Module, dict]:
    """``case`` in float32 (an adapter: PEFT's onto the fixture) and its record: the config, the
    dtype, ``rope_parameters`` and ``layer_types`` transformers resolves (the adapter's config)."""
    if (case / "adapter_config.json").exists():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(OUT, dtype=torch.float32)
        adapter = json.loads((case / "adapter_config.json").read_text())
        return PeftModel.from_pretrained(base, case), {"adapter_config": adapter}
    auto, record = as_saved(case)
    rope, layers = auto.config.rope_parameters, auto.config.layer_types
    return in_float32(case)[0], {**record, "rope_parameters": rope, "layer_types": layers}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        tokens = np.load(OUT / "expected.npz")["tokens"]
        check_cases(
            pathlib.Path(sys.argv[2]), OUT / "verdict.json", describe, tokens=tokens, sort_keys=True
        )
    else:
        make()
