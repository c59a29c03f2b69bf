"""``LoRA``: a low-rank update beside a frozen ``Linear`` kernel, and ``add_lora``, which gives
the chosen projections of a model one, on the same tasks as their kernels."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx._nnx import logical_names
from mmnnx.modules.linear import Linear
from mmnnx.sharding.place import home_of, place
from mmnnx.sharding.rules import path_str
from mmnnx.sharding.stack import TaskStack

M = TypeVar("M")

TARGETS = ("q", "q_a", "q_b", "k", "v", "kv_a", "kv_b", "out", "gate", "up", "down")
"""``add_lora``'s default targets, those a model has: PEFT's ``"all-linear"`` less the head
(``q_a``, ``q_b``, ``kv_a``, ``kv_b``: a ``LatentAttention``'s projections)."""

MOE_TARGETS = ("router",)
"""``Linear`` names ``add_lora`` adapts only when named: a ``MoE``'s router, which PEFT's usual
Qwen3-MoE ``target_modules`` leave out (an update there unbalances the experts)."""


class LoRA(nnx.Module):
    """``(x @ a @ b) * alpha / rank``, the update of a ``Linear`` (Hu et al., 2021): ``a`` drawn as
    PEFT does, ``b`` zeros; ``lead`` prepends axes (a stacked kernel's), ``axes`` names the
    kernel's.

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     lora = LoRA(8, 4, rank=2, alpha=4.0, rngs=nnx.Rngs(0))
        >>> lora.a.shape, lora.b.shape, float(lora(jnp.ones((1, 8))).sum()), lora.scale
        ((8, 2), (2, 4), 0.0, 2.0)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        lead: tuple[int, ...] = (),
        axes: tuple[Any, ...] | None = None,
        rngs: nnx.Rngs,
    ):
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"LoRA: rank must be an int >= 1, got {rank!r}")
        axes = axes or (None,) * (len(lead) + 2)
        *lead_axes, in_axis, out_axis = axes
        bound = (1.0 / in_features) ** 0.5  # PEFT: kaiming_uniform_(a=sqrt(5)) on (rank, in)
        a = jax.random.uniform(
            rngs.params(), (*lead, in_features, rank), minval=-bound, maxval=bound
        )
        self.a = nnx.LoRAParam(a, out_sharding=(*lead_axes, in_axis, None))
        self.b = nnx.LoRAParam(
            jnp.zeros((*lead, rank, out_features)), out_sharding=(*lead_axes, None, out_axis)
        )
        self.rank, self.alpha, self.scale = rank, float(alpha), float(alpha) / rank

    def __call__(self, x: jax.Array) -> jax.Array:
        return (x @ self.a[...].astype(x.dtype)) @ self.b[...].astype(x.dtype) * self.scale


def add_lora(
    model: M,
    *,
    rank: int,
    alpha: float | None = None,
    targets: Sequence[str] | None = None,
    seed: int = 0,
) -> M:
    """Gives every ``Linear`` of ``model`` named in ``targets`` (default: those of :data:`TARGETS`
    it has) a :class:`LoRA` of scale ``alpha / rank`` on its kernel's task; returns ``model``. Train
    the adapters alone with ``wrt=nnx.LoRAParam``. Raises ``ValueError`` for a target naming no
    ``Linear`` or a model that has adapters already.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=2, vocab_size=64), rngs=nnx.Rngs(0))
        ...     model = add_lora(model, rank=4, targets=("q", "v"))
        >>> model.blocks[1].attn.q.lora.a.shape, model.blocks[1].attn.k.lora
        ((32, 4), None)
    """
    linears = [(p, m) for p, m in nnx.iter_graph(model) if isinstance(m, Linear)]
    names = sorted({str(p[-1]) for p, _ in linears})
    if targets is None:
        targets = [t for t in TARGETS if t in names]
    if unknown := [t for t in targets if t not in names]:
        raise ValueError(
            f"add_lora: {', '.join(map(repr, unknown))} names no Linear of "
            f"{type(model).__name__}; its Linear layers are named {', '.join(names)}"
        )
    rngs = nnx.Rngs(seed)
    rules = []
    for path, linear in linears:
        if str(path[-1]) not in targets:
            continue
        if linear.lora is not None:
            raise ValueError(f"add_lora: {path_str(path)} already has an adapter")
        kernel = linear.kernel
        names = tuple(logical_names(kernel) or (None, None))  # a stacked kernel's layer axis: None
        with nnx.use_eager_sharding(False):
            linear.lora = LoRA(
                linear.in_features,
                linear.out_features,
                rank=rank,
                alpha=rank if alpha is None else alpha,
                lead=tuple(kernel.shape[:-2]),
                axes=(None,) * (kernel.ndim - len(names)) + names[-kernel.ndim :],
                rngs=rngs,
            )
        home = home_of(kernel)
        if home is not None:
            task = list(home.tasks) if isinstance(home, TaskStack) else home
            rules.append((f"^{re.escape(path_str(path))}/lora/", task))
    if rules:
        place(model, rules, strict=False)
    return model
