"""Writes the load probe's checkpoints: for each family, ``--per-family`` tiny random models whose
configs are drawn from what transformers 5 accepts (sizes, head sizes, activations, biases, norm
epsilons, tied heads, RoPE kinds, sliding windows and layer patterns, experts and routers), each
saved by transformers' own ``save_pretrained`` with its float32 logits and greedy continuation.
Not part of the test suite: run by hand with the oracle venv (CPU torch, transformers 5; never a
dependency of mmnnx or its tests), then ``tests/load_probe.py`` with mmnnx's:

    /work/oracle/bin/python tests/transformers_fixtures/make_load_probe.py /tmp/load-probe
    .venv/bin/python -m tests.load_probe /tmp/load-probe

Each case is ``<dir>/<family>-<n>/``: the checkpoint, ``expected.npz`` (``tokens`` ``(2, 20)``,
``logits``, ``prompt``, ``continuation``: transformers' greedy tokens after each row's first
``prompt``) and ``case.json`` (the config's drawn keys). A case is saved in float32 or
bfloat16 (its logits then those of the bfloat16 weights), in one file or several. The draws
are seeded: the same arguments write the same cases; ``--first N`` numbers them from ``N``.
"""

import json
import pathlib
import random
import shutil
import sys

import numpy as np
import torch
import transformers
from make_deep_fixtures import randomize
from transformers import AutoModelForCausalLM

SEQ, PROMPT, NEW_TOKENS = 20, 6, 10


def _heads(r: random.Random) -> dict:
    heads = r.choice([2, 4])
    return dict(
        hidden_size=r.choice([32, 48]),
        num_attention_heads=heads,
        num_key_value_heads=r.choice([k for k in (1, 2, 4) if heads % k == 0]),
        head_dim=r.choice([8, 16, 12]),
        num_hidden_layers=r.choice([2, 3]),
        vocab_size=r.choice([96, 131]),
        rms_norm_eps=r.choice([1e-6, 1e-5, 0.1]),
        tie_word_embeddings=r.random() < 0.3,
        max_position_embeddings=r.choice([64, 256]),
    )


def _rope(r: random.Random, kinds: tuple[str, ...]) -> dict:
    theta = r.choice([10000.0, 500.0, 1e6])
    kind = r.choice(kinds)
    extra = {
        "default": {},
        "linear": {"factor": r.choice([2.0, 4.0])},
        "dynamic": {"factor": 2.0},
        "llama3": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        "yarn": {
            "factor": r.choice([2.0, 4.0]),
            "original_max_position_embeddings": 16,
            "beta_fast": r.choice([32.0, 8.0]),
            "beta_slow": 1.0,
            **r.choice([{}, {"truncate": False}, {"attention_factor": 1.3}]),
        },
    }[kind]
    return {"rope_type": kind, "rope_theta": theta, **extra}


def _window(r: random.Random, layers: int) -> list[str]:
    return [r.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]


def llama(r):
    return dict(
        _heads(r),
        intermediate_size=r.choice([40, 64]),
        hidden_act=r.choice(["silu", "silu", "gelu", "relu", "gelu_pytorch_tanh"]),
        attention_bias=r.random() < 0.3,
        mlp_bias=r.random() < 0.3,
        rope_parameters=_rope(r, ("default", "linear", "llama3", "yarn", "dynamic")),
    )


def qwen3(r):
    c = dict(
        _heads(r),
        intermediate_size=r.choice([40, 64]),
        hidden_act=r.choice(["silu", "silu", "gelu"]),
        attention_bias=r.random() < 0.3,
        rope_parameters=_rope(r, ("default", "yarn", "linear")),
    )
    if r.random() < 0.5:
        c |= dict(use_sliding_window=True, sliding_window=r.choice([3, 5, 8]))
        if r.random() < 0.5:
            c["max_window_layers"] = r.choice([0, 1])
        else:
            c["layer_types"] = _window(r, c["num_hidden_layers"])
    return c


def qwen3_moe(r):
    c = dict(
        _heads(r),
        intermediate_size=r.choice([40, 64]),
        moe_intermediate_size=r.choice([16, 24]),
        num_experts=r.choice([4, 6]),
        num_experts_per_tok=r.choice([1, 2, 3]),
        decoder_sparse_step=r.choice([1, 1, 2]),
        norm_topk_prob=r.random() < 0.5,
        hidden_act="silu",
        attention_bias=r.random() < 0.2,
        rope_parameters=_rope(r, ("default", "yarn")),
    )
    if r.random() < 0.4:
        c["mlp_only_layers"] = [0]
    if r.random() < 0.3:
        c |= dict(use_sliding_window=True, sliding_window=r.choice([3, 5]))
    return c


def mistral(r):
    return dict(
        _heads(r),
        intermediate_size=r.choice([40, 64]),
        hidden_act=r.choice(["silu", "silu", "gelu"]),
        sliding_window=r.choice([None, 3, 5, 8]),
        rope_parameters=_rope(r, ("default", "linear", "yarn")),
    )


def mixtral(r):
    return dict(
        _heads(r),
        intermediate_size=r.choice([16, 24]),
        num_local_experts=r.choice([4, 6]),
        num_experts_per_tok=r.choice([1, 2, 3]),
        hidden_act="silu",
        sliding_window=r.choice([None, 4, 8]),
        rope_parameters=_rope(r, ("default", "yarn")),
    )


def gemma3(r):
    c = _heads(r)
    layers = _window(r, c["num_hidden_layers"])
    return dict(
        c,
        intermediate_size=r.choice([40, 64]),
        hidden_activation=r.choice(["gelu_pytorch_tanh", "gelu_pytorch_tanh", "silu"]),
        query_pre_attn_scalar=r.choice([16, 24, 8]),
        sliding_window=r.choice([3, 5, 8]),
        layer_types=layers,
        attention_bias=r.random() < 0.2,
        final_logit_softcapping=r.choice([None, None, 5.0]),
        attn_logit_softcapping=r.choice([None, None, 2.0]),
        use_bidirectional_attention=r.random() < 0.1,
        rope_parameters={
            "full_attention": _rope(r, ("default", "linear")),
            "sliding_attention": {"rope_type": "default", "rope_theta": r.choice([10000.0, 500.0])},
        },
    )


def gpt_oss(r):
    c = _heads(r)
    return dict(
        c,
        intermediate_size=r.choice([16, 24]),
        num_local_experts=r.choice([4, 6]),
        num_experts_per_tok=r.choice([1, 2, 3]),
        sliding_window=r.choice([3, 5, 8]),
        layer_types=_window(r, c["num_hidden_layers"]),
        attention_bias=r.random() < 0.8,
        swiglu_limit=r.choice([7.0, 0.5]),
        swiglu_alpha=r.choice([1.702, 1.0]),
        rope_parameters=_rope(r, ("yarn", "default")),
    )


def deepseek_v3(r):
    c = _heads(r)
    c.pop("head_dim")
    c["num_key_value_heads"] = c["num_attention_heads"]
    routed = r.choice([4, 8])
    group = r.choice([1, 2, 4] if routed == 8 else [1, 2])
    rope = _rope(r, ("default", "yarn"))
    if rope["rope_type"] == "yarn" and r.random() < 0.6:
        rope |= {"mscale": r.choice([1.0, 0.707]), "mscale_all_dim": r.choice([1.0, 0.707, 0.0])}
    return dict(
        c,
        intermediate_size=r.choice([40, 64]),
        moe_intermediate_size=r.choice([16, 24]),
        q_lora_rank=r.choice([None, 16]),
        kv_lora_rank=r.choice([8, 16]),
        qk_nope_head_dim=r.choice([8, 16]),
        qk_rope_head_dim=r.choice([4, 8]),
        v_head_dim=r.choice([8, 12]),
        n_routed_experts=routed,
        n_shared_experts=r.choice([0, 1, 2]),
        num_experts_per_tok=r.choice([1, 2, 3]),
        n_group=group,
        topk_group=r.choice([g for g in (1, 2, 4) if g <= group]),
        first_k_dense_replace=r.choice([0, 1]),
        routed_scaling_factor=r.choice([1.0, 2.5]),
        norm_topk_prob=r.random() < 0.5,
        rope_interleave=r.random() < 0.5,
        attention_bias=r.random() < 0.2,
        rope_parameters=rope,
    )


FAMILIES = {
    "llama": (transformers.LlamaConfig, llama),
    "qwen3": (transformers.Qwen3Config, qwen3),
    "qwen3-moe": (transformers.Qwen3MoeConfig, qwen3_moe),
    "mistral": (transformers.MistralConfig, mistral),
    "mixtral": (transformers.MixtralConfig, mixtral),
    "gemma3": (transformers.Gemma3TextConfig, gemma3),
    "gpt-oss": (transformers.GptOssConfig, gpt_oss),
    "deepseek_v3": (transformers.DeepseekV3Config, deepseek_v3),
}


def drawn_save(seed: int) -> tuple[torch.dtype, str]:
    """The dtype a case is saved in and the largest file of it: bfloat16 one case in three, in
    files of at most 20 kB (several, with an index) one in four."""
    r = random.Random(seed)
    return r.choice([torch.float32, torch.float32, torch.bfloat16]), r.choice(
        ["5GB"] * 3 + ["20kB"]
    )


def write_case(out: pathlib.Path, family: str, drawn: dict, seed: int) -> None:
    config_class, _ = FAMILIES[family]
    config = config_class(**drawn, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    randomize(family, model)
    dtype, shard = drawn_save(seed)
    model.to(dtype).save_pretrained(out, max_shard_size=shard)
    again = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (2, SEQ))
    with torch.no_grad():
        logits = again(torch.tensor(tokens)).logits.float().numpy()
        again.generation_config.eos_token_id = None
        generated = again.generate(
            torch.tensor(tokens[:, :PROMPT]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones((2, PROMPT), dtype=torch.long),
        )
    np.savez(
        out / "expected.npz",
        tokens=tokens.astype(np.int32),
        logits=logits,
        prompt=PROMPT,
        continuation=generated[:, PROMPT:].numpy().astype(np.int32),
    )
    saved = {"dtype": str(dtype), "max_shard_size": shard}
    (out / "case.json").write_text(json.dumps(drawn | saved, indent=1, default=str) + "\n")


def main(root: pathlib.Path, per_family: int, first: int = 0) -> None:
    shutil.rmtree(root, ignore_errors=True)
    for family, (_, draw) in FAMILIES.items():
        for n in range(first, first + per_family):
            seed = n * 1000 + len(family)
            drawn = draw(random.Random(f"{family}-{n}"))
            out = root / f"{family}-{n}"
            try:
                write_case(out, family, drawn, seed)
            except Exception as e:  # a draw transformers itself refuses: not a case
                shutil.rmtree(out, ignore_errors=True)
                print(f"{family}-{n}: transformers refuses: {type(e).__name__}: {e}"[:300])
    print(len(list(root.iterdir())), "cases; transformers", transformers.__version__)


if __name__ == "__main__":

    def option(name: str, default: int) -> int:
        return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default

    main(pathlib.Path(sys.argv[1]), option("--per-family", 16), option("--first", 0))
