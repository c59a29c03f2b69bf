"""Tiny random Hugging Face checkpoints, laid out as a Hub repository holds them.

`write_checkpoint` writes what `LlamaForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`
repositories hold: ``config.json`` with the field set of meta-llama/Llama-3.2-1B,
Qwen/Qwen3-0.6B or Qwen/Qwen3-30B-A3B (sizes made tiny), the weights as ``model.safetensors``
or as ``model-0000i-of-0000N.safetensors`` shards with ``model.safetensors.index.json``, a
byte-level BPE ``tokenizer.json`` and ``generation_config.json``. Tensors are named and shaped
as transformers saves them (Linear weights ``(out, in)``); weights are random normal, norm
weights near 1 but not 1.
"""

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

# meta-llama/Llama-3.2-1B's config.json with tiny sizes; rope_scaling (a llama3 one there) is
# None unless given.
_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": None,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 384,
}
# Qwen/Qwen3-0.6B's config.json with tiny sizes: heads x head_dim (128) != hidden_size (64), as
# there (16 x 128 != 1024). rope_theta 1e6 is Qwen3's, and the value bonsai's Qwen3 assumes.
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": None,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 40960,
    "max_window_layers": 4,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 384,
}
# Qwen/Qwen3-30B-A3B's config.json with tiny sizes: 8 experts of hidden size 32 (128 of 768
# there), 2 per token (8), the dense MLP's intermediate_size kept for mlp_only_layers.
_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "decoder_sparse_step": 1,
    "eos_token_id": None,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 40960,
    "max_window_layers": 4,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 384,
}
CONFIGS = {
    "LlamaForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _QWEN3,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
}
MOE_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
)
SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
)
# Each family's first special tokens, in their order there, and which are bos and eos.
_SPECIAL = {
    "LlamaForCausalLM": ["<|begin_of_text|>", "<|end_of_text|>"],
    "Qwen3ForCausalLM": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "Qwen3MoeForCausalLM": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
}
_BOS_EOS = {
    "LlamaForCausalLM": ("<|begin_of_text|>", "<|end_of_text|>"),
    "Qwen3ForCausalLM": ("<|endoftext|>", "<|im_end|>"),
    "Qwen3MoeForCausalLM": ("<|endoftext|>", "<|im_end|>"),
}
_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A pipeline splits a model into stages, and each stage runs on its own devices.",
    "Tokens flow through the layers; the last stage turns hidden states into logits.",
    "Sharded checkpoints keep one index that maps every tensor to the file holding it.",
    "Rotary embeddings rotate pairs of query and key features by an angle per position.",
    "Grouped-query attention shares each key and value head among several query heads.",
    "Hello, world! 12345 67890 -- tabs\tand newlines\nare bytes like any others.",
    "Small random models make fast tests: the numbers matter, not the quality.",
]


def write_checkpoint(
    directory: str | pathlib.Path,
    *,
    architecture: str = "LlamaForCausalLM",
    tied: bool = False,
    dtype: str = "float32",
    shards: int = 2,
    seed: int = 0,
    rope_scaling: dict | None = None,
    tokenizer_size: int | None = None,
    **sizes: float,
) -> pathlib.Path:
    """Write a tiny random checkpoint of ``architecture`` into ``directory``; return its path.

    ``sizes`` override ``config.json``'s numbers (any of `SIZES`, and of `MOE_FIELDS` for a
    Qwen3-MoE: ``mlp_only_layers`` a list, ``norm_topk_prob`` a bool). ``shards=1`` writes one
    ``model.safetensors`` and no index. ``tokenizer_size`` is the number of tokens in
    ``tokenizer.json`` (default: ``vocab_size - 8``, spare embedding rows as in Qwen3; more
    than ``vocab_size`` makes a tokenizer that does not fit the model).

    Example:
        >>> import json, tempfile
        >>> path = write_checkpoint(tempfile.mkdtemp(), architecture="Qwen3ForCausalLM", tied=True)
        >>> config = json.loads((path / "config.json").read_text())
        >>> config["model_type"], config["tie_word_embeddings"], config["head_dim"]
        ('qwen3', True, 32)
        >>> index = json.loads((path / "model.safetensors.index.json").read_text())
        >>> sorted(set(index["weight_map"].values()))
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
        >>> "lm_head.weight" in index["weight_map"]
        False
        >>> path = write_checkpoint(tempfile.mkdtemp(), architecture="Qwen3MoeForCausalLM",
        ...                         mlp_only_layers=[0])
        >>> names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        >>> "model.layers.0.mlp.up_proj.weight" in names, len([n for n in names if "experts" in n])
        (True, 72)
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: expected one of {ARCHITECTURES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {tuple(DTYPES)}")
    known = SIZES + (MOE_FIELDS if architecture == "Qwen3MoeForCausalLM" else ())
    unknown = sorted(set(sizes) - set(known))
    if unknown:
        raise TypeError(f"unknown config fields {unknown}: expected some of {known}")
    if rope_scaling is not None and rope_scaling.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling {rope_scaling!r}: only a llama3 one is written")
    config = dict(CONFIGS[architecture])
    config.update(sizes, tie_word_embeddings=tied, torch_dtype=dtype, rope_scaling=rope_scaling)
    if "max_window_layers" in config:
        config["max_window_layers"] = config["num_hidden_layers"]
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError(
            f"num_attention_heads {config['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads {config['num_key_value_heads']}"
        )
    tensors = _weights(config, architecture, np.random.default_rng(seed))
    if not 1 <= shards <= len(tensors):
        raise ValueError(f"shards {shards}: expected 1 to {len(tensors)} (the tensor count)")
    if tokenizer_size is None:
        tokenizer_size = config["vocab_size"] - 8
    tokenizer = _tokenizer(architecture, tokenizer_size)
    bos, eos = _BOS_EOS[architecture]
    config["bos_token_id"] = tokenizer.token_to_id(bos)
    config["eos_token_id"] = tokenizer.token_to_id(eos)

    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", _generation_config(architecture, config))
    _write_weights(path, {k: v.astype(DTYPES[dtype]) for k, v in tensors.items()}, shards)
    return path


def _weights(config: dict, architecture: str, rng: np.random.Generator) -> dict:
    """Tensors in the order transformers' state dict lists them."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(*shape, std=0.1):
        return rng.normal(0.0, std, shape).astype(np.float32)

    def norm(n):
        return (1.0 + normal(n)).astype(np.float32)

    out = {"model.embed_tokens.weight": normal(v, d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = normal(q, d)
        out[p + "self_attn.k_proj.weight"] = normal(kv, d)
        out[p + "self_attn.v_proj.weight"] = normal(kv, d)
        out[p + "self_attn.o_proj.weight"] = normal(d, q)
        if architecture != "LlamaForCausalLM":  # Qwen3 and Qwen3-MoE
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
        if is_moe(config, i):  # Qwen3MoeSparseMoeBlock: the router (gate), then the experts
            e, h = config["num_experts"], config["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = normal(e, d)
            for j in range(e):
                out[p + f"mlp.experts.{j}.gate_proj.weight"] = normal(h, d)
                out[p + f"mlp.experts.{j}.up_proj.weight"] = normal(h, d)
                out[p + f"mlp.experts.{j}.down_proj.weight"] = normal(d, h)
        else:
            out[p + "mlp.gate_proj.weight"] = normal(f, d)
            out[p + "mlp.up_proj.weight"] = normal(f, d)
            out[p + "mlp.down_proj.weight"] = normal(d, f)
        out[p + "input_layernorm.weight"] = norm(d)
        out[p + "post_attention_layernorm.weight"] = norm(d)
    out["model.norm.weight"] = norm(d)
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = normal(v, d)
    return out


def is_moe(config: dict, layer: int) -> bool:
    """Whether layer ``layer`` of a ``config.json`` is a mixture of experts
    (``Qwen3MoeDecoderLayer``'s rule; no ``num_experts``: never).

    Example:
        >>> [is_moe({"num_experts": 8, "decoder_sparse_step": 2}, i) for i in range(4)]
        [False, True, False, True]
    """
    return (
        config.get("num_experts", 0) > 0
        and layer not in (config.get("mlp_only_layers") or [])
        and (layer + 1) % config.get("decoder_sparse_step", 1) == 0
    )


def _write_weights(path: pathlib.Path, tensors: dict, shards: int) -> None:
    """Contiguous runs of tensors, in order, near-equal in count: one per shard."""
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s, names in enumerate(np.array_split(list(tensors), shards)):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {str(n): tensors[n] for n in names}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    _write_json(path / "model.safetensors.index.json", index)


def _tokenizer(architecture: str, size: int) -> Tokenizer:
    """A byte-level BPE of ``size`` tokens: merges learnt on `_TEXT`, then the family's special
    tokens (at the end, as in Llama 3 and Qwen3), then reserved ones if merges ran short."""
    special = _SPECIAL[architecture]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if size < len(alphabet) + len(special):
        raise ValueError(
            f"tokenizer size {size}: a byte-level BPE needs at least "
            f"{len(alphabet) + len(special)} tokens (256 bytes and {special})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size - len(special), initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(_TEXT, trainer)
    tokenizer.add_special_tokens(special)
    reserved = size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|reserved_special_token_{i}|>" for i in range(reserved)])
    if architecture == "LlamaForCausalLM":
        bos = _BOS_EOS[architecture][0]
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def _generation_config(architecture: str, config: dict) -> dict:
    """meta-llama/Llama-3.2-1B's and Qwen/Qwen3-0.6B's (Qwen3-30B-A3B's alike)
    generation_config.json, token ids ours."""
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    if architecture == "LlamaForCausalLM":
        return {
            "_from_model_config": True,
            "bos_token_id": bos,
            "do_sample": True,
            "eos_token_id": eos,
            "temperature": 0.6,
            "top_p": 0.9,
            "transformers_version": config["transformers_version"],
        }
    return {
        "bos_token_id": bos,
        "do_sample": True,
        "eos_token_id": [eos, bos],
        "pad_token_id": bos,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": config["transformers_version"],
    }


def _write_json(path: pathlib.Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
