"""LoRA adapters of a pretrained ``GPT``, out in PEFT's layout or merged into the kernels."""

from __future__ import annotations

import functools
import os
import pathlib
from typing import Any

import jax
from flax import nnx

from mmnnx.models.pretrained.files import CheckpointError
from mmnnx.models.pretrained.names import TensorRule, tensors_of
from mmnnx.models.pretrained.save import Layout, model_values, write_checkpoint
from mmnnx.modules.linear import Linear
from mmnnx.sharding.arrays import placeholder, processes_of
from mmnnx.sharding.rules import path_str

ADAPTER = Layout(config="adapter_config.json", single="adapter_model.safetensors")
"""PEFT's files: one safetensors file, no index."""


def adapted(model: Any) -> list[tuple[str, Linear]]:
    return [
        (path_str(p), m)
        for p, m in nnx.iter_graph(model)
        if isinstance(m, Linear) and getattr(m, "lora", None) is not None
    ]


def merged_kernels(model: Any) -> dict[str, jax.Array]:
    """Each adapted kernel merged with its adapter (a placeholder where not held)."""
    out = {}
    for path, linear in adapted(model):
        kernel = linear.kernel[...]
        if jax.process_index() in processes_of(kernel.sharding):
            out[f"{path}/kernel"] = _merger(kernel.sharding)(
                kernel, linear.lora.a[...], linear.lora.b[...], linear.lora.scale
            )
        else:
            out[f"{path}/kernel"] = placeholder(kernel.shape, kernel.dtype, kernel.sharding)
    return out


@functools.cache
def _merger(sharding: Any) -> Any:
    return jax.jit(
        lambda k, a, b, scale: (k + (a @ b) * scale).astype(k.dtype), out_shardings=sharding
    )


def adapter_rules(rules: tuple[TensorRule, ...]) -> tuple[TensorRule, ...]:
    """PEFT's names for the adapters of the kernels ``rules`` name.

    Example:
        >>> rule = TensorRule("model.layers.{layer}.mlp.up_proj.weight",
        ...                   "blocks/{layer}/mlp/up/kernel", transpose=(1, 0))
        >>> a, b = adapter_rules((rule,))
        >>> a.tensor
        'base_model.model.model.layers.{layer}.mlp.up_proj.lora_A.weight'
        >>> a.variable, b.variable
        ('blocks/{layer}/mlp/up/lora/a', 'blocks/{layer}/mlp/up/lora/b')
    """
    return tuple(
        TensorRule(
            f"base_model.model.{rule.tensor[: -len('.weight')]}.{name}.weight",
            f"{rule.variable.removesuffix('/kernel')}/lora/{factor}",
            transpose=rule.transpose,
        )
        for rule in rules
        if rule.variable is not None and rule.variable.endswith("/kernel")
        for factor, name in (("a", "lora_A"), ("b", "lora_B"))
    )


EXPERT_MLP = ("gate_proj", "up_proj", "down_proj")
"""The projections a mixture's experts share their names with (Qwen3-MoE's, transformers 4)."""

WEIGHT_MODULES = ("router",)
"""Modules transformers 5 builds around a bare weight, not a ``Linear`` (gpt-oss's router,
``GptOssTopKRouter``): PEFT adapts them only as ``target_parameters`` and refuses them as
``target_modules``."""


def peft_targets(
    adapted: set[str], modules: set[str], *, experts: bool = False
) -> dict[str, list[str]]:
    """``adapter_config.json``'s targets for the modules ``adapted`` among all the ``modules``:
    a bare name where it adapts every module of that name, else the full names; with
    ``experts``, :data:`EXPERT_MLP` as ``target_parameters`` (transformers 5's PEFT maps every
    ``target_modules`` entry ending in those onto the fused experts, even the full name of a
    dense layer's or a shared expert's; as ``target_parameters`` it adapts that ``Linear``'s
    weight alone: Qwen3-MoE's ``mlp_only_layers``, DeepSeek-V3's first dense layers and shared
    experts, checked by tests/transformers_fixtures/check_adapters.py); :data:`WEIGHT_MODULES`
    as ``target_parameters`` always.

    Example:
        >>> mods = {f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("up_proj", "gate")}
        >>> mods |= {"model.layers.1.mlp.experts.0.up_proj"}
        >>> peft_targets({"model.layers.0.mlp.up_proj", "model.layers.1.mlp.gate",
        ...               "model.layers.0.mlp.gate"}, mods)
        {'target_modules': ['gate', 'model.layers.0.mlp.up_proj']}
        >>> peft_targets({"model.layers.0.mlp.up_proj"}, mods, experts=True)
        {'target_modules': [], 'target_parameters': ['model.layers.0.mlp.up_proj.weight']}
        >>> peft_targets({"model.layers.0.mlp.router"}, {"model.layers.0.mlp.router"})
        {'target_modules': [], 'target_parameters': ['model.layers.0.mlp.router.weight']}
    """
    leaves: dict[str, set[str]] = {}
    for module in modules | adapted:
        leaves.setdefault(module.rsplit(".", 1)[-1], set()).add(module)
    bare, full, parameters = set(), set(), set()
    for module in adapted:
        leaf = module.rsplit(".", 1)[-1]
        if leaf in WEIGHT_MODULES or experts and leaf in EXPERT_MLP:
            parameters.add(f"{module}.weight")
        elif leaves[leaf] <= adapted:
            bare.add(leaf)
        else:
            full.add(module)
    out = {"target_modules": sorted(bare) + sorted(full)}
    if parameters:
        out["target_parameters"] = sorted(parameters)
    return out


def save_adapter(
    model: Any,
    path: str | os.PathLike,
    rules: tuple[TensorRule, ...],
    *,
    base_model: str,
    dtype: Any,
    overwrite: bool = False,
) -> pathlib.Path:
    """Writes ``model``'s LoRA adapters in PEFT's layout (see ``pretrained.save_adapter``)."""
    if not (layers := adapted(model)):
        raise CheckpointError("the model has no LoRA adapters to write (add_lora adds them)")
    shapes = {(m.lora.rank, m.lora.alpha) for _, m in layers}
    if len(shapes) > 1:
        raise CheckpointError(f"adapters of several (rank, alpha): {sorted(shapes)}")
    ((rank, alpha),) = shapes
    values = {f"{p}/lora/{f}": getattr(m.lora, f)[...] for p, m in layers for f in ("a", "b")}
    lora_rules = adapter_rules(rules)
    adapted_modules = set()
    for variable, value in values.items():
        found = tensors_of(variable, value.shape, lora_rules)
        if found is None:
            raise CheckpointError(f"no PEFT name for the adapter {variable!r}")
        for name in found[1].values():  # base_model.model.{module}.lora_A.weight
            adapted_modules.add(name.removeprefix("base_model.model.").rsplit(".", 2)[0])
    modules = set()
    for variable, value in model_values(model).items():
        found = None if "/lora/" in variable else tensors_of(variable, value.shape, rules)
        if found is not None:
            modules |= {n.removesuffix(".weight") for n in found[1].values()}
    experts = any("{expert}" in r.tensor for r in rules)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        **peft_targets(adapted_modules, modules, experts=experts),
        "base_model_name_or_path": base_model,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    return write_checkpoint(
        values,
        path,
        lora_rules,
        config=config,
        dtype=dtype,
        overwrite=overwrite,
        layout=ADAPTER,
    )
