"""Writes the 4-layer fixtures of every family: a tiny random checkpoint per family saved by
transformers' own ``save_pretrained``, deep enough for 4 pipeline stages, its layers of mixed
kinds where the family has them (Qwen3-MoE dense and sparse in turn, DeepSeek-V3 one dense
then mixtures of experts, gpt-oss and Gemma 3 sliding and full attention in turn), and
transformers' float32 logits for :data:`TOKENS`. Not part of the test suite: run by hand with
the oracle venv (CPU torch, transformers 5; never a dependency of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_deep_fixtures.py

It rewrites ``tests/transformers_fixtures/deep/<family>/``: ``config.json``,
``model.safetensors`` and ``generation_config.json`` as transformers writes them, and
``expected.npz`` (``tokens`` int32 ``(2, 16)``, ``logits`` float32 ``(2, 16, vocab)``, and
transformers' greedy ``continuation`` ``(2, NEW_TOKENS)`` of each row's first ``prompt`` tokens:
past the sliding window of 4, so the windowed layers' caches wrap).
tests/test_family_conformance.py reads them.
"""

import pathlib
import shutil

import numpy as np
import torch
import transformers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

OUT = pathlib.Path(__file__).parent / "deep"
VOCAB = 64
TOKENS = np.array(
    [[3, 17, 60, 9, 51, 37, 5, 42, 11, 0, 49, 63, 31, 8, 27, 2], list(range(1, 17))], np.int32
)
PROMPT = 5
NEW_TOKENS = 8
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
SLIDING_FULL = ["sliding_attention", "full_attention"] * 2
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SMALL, rope_parameters=dict(rope_theta=5e5))),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, rope_parameters=dict(rope_theta=1e6))),
    "qwen3-moe": (  # decoder_sparse_step 2: layers 1 and 3 mixtures of experts, 0 and 2 dense
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(
            **SMALL,
            rope_parameters=dict(rope_theta=1e6),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "mistral": (
        MistralForCausalLM,
        MistralConfig(**SMALL, sliding_window=4, rope_parameters=dict(rope_theta=1e4)),
    ),
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(
            **{**SMALL, "intermediate_size": 8}, num_local_experts=4, num_experts_per_tok=2
        ),
    ),
    "gemma3": (  # sliding_window_pattern 2: sliding and global layers in turn
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **{**SMALL, "tie_word_embeddings": True},
            query_pre_attn_scalar=12,
            sliding_window=4,
            layer_types=SLIDING_FULL,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        ),
    ),
    "gpt-oss": (
        GptOssForCausalLM,
        GptOssConfig(
            **{**SMALL, "intermediate_size": 8, "rms_norm_eps": 1e-5},
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=4,
            layer_types=SLIDING_FULL,
            swiglu_limit=1.0,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        ),
    ),
    "deepseek_v3": (  # first_k_dense_replace 1: layer 0 dense, layers 1-3 mixtures of experts
        DeepseekV3ForCausalLM,
        DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            moe_intermediate_size=8,
            num_hidden_layers=4,
            first_k_dense_replace=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=8,
            kv_lora_rank=8,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=4,
            rms_norm_eps=1e-6,
            max_position_embeddings=64,
            tie_word_embeddings=False,
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
        ),
    ),
}


def randomize(name: str, model: torch.nn.Module) -> None:
    """Weights large enough that every one moves the logits; norms near their identity."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") and name != "gemma3":  # Gemma's: 1 + weight
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # steers the choice of experts
                b.copy_(0.3 * torch.randn_like(b))


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    for name, (cls, config) in FAMILIES.items():
        torch.manual_seed(0)
        model = cls(config).float().eval()
        randomize(name, model)
        out = OUT / name
        model.save_pretrained(out)
        again = cls.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()
            reread = again(torch.tensor(TOKENS, dtype=torch.long)).logits.float().numpy()
        assert np.array_equal(logits, reread), name
        model.generation_config.eos_token_id = None  # every step argmax, none stopped or masked
        prompt = torch.tensor(TOKENS[:, :PROMPT], dtype=torch.long)
        with torch.no_grad():
            generated = model.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        continuation = generated[:, PROMPT:].numpy().astype(np.int32)
        np.savez(
            out / "expected.npz",
            tokens=TOKENS,
            logits=logits,
            prompt=PROMPT,
            continuation=continuation,
        )
        size = sum(p.stat().st_size for p in out.iterdir())
        print(name, model.config.layer_types if hasattr(model.config, "layer_types") else "", size)
    print("transformers", transformers.__version__, "torch", torch.__version__)


if __name__ == "__main__":
    main()
