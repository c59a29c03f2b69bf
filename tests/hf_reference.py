"""Logits of a Hugging Face Llama / Qwen3 / Qwen3-MoE checkpoint in numpy float64, from
transformers' formulas.

Written from ``modeling_llama.py`` / ``modeling_qwen3.py`` / ``modeling_qwen3_moe.py`` and
``modeling_rope_utils.py``:
RMSNorm ``x * rsqrt(mean(x^2) + eps) * w``; rotate-half RoPE with ``rope_theta`` (and llama3
``rope_scaling``, `_compute_llama3_parameters`); grouped-query attention scaled by
``head_dim ** -0.5`` with a causal mask; Qwen3's RMSNorm of each query and key head before RoPE;
``down(silu(gate(x)) * up(x))``; Qwen3-MoE's sparse block in its MoE layers
(``Qwen3MoeSparseMoeBlock``: a softmax over every expert of the router's logits, the top
``num_experts_per_tok``, renormalised when ``norm_topk_prob``, the chosen experts' SwiGLU outputs
summed with those weights; float32 in transformers, float64 here); the embedding as the head
when tied.
"""

import json
import math
import pathlib

import numpy as np
from safetensors.numpy import load_file

from tests.hf_checkpoints import is_moe

ARCHITECTURES = (["LlamaForCausalLM"], ["Qwen3ForCausalLM"], ["Qwen3MoeForCausalLM"])


def read_tensors(directory: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``directory``, in float64, found through the index.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> tensors = read_tensors(write_checkpoint(tempfile.mkdtemp(), dtype="bfloat16"))
        >>> tensors["model.embed_tokens.weight"].shape, tensors["lm_head.weight"].dtype
        ((384, 64), dtype('float64'))
    """
    path = pathlib.Path(directory)
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return {k: v.astype(np.float64) for k, v in load_file(path / "model.safetensors").items()}
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        for name, value in load_file(path / file).items():
            if weight_map.get(name) != file:
                raise ValueError(f"{path / file}: {name} is not mapped to this file in {index}")
            out[name] = value.astype(np.float64)
    if set(out) != set(weight_map):
        raise ValueError(f"{index}: tensors {sorted(set(weight_map) - set(out))} not in files")
    return out


def inverse_frequencies(config: dict) -> np.ndarray:
    """RoPE's inverse frequencies, llama3 ``rope_scaling`` applied (transformers'
    `_compute_default_rope_parameters` and `_compute_llama3_parameters`).

    Example:
        >>> inverse_frequencies({"head_dim": 4, "rope_theta": 100.0, "rope_scaling": None})
        array([1. , 0.1])
    """
    hd = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, hd, 2) / hd)
    scaling = config.get("rope_scaling")
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return inv_freq
    if kind != "llama3":
        raise NotImplementedError(f"rope_scaling of type {kind!r}")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return np.where(medium, smoothed, scaled)


def swiglu(h: np.ndarray, w: dict[str, np.ndarray], prefix: str) -> np.ndarray:
    """``down(silu(gate(h)) * up(h))`` of the ``{prefix}{gate,up,down}_proj.weight`` tensors.

    Example:
        >>> w = {f"{n}_proj.weight": np.ones((2, 2)) for n in ("gate", "up", "down")}
        >>> swiglu(np.ones((1, 2)), w, "").round(3).tolist()  # 2 * silu(2) * 2
        [[7.046, 7.046]]
    """
    gate = h @ w[prefix + "gate_proj.weight"].T
    up = h @ w[prefix + "up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ w[prefix + "down_proj.weight"].T


def sparse_moe(h: np.ndarray, w: dict[str, np.ndarray], prefix: str, config: dict) -> np.ndarray:
    """``Qwen3MoeSparseMoeBlock`` on ``h`` ``(..., D)``: the router ``{prefix}gate.weight``'s
    softmax over every expert, the ``num_experts_per_tok`` most probable (ties to the lower
    index), their weights divided by their sum when ``norm_topk_prob`` (transformers' default:
    not), then ``sum_k weight_k * swiglu(h, experts.{e_k})``, token by token.

    Example:
        >>> w = {"gate.weight": np.array([[1.0, 0.0], [0.0, 1.0]])}
        >>> w.update({f"experts.{e}.{n}_proj.weight": np.full((2, 2), e + 1.0)
        ...           for e in (0, 1) for n in ("gate", "up", "down")})
        >>> config = {"num_experts_per_tok": 1, "norm_topk_prob": True}
        >>> out = sparse_moe(np.array([[1.0, 0.0]]), w, "", config)  # expert 0, weight 1
        >>> bool(np.allclose(out, swiglu(np.array([[1.0, 0.0]]), w, "experts.0.")))
        True
    """
    k = config["num_experts_per_tok"]
    flat = h.reshape(-1, h.shape[-1])
    logits = flat @ w[prefix + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, -1)
    if config.get("norm_topk_prob", False):
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(flat)
    for n in range(flat.shape[0]):
        for e, weight in zip(chosen[n], weights[n], strict=True):
            out[n] += weight * swiglu(flat[n : n + 1], w, f"{prefix}experts.{e}.")[0]
    return out.reshape(h.shape)


def reference_logits(directory: str | pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    """Logits ``(B, T, vocab_size)`` in float64 of the checkpoint in ``directory`` for ``tokens``
    ``(B, T)``, every sequence starting at position 0.

    Example:
        >>> import tempfile
        >>> from tests.hf_checkpoints import write_checkpoint
        >>> path = write_checkpoint(tempfile.mkdtemp(), architecture="Qwen3ForCausalLM")
        >>> reference_logits(path, np.array([[1, 2, 3]])).shape
        (1, 3, 384)
    """
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    if config["architectures"] not in ARCHITECTURES:
        raise NotImplementedError(f"architectures {config['architectures']}")
    for field, value in [("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)]:
        if config.get(field, value) != value:
            raise NotImplementedError(f"{field} {config[field]!r} (only {value!r} here)")
    w = read_tensors(directory)
    eps, hd = config["rms_norm_eps"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tokens = np.asarray(tokens)
    b, t = tokens.shape

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight

    angles = np.arange(t)[:, None] * inverse_frequencies(config)[None, :]  # (T, hd/2)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]  # (T, 1, hd/2)

    def rope(x):  # (B, T, N, hd), rotate-half
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    causal = np.tril(np.ones((t, t), dtype=bool))
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, kv_heads, hd)
        if p + "self_attn.q_norm.weight" in w:
            q = norm(q, w[p + "self_attn.q_norm.weight"])
            k = norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k = np.repeat(k, heads // kv_heads, axis=2)  # query head n reads kv head n // group
        v = np.repeat(v, heads // kv_heads, axis=2)
        scores = np.einsum("bqnd,bknd->bnqk", q, k) * hd**-0.5
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, t, heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        if is_moe(config, i):
            x = x + sparse_moe(h, w, p + "mlp.", config)
        else:
            x = x + swiglu(h, w, p + "mlp.")
    x = norm(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if config["tie_word_embeddings"] else w["lm_head.weight"]
    return x @ head.T
