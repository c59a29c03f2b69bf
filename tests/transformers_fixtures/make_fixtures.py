"""Writes the transformers 5 fixtures: tiny random checkpoints saved by transformers' own
``save_pretrained`` and transformers' logits for fixed tokens. Not part of the test suite:
run by hand in a venv with CPU torch, transformers 5 and safetensors (never a dependency of
mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_fixtures.py

It rewrites ``tests/transformers_fixtures/<name>/`` (``config.json``, ``model.safetensors``,
``generation_config.json`` as transformers writes them) and ``<name>/logits.npy``
(float32, ``(2, 16, vocab)``, for :data:`TOKENS`), plus ``versions.json``. The tests read
them (tests/test_transformers_fixtures.py).

``--fused`` writes ``qwen3-moe-fused/`` (see :func:`write_fused`): the Qwen3-MoE's weights in
the fused layout transformers 5 also loads.
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

HERE = pathlib.Path(__file__).parent
TOKENS = np.array(
    [[3, 17, 120, 9, 101, 77, 5, 42, 11, 0, 99, 64, 31, 8, 127, 2], list(range(1, 17))],
    np.int64,
)
SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # heads x head_dim != hidden_size, as Qwen3's
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
# Llama 3.1's scaling with a small original context: at 16 positions this head_dim's
# frequencies fall in all three of its bands (kept, interpolated, divided by the factor).
LLAMA3 = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
FIXTURES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters=dict(rope_theta=500000.0))),
    "llama3-scaled": (
        LlamaForCausalLM,
        LlamaConfig(**{**SMALL, "tie_word_embeddings": True}, rope_parameters=LLAMA3),
    ),
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **{**SMALL, "tie_word_embeddings": True}, rope_parameters=dict(rope_theta=1000000.0)
        ),
    ),
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **{k: v for k, v in SMALL.items()},
            rope_parameters=dict(rope_theta=1000000.0),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            mlp_only_layers=[0],  # layer 0 dense, layer 1 a mixture of experts
        ),
    ),
    # YaRN as Qwen3's long-context configs set it, on a short original context: at 16 positions
    # the ramp between extrapolated and interpolated frequencies and the attention factor matter
    "qwen3-yarn": (
        Qwen3ForCausalLM,
        Qwen3Config(
            **SMALL,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=4.0,
                original_max_position_embeddings=8,
            ),
        ),  # fmt: skip
    ),
}
YARN = {  # transformers' own inv_freq and attention factor for these rope_parameters
    "truncated": dict(factor=4.0, original_max_position_embeddings=8),
    "not truncated": dict(factor=4.0, original_max_position_embeddings=8, truncate=False),
    "deepseek mscale": dict(
        factor=40.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=1.0,
        beta_fast=32,
        beta_slow=1,
    ),  # fmt: skip
    "mscale ratio": dict(
        factor=8.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0
    ),  # fmt: skip
    "attention factor given": dict(
        factor=2.0,
        original_max_position_embeddings=32,
        attention_factor=1.5,
        beta_fast=16,
        beta_slow=2,
    ),  # fmt: skip
}


def yarn_parameters() -> dict:
    """inv_freq and attention factor of ``ROPE_INIT_FUNCTIONS["yarn"]`` for :data:`YARN`."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    out = {}
    for name, params in YARN.items():
        config = LlamaConfig(
            hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, **params),
        )  # fmt: skip
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        out[name] = {"params": params, "inv_freq": inv_freq.tolist(), "attention_factor": factor}
    return out


def moe_loss(model) -> dict:
    """The next-token loss of ``TOKENS`` (inputs all but the last token) as transformers'
    ``Qwen3MoeForCausalLM`` adds it up: the cross-entropy, and ``router_aux_loss_coef`` times
    the load-balancing loss (``aux_loss``) only when router logits are output."""
    inputs, targets = torch.tensor(TOKENS[:, :-1]), torch.tensor(TOKENS[:, 1:])
    with torch.no_grad():
        out = model(inputs, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())
        plain = model(inputs, labels=torch.tensor(TOKENS[:, :-1]))  # its own default
    return {
        "cross_entropy": float(ce),
        "aux_loss": float(out.aux_loss),
        "router_aux_loss_coef": model.config.router_aux_loss_coef,
        "output_router_logits": model.config.output_router_logits,
        "loss_by_default_has_aux": plain.aux_loss is not None,
    }


def main() -> None:
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
        np.save(out / "logits.npy", logits)
        if config.model_type == "qwen3_moe":
            (out / "loss.json").write_text(json.dumps(moe_loss(model), indent=2) + "\n")
        # what transformers reads back from its own files
        again = cls.from_pretrained(out)
        print(name, "rope_parameters:", again.config.rope_parameters, "dtype:", again.config.dtype)
        print("  files:", sorted(p.name for p in out.iterdir()))
    (HERE / "yarn.json").write_text(json.dumps(yarn_parameters(), indent=1) + "\n")
    (HERE / "versions.json").write_text(
        json.dumps(
            {
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "tokens": TOKENS.tolist(),
            },
            indent=2,
        )
        + "\n"
    )


def write_fused() -> None:
    """``qwen3-moe-fused/``: the Qwen3-MoE fixture's weights under the names transformers 5
    holds in memory (each MoE layer's ``mlp.experts.gate_up_proj`` and ``down_proj``, every
    expert in one 3-D tensor; the dense layer's ``mlp.gate_proj``...), written with safetensors
    beside its ``config.json``; ``fused_verdict.json``: the tensors, what transformers 5 loads
    from it (missing and unexpected tensors) and the largest difference of its logits from the
    fixture's ``logits.npy``, relative to the largest logit."""
    from safetensors.torch import save_file

    model = Qwen3MoeForCausalLM.from_pretrained(HERE / "qwen3-moe", dtype=torch.float32).eval()
    out = HERE / "qwen3-moe-fused"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(HERE / "qwen3-moe" / "config.json", out / "config.json")
    again, info = Qwen3MoeForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    with torch.no_grad():
        theirs = again.eval()(torch.tensor(TOKENS)).logits.numpy().astype(np.float64)
    expected = np.load(HERE / "qwen3-moe" / "logits.npy").astype(np.float64)
    verdict = {
        "transformers": transformers.__version__,
        "tensors": {k: list(v.shape) for k, v in sorted(state.items())},
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "logits_error": float(np.abs(theirs - expected).max() / np.abs(expected).max()),
    }
    (out / "fused_verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")
    print(verdict)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fused"]:
        write_fused()
    else:
        main()
