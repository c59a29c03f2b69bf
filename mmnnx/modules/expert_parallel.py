"""Expert parallelism inside a task, over the mesh axes the experts were placed split over:
tokens travel to their experts' devices and back by a padded ``jax.lax.all_to_all`` (XLA:CPU
has no ``ragged_all_to_all``). Experts held whole while the tokens are split run under
``shard_map`` too (left to GSPMD, split tokens were gathered on every device)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec

from mmnnx.modules.experts import (
    ExpertFn,
    Experts,
    apply_local,
    combine,
    grouped_swiglu,
    sort_by_expert,
)
from mmnnx.sharding import Task, TaskStack, home_of
from mmnnx.sharding.place import SPEC_KEY
from mmnnx.sharding.task import axes_of


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How a task's devices share a mixture of experts."""

    mesh: AbstractMesh  # the task's mesh, abstract: one program serves every task of a stack
    expert_axes: tuple[str, ...]  # split the experts: the all_to_all's group
    token_axes: tuple[str, ...]  # split the tokens: the task's batch axes, then the expert axes
    hidden_axes: tuple[str, ...]  # split each expert's hidden dimension (a psum after down)

    @property
    def size(self) -> int:  # devices in an expert-parallel group (EP)
        return math.prod(self.mesh.shape[a] for a in self.expert_axes)

    @property
    def token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)


def expert_layout(gate: nnx.Variable) -> ExpertLayout | None:
    """The layout of experts placed split (or with the tokens split), else ``None``."""
    home = home_of(gate)
    if home is None:
        return None
    task = home.tasks[0] if isinstance(home, TaskStack) else home
    # a stacked Variable's spec, seen inside the scan over its layers, has the layer axis more
    spec = tuple(gate.get_metadata(SPEC_KEY, PartitionSpec()))[-len(gate.shape) :]
    spec = (*spec, None, None, None)[:3]
    expert_axes = axes_of(spec[0])
    batch_axes = axes_of(task.spec(("batch",))[0]) if isinstance(task, Task) else ()
    token_axes = batch_axes + tuple(a for a in expert_axes if a not in batch_axes)
    if not token_axes:
        return None
    hidden_axes = tuple(a for a in axes_of(spec[2]) if a not in token_axes)
    return ExpertLayout(
        mesh=task.jax_mesh.abstract_mesh,
        expert_axes=expert_axes,
        token_axes=token_axes,
        hidden_axes=hidden_axes,
    )


def apply_expert_parallel(
    layout: ExpertLayout,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: tuple[jax.Array, ...],
    *,
    limit: int | None = None,
    ffn: ExpertFn = grouped_swiglu,
    specs: Callable[[Any, Any], tuple[PartitionSpec, ...]] = Experts.specs,
) -> jax.Array:
    """``apply_local``'s result with tokens and experts split over the mesh (``limit``: a
    capacity)."""
    n, k = indices.shape
    local_tokens = n // layout.token_shards
    local_experts = experts[0].shape[0] // layout.size
    rows = local_tokens * k  # a destination's worst case: every assignment of this device
    if limit is not None:
        rows = min(rows, limit * local_experts)
    tokens = PartitionSpec(layout.token_axes)
    e, h = layout.expert_axes or None, layout.hidden_axes or None
    in_specs = (tokens, tokens, tokens, tokens, *specs(e, h))

    if layout.hidden_axes:  # each device's share of the hidden features: a psum follows
        ffn = functools.partial(ffn, hidden_axes=layout.hidden_axes)

    def body(x, indices, weights, keep, *arrays):
        if layout.expert_axes:
            return _exchange(layout, rows, x, indices, weights, keep, arrays, ffn)
        out = apply_local(x, indices, weights, keep, arrays, ffn)
        return jax.lax.psum(out, layout.hidden_axes) if layout.hidden_axes else out

    return jax.shard_map(
        body, mesh=layout.mesh, in_specs=in_specs, out_specs=tokens, check_vma=True
    )(x, indices, weights, keep, *experts)


def _exchange(
    layout: ExpertLayout,
    rows: int,
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    keep: jax.Array,
    experts: tuple[jax.Array, ...],
    ffn: ExpertFn,
) -> jax.Array:
    """One device's share (inside ``shard_map``): ``rows`` slots per destination."""
    n, k = indices.shape
    ep, local_experts = layout.size, experts[0].shape[0]
    num_experts = ep * local_experts
    key = jnp.where(keep, indices, num_experts).reshape(-1)  # dropped ones last
    order, inverse, _ = sort_by_expert(key, num_experts)
    sorted_key = key[order]
    dest = sorted_key // local_experts  # ep for a dropped assignment
    per_dest = jnp.zeros(ep, jnp.int32).at[dest].add(1, mode="drop")
    starts = jnp.cumsum(per_dest) - per_dest
    # slot (d, c) of the send buffer holds the sorted assignment starts[d] + c
    slot = jnp.arange(rows)
    filled = slot[None, :] < per_dest[:, None]
    source = jnp.minimum(starts[:, None] + slot[None, :], order.size - 1)
    send = jnp.where(filled[..., None], x[order[source] // k], 0)  # (ep, rows, D)
    send_expert = jnp.where(filled, sorted_key[source] % local_experts, local_experts)

    def swap(a):
        return jax.lax.all_to_all(a, layout.expert_axes, 0, 0, tiled=True)

    received, received_expert = swap(send), swap(send_expert)
    by_expert, back_order, sizes = sort_by_expert(received_expert.reshape(-1), local_experts)
    out = ffn(received.reshape(ep * rows, -1)[by_expert], *experts, sizes)
    if layout.hidden_axes:
        out = jax.lax.psum(out, layout.hidden_axes)
    returned = swap(out[back_order].reshape(ep, rows, -1)).reshape(ep * rows, -1)
    kept = sorted_key < num_experts
    at = dest * rows + jnp.arange(order.size) - starts[jnp.minimum(dest, ep - 1)]
    outputs = jnp.where(kept[:, None], returned[jnp.where(kept, at, 0)], 0)
    return combine(weights, outputs[inverse].reshape(n, k, -1))  # dropped ones: zeros
