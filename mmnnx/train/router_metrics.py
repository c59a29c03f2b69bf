"""The routers' metrics of a train step: what each ``MoE`` layer sows under ``nnx.capture``,
reduced over microbatches and layers to the scalars ``fit`` logs."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import nnx

from mmnnx.modules.moe import METRICS, MoE


@dataclasses.dataclass(frozen=True)
class RouterMetrics:
    """A step's routing, over its MoE layers: each a mean over the layers of that layer's value
    in the step (its calls and microbatches together), but ``load_imbalance``, the worst
    layer's."""

    aux_loss: float  # router_aux_loss: a layer's load-balancing loss, mean over microbatches
    z_loss: float  # router_z_loss: a layer's router z-loss, mean over microbatches
    dropped_tokens: float  # assignments a layer's capacity dropped in the step (0: dropless)
    tokens_per_expert: tuple[float, ...]  # assignments each expert computed; dropless, they sum
    # to the step's tokens x experts_per_token
    load_imbalance: float  # max over layers of max / mean tokens per expert (1: even)

    def scalars(self) -> dict[str, float]:
        """The metrics as scalars by TensorBoard tag: ``router_aux_loss``, ``router_z_loss``,
        ``dropped_tokens``, ``expert_load_imbalance`` and ``tokens_per_expert/<e>``.

        Example:
            >>> m = RouterMetrics(aux_loss=1.0, z_loss=0.5, dropped_tokens=0.0,
            ...                   tokens_per_expert=(3.0, 1.0), load_imbalance=1.5)
            >>> m.scalars()["tokens_per_expert/1"], m.scalars()["expert_load_imbalance"]
            (1.0, 1.5)
        """
        return {
            "router_aux_loss": self.aux_loss,
            "router_z_loss": self.z_loss,
            "dropped_tokens": self.dropped_tokens,
            "expert_load_imbalance": self.load_imbalance,
        } | {f"tokens_per_expert/{e}": count for e, count in enumerate(self.tokens_per_expert)}

    def record(self) -> dict[str, Any]:
        """The fields of a ``metrics.jsonl`` row: the scalars, the tokens per expert a list."""
        scalars = {k: v for k, v in self.scalars().items() if "/" not in k}
        return scalars | {"tokens_per_expert": list(self.tokens_per_expert)}

    def line(self) -> str:
        """The metrics of a plain log line."""
        return f"aux_loss {self.aux_loss:.4f} load max/mean {self.load_imbalance:.2f}"


def has_router_metrics(model: Any) -> bool:
    """Whether ``model`` holds a ``MoE`` layer, whose metrics a train step can capture.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=16, depth=2, experts=4, moe_every=2), rngs=nnx.Rngs(0))
        >>> has_router_metrics(model), has_router_metrics(model.blocks[0])
        (True, False)
    """
    return any(isinstance(node, MoE) for _, node in nnx.iter_graph(model))


def router_metrics(captured: Any, *, microbatched: bool) -> RouterMetrics | None:
    """The :class:`RouterMetrics` of the Intermediates a step captured (an ``nnx.State`` as
    ``nnx.capture(..., nnx.Intermediate)`` returns it, its arrays fetched), or ``None`` when
    it holds no MoE metrics. ``microbatched``: each value has a leading microbatch axis
    (``mm.microbatch(..., reduce="stack")``); a stack of layers (``scan_layers``) adds its layer
    axis after it.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> import jax.numpy as jnp
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=16, depth=2, experts=4), rngs=nnx.Rngs(0))
        >>> _, captured = nnx.capture(lambda m, b: m.loss(b), nnx.Intermediate)(
        ...     model, jnp.zeros((2, 9), jnp.int32))
        >>> metrics = router_metrics(captured, microbatched=False)
        >>> sum(metrics.tokens_per_expert)  # 16 tokens, 2 experts each, in each of 2 layers
        32.0
    """
    layers: dict[str, list[np.ndarray]] = {name: [] for name in METRICS}
    lead = 2 if microbatched else 1  # the calls of a layer, then its microbatches
    for path, variable in nnx.to_flat_state(captured):
        name = path[-1] if path else None
        if name not in METRICS:
            continue
        calls = variable.get_value()
        calls = calls if isinstance(calls, tuple) else (calls,)
        values = np.stack([np.asarray(v) for v in calls])
        if name == "tokens_per_expert":
            per_layer = values.sum(axis=tuple(range(lead)))
            layers[name].extend(per_layer.reshape(-1, per_layer.shape[-1]))
        elif name == "dropped_tokens":
            layers[name].extend(values.sum(axis=tuple(range(lead))).reshape(-1))
        else:
            layers[name].extend(values.mean(axis=tuple(range(lead))).reshape(-1))
    if not layers["tokens_per_expert"]:
        return None
    counts = np.stack(layers["tokens_per_expert"]).astype(np.float64)
    means = counts.mean(axis=1)
    imbalance = np.where(means > 0, counts.max(axis=1) / np.where(means > 0, means, 1), 1.0)
    return RouterMetrics(
        aux_loss=float(np.mean(layers["router_aux_loss"])),
        z_loss=float(np.mean(layers["router_z_loss"])),
        dropped_tokens=float(np.mean(layers["dropped_tokens"])),
        tokens_per_expert=tuple(float(c) for c in counts.mean(axis=0)),
        load_imbalance=float(imbalance.max()),
    )
