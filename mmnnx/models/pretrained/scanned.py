"""A family's per-layer tensor rules mapped onto the modules of ``GPT(config)``'s layers: one
per layer unscanned, and with ``scan_layers`` one per segment (``GPTConfig.layer_path``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mmnnx.models.gpt import GPTConfig
from mmnnx.models.pretrained.names import TensorRule

_LAYER = "blocks/{layer}"


def layer_rules(rules: Sequence[TensorRule], config: GPTConfig) -> tuple[TensorRule, ...]:
    """``rules`` (tensor ``...{layer}...`` to Variable ``blocks/{layer}/...``) for the layers of
    ``GPT(config)``: as given unscanned; scanned, each stacked module's Variables filled by its
    layers' tensors (``TensorRule.layers``) and each layer left unstacked by its own.

    Example:
        >>> from mmnnx.modules import AttentionConfig, BlockConfig, MLPConfig, MoEConfig
        >>> dense = BlockConfig(AttentionConfig(2), MLPConfig(16))
        >>> moe = dataclasses.replace(dense, feed_forward=MoEConfig(16, 4, 2))
        >>> config = GPTConfig(dim=8, depth=3, num_heads=2, scan_layers=True,
        ...                    layers=(dense, moe, moe))
        >>> rule = TensorRule("layers.{layer}.norm", "blocks/{layer}/norm/scale")
        >>> for r in layer_rules([rule], config):
        ...     print(r.tensor, r.variable, r.layers)
        layers.0.norm blocks/0/norm/scale None
        layers.{layer}.norm blocks/1/norm/scale (1, 2)
    """
    if not config.scan_layers:
        return tuple(rules)
    groups: dict[str, list[int]] = {}
    for layer in range(config.depth):
        groups.setdefault(config.layer_path(layer)[0], []).append(layer)
    per_layer = [r for r in rules if r.variable is not None and _LAYER in r.variable]
    out = [r for r in rules if r not in per_layer]
    for path, layers in groups.items():
        stacked = config.layer_path(layers[0])[1] is not None
        for r in per_layer:
            variable = r.variable.replace(_LAYER, path)
            if stacked:
                out.append(dataclasses.replace(r, variable=variable, layers=tuple(layers)))
            else:
                (layer,) = layers
                tensor = r.tensor.replace("{layer}", str(layer))
                out.append(dataclasses.replace(r, tensor=tensor, variable=variable))
    return tuple(out)
