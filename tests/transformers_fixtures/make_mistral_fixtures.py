"""Writes the Mistral and Mixtral fixtures with transformers 5, and checks what mmnnx writes.
Not part of the test suite: run by hand with CPU torch and transformers 5 (never a dependency
of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_mistral_fixtures.py

rewrites ``tests/transformers_fixtures/{mistral,mixtral}/``: a tiny random checkpoint saved by
transformers' own ``save_pretrained`` (``config.json``, ``model.safetensors``,
``generation_config.json``), its float32 ``logits.npy`` for make_fixtures.py's ``TOKENS``
(``(2, 16, vocab)``) and ``greedy.json``, transformers' greedy continuation (``generate``
with its key/value cache) of the first :data:`PROMPT` tokens of each row, and for the Mixtral
``loss.json`` (make_fixtures.py's ``moe_loss``: its cross-entropy and load-balancing loss, and
whether its loss adds that by default). The Mistral attends
within a sliding window of 4 positions (shorter than the 16 tokens); the Mixtral has none
(``null``) and routes each token to 2 of 8 experts.

``--fused`` writes ``mixtral-fused/`` (see :func:`write_fused`): the Mixtral's weights in the
fused layout transformers 5 also loads.

The second step checks what mmnnx's ``save_pretrained`` writes:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_family_mistral as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-mistral-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/make_mistral_fixtures.py \\
        --check /tmp/mmnnx-mistral-saves

loads each ``<case>/`` (beside it ``<case>.npy``, mmnnx's logits from those files) in
transformers 5 and keeps in ``mistral_verdict.json`` the config it wrote, what transformers
loaded (missing and unexpected tensors, its sliding window and experts) and the largest
difference of transformers' float32 logits from mmnnx's, relative to the largest logit.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from make_fixtures import SMALL, TOKENS, moe_loss
from oracle import check_cases, loaded
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
)

HERE = pathlib.Path(__file__).parent
PROMPT = 5  # tokens of each row of TOKENS given to generate
NEW_TOKENS = 8
FIXTURES = {
    "mistral": (
        MistralForCausalLM,
        MistralConfig(
            **{**SMALL, "head_dim": 8}, sliding_window=4, rope_parameters=dict(rope_theta=1e4)
        ),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(
            **{**SMALL, "intermediate_size": 8, "head_dim": None},  # null: hidden // heads
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
}


def write_fixtures() -> None:
    torch.manual_seed(0)
    for name, (cls, config) in FIXTURES.items():
        model = cls(config).float().eval()
        with torch.no_grad():  # norms near 1, not 1: their weights matter
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                else:
                    p.normal_(0, 0.1)
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out)
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS)).logits.float().numpy()
            prompt = torch.tensor(TOKENS[:, :PROMPT])
            generated = model.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        np.save(out / "logits.npy", logits)
        greedy = {"prompt": prompt.tolist(), "continuation": generated[:, PROMPT:].tolist()}
        (out / "greedy.json").write_text(json.dumps(greedy) + "\n")
        if config.model_type == "mixtral":
            (out / "loss.json").write_text(json.dumps(moe_loss(model), indent=2) + "\n")
        again = cls.from_pretrained(out)
        print(name, "sliding_window:", again.config.sliding_window, "greedy:", greedy)
        print("  files:", sorted(p.name for p in out.iterdir()))


def describe(case: pathlib.Path) -> tuple[PreTrainedModel, dict]:
    """``case`` in float32 and what transformers loaded, with its sliding window and experts."""
    model, record = loaded(case)
    experts = getattr(model.config, "num_local_experts", None)
    return model, {**record, "sliding_window": model.config.sliding_window, "experts": experts}


def write_fused() -> None:
    """``mixtral-fused/``: the Mixtral fixture's weights under the names transformers 5 holds
    in memory (``mlp.gate``, ``mlp.experts.gate_up_proj`` and ``down_proj``, every expert in one
    3-D tensor), written with safetensors beside its ``config.json``; ``fused_verdict.json``:
    what transformers 5 loads from it (missing and unexpected tensors) and the largest difference
    of its logits from the fixture's ``logits.npy``, relative to the largest logit."""
    from safetensors.torch import save_file

    model = MixtralForCausalLM.from_pretrained(HERE / "mixtral", dtype=torch.float32).eval()
    out = HERE / "mixtral-fused"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(HERE / "mixtral" / "config.json", out / "config.json")
    again, info = MixtralForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    with torch.no_grad():
        theirs = again.eval()(torch.tensor(TOKENS)).logits.numpy().astype(np.float64)
    expected = np.load(HERE / "mixtral" / "logits.npy").astype(np.float64)
    verdict = {
        "transformers": transformers.__version__,
        "tensors": sorted(state),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "logits_error": float(np.abs(theirs - expected).max() / np.abs(expected).max()),
    }
    (out / "fused_verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
    print(verdict)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fused"]:
        write_fused()
    elif sys.argv[1:2] == ["--check"]:
        check_cases(pathlib.Path(sys.argv[2]), HERE / "mistral_verdict.json", describe)
    else:
        write_fixtures()
