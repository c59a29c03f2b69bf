"""Outside implementations of Hugging Face's Llama and Qwen3, for checking ours against, and of
models the pipeline tests run as their projects wrote them.

`vendored/` holds the models and safetensors loaders as their projects wrote them (jax-ml/bonsai's
Qwen3 and Llama 3.2, google/tunix's Llama 3 and Qwen3 with its MoE layer), each file naming its
origin and the edits made to run here; `bonsai_qwen3`, `bonsai_llama`, `tunix_llama` and
`tunix_qwen3_moe` load a checkpoint with that project's own loader and return its logits.

What the outside code does that a checkpoint's config does not say:
- bonsai's Qwen3 computes RoPE with theta 1e6 whatever ``rope_theta`` is, and no scaling; its
  `forward` takes tokens equal to ``pad_id`` for padding and keeps the last position's logits
  (so `bonsai_qwen3` calls the model itself); its cache is bfloat16 unless told; its loader casts
  every tensor to float32.
- bonsai's Llama (an unmerged pull request) honours ``rope_theta`` and llama3 ``rope_scaling``;
  its loader keeps the file's dtype and refuses ``.bias`` tensors; its embedding computes in
  ``ModelConfig.dtype`` (bfloat16 by default).
- tunix's Llama 3 computes RoPE with theta 1e6 whatever ``rope_theta`` is (Llama 3's is 500000),
  and no scaling; its loader reads the safetensors header itself and assumes one dtype a file.
- tunix's Qwen3 MoE (`Qwen3MoeForCausalLM` checkpoints) computes RoPE with theta 1e6 likewise;
  with ``num_experts`` set every layer is a `MoELayer` (no ``decoder_sparse_step``, no
  ``mlp_only_layers``), its top-k weights always renormalised (``norm_topk_prob`` true), its
  experts' hidden size ``ModelConfig.hidden_dim`` (``moe_intermediate_size``); on CPU the layer
  runs every expert on the tokens masked to it (megablox and ragged all-to-all are TPU paths);
  its loader stacks each layer's experts after reading them (its "original" mode stacks file by
  file, so a layer's experts split over two files fail there; the "optimized" mode used here
  stacks over every file).
`bonsai_qwen3`, `tunix_llama` and `tunix_qwen3_moe` refuse a checkpoint whose RoPE their model
would not compute, and `tunix_qwen3_moe` one whose dense layers or routing it would not.

`vendored/bonsai_gpt_oss_modeling.py` (bonsai's gpt-oss, an unmerged pull request) and
`vendored/tunix_gemma4_model.py` (tunix's Gemma 4, its text model) are not loaded from a
checkpoint here: `bonsai_gpt_oss` and `tunix_gemma4` build them small with random weights for
tests/test_gpt_oss_pipeline.py and tests/test_gemma4_pipeline.py, which pipeline them as written.
"""

import contextlib
import json
import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def read_config(directory: str | pathlib.Path, architecture: str) -> dict:
    """``config.json`` of the checkpoint in ``directory``, which must be an ``architecture``."""
    config = json.loads((pathlib.Path(directory) / "config.json").read_text())
    if config["architectures"] != [architecture]:
        raise ValueError(
            f"{directory}: architectures {config['architectures']}, not {architecture}"
        )
    return config


def cast_params(model: nnx.Module, dtype: str) -> None:
    """Every parameter of ``model`` cast to ``dtype`` in place."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda a: jnp.asarray(a, dtype), state))


@contextlib.contextmanager
def quiet():
    """The outside code's uses of APIs deprecated in this JAX / Flax, not reported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def as_numpy(logits: jax.Array) -> np.ndarray:
    return np.asarray(jnp.asarray(logits, jnp.float32))
