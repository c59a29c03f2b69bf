"""The model families ``from_pretrained`` knows, one module each: how a ``config.json``
becomes a ``GPTConfig`` and back, and which checkpoint tensor fills which ``GPT`` Variable.

A family is any value with the interface of :class:`PretrainedFamily`; a new one is a module
here with its own ``Family`` (or its own class) and one entry in :data:`FAMILIES`."""

from __future__ import annotations

from typing import Any, Protocol

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.families.deepseek import DEEPSEEK_V3, MODEL_TYPES
from mmnnx.models.pretrained.families.gemma3 import GEMMA3
from mmnnx.models.pretrained.families.gpt_oss import GPT_OSS
from mmnnx.models.pretrained.families.llama import LLAMA, QWEN3, QWEN3_MOE, Family
from mmnnx.models.pretrained.families.mistral import MISTRAL, MIXTRAL
from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.hf_config import architectures
from mmnnx.models.pretrained.names import TensorRule

__all__ = ["FAMILIES", "Family", "PretrainedFamily", "family_of"]


class PretrainedFamily(Protocol):
    """What ``from_pretrained``, ``save_pretrained`` and ``mmnnx export`` ask of a family."""

    architecture: str  # config.json's ``architectures`` entry
    model_type: str

    def gpt_config(self, hf: dict[str, Any], where: Any = "", **overrides: Any) -> GPTConfig: ...
    def hf_config(
        self, config: GPTConfig, torch_dtype: str, loaded: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...
    def cannot_hold(self, config: GPTConfig) -> list[str]: ...
    def tensor_rules(self, config: GPTConfig) -> tuple[TensorRule, ...]: ...


FAMILIES: dict[str, PretrainedFamily] = {
    f.architecture: f
    for f in (LLAMA, QWEN3, QWEN3_MOE, MISTRAL, MIXTRAL, GEMMA3, DEEPSEEK_V3, GPT_OSS)
}
"""The architectures ``from_pretrained`` builds, by their ``config.json`` name."""


def family_of(hf: dict[str, Any] | None, where: Any) -> PretrainedFamily:
    """The family a ``config.json`` names in ``architectures`` (else, as transformers'
    ``AutoModelForCausalLM`` does, by its ``model_type``), refusing a ``model_type`` that is not
    that family's: transformers would build another model from the same file.

    Example:
        >>> family_of({"architectures": ["Qwen3ForCausalLM"]}, "ckpt").model_type
        'qwen3'
        >>> family_of({"model_type": "llama"}, "ckpt").architecture
        'LlamaForCausalLM'
    """
    if hf is None:
        raise CheckpointError(f"{where}: no config.json (it names the model's architecture)")
    names = architectures(hf, where)
    kind = hf.get("model_type")
    if not names and kind is not None:
        names = [f.architecture for f in FAMILIES.values() if kind in model_types(f)]
    for name in names:
        if name in FAMILIES:
            family = FAMILIES[name]
            if kind is not None and kind not in model_types(family):
                raise CheckpointError(
                    f"{where}/config.json: model_type {kind!r} is not one mmnnx reads as {name} "
                    f"({', '.join(model_types(family))}); transformers would build the model of "
                    "that model_type from this file"
                )
            return family
    given = ", ".join(names) or (f"(none given; model_type {kind!r})" if kind else "(none given)")
    raise CheckpointError(
        f"{where}/config.json: architecture {given} is not supported; mmnnx builds "
        f"{', '.join(FAMILIES)}"
    )


def model_types(family: PretrainedFamily) -> tuple[str, ...]:
    """The ``config.json`` ``model_type``s read as ``family`` (Kimi K2 names its own).

    Example:
        >>> model_types(FAMILIES["DeepseekV3ForCausalLM"])
        ('deepseek_v3', 'kimi_k2')
    """
    return MODEL_TYPES if family is DEEPSEEK_V3 else (family.model_type,)
