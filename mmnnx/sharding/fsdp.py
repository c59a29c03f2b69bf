"""FSDP inside a task: every Variable's largest dimension that its own spec leaves whole, sharded
over one mesh axis of its task (ZeRO-3). Parameters, and the optimizer state made from them,
then take ``1/N`` of their bytes on each device; inside ``mm.jit`` each task's program is SPMD,
so GSPMD gathers a weight where an op uses it and reduce-scatters its gradient.

``fsdp_rules`` rewrites placement rules; ``mm.place`` / ``mm.init`` take what it returns, for
any model. A Variable that no free dimension of divides stays whole on the axis
(:class:`FSDPReplicatedWarning` names it): refusing a scalar or an odd-sized vector would refuse
most models, and such Variables are small.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence

from flax import nnx
from jax.sharding import PartitionSpec

from mmnnx._nnx import logical_names
from mmnnx.sharding.place import declared_spec
from mmnnx.sharding.rules import SpecOrFn, compile_rules
from mmnnx.sharding.stack import TaskStack
from mmnnx.sharding.task import Task, axes_of


class FSDPReplicatedWarning(UserWarning):
    """A Variable :func:`fsdp_rules` could not shard: none of its free dimensions is divisible
    by the axis size, so each device of the axis keeps all of it."""


def shard_largest(
    spec: PartitionSpec,
    shape: Sequence[int],
    axis: str,
    sizes: Mapping[str, int],
    *,
    skip: int = 0,
) -> PartitionSpec | None:
    """``spec`` with ``axis`` added on the largest dimension of ``shape`` (from dimension ``skip``
    on) that ``spec`` leaves whole and the axis size divides (the first of equal ones); failing one,
    on the largest already sharded dimension that the axes on it together with ``axis`` divide
    (``('model', 'fsdp')``)."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if any(axis in axes_of(e) for e in entries):
        return spec

    def split(d: int) -> int:
        return math.prod(sizes[a] for a in axes_of(entries[d])) * sizes[axis]

    fits = [d for d in range(skip, len(shape)) if shape[d] % split(d) == 0]
    free = [d for d in fits if entries[d] is None]
    if not fits:
        return None
    best = max(free or fits, key=lambda d: (shape[d], -d))
    entries[best] = axis if entries[best] is None else (*axes_of(entries[best]), axis)
    return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class ShardLargest:
    """A placement rule's spec function: the spec the rule gave (``base``: a PartitionSpec, a
    function, or ``None`` for the Variable's own logical names on ``task``) with ``axis`` added on
    its largest free dimension (:func:`shard_largest`)."""

    task: Task | TaskStack
    axis: str
    base: SpecOrFn = None

    def __call__(self, path: str, variable: nnx.Variable) -> PartitionSpec:
        stacked = isinstance(self.task, TaskStack)
        first = self.task.tasks[0] if stacked else self.task
        shape = tuple(variable.get_value().shape)
        spec = self._base(first, path, variable)
        if stacked and len(spec) == len(shape) - 1 and logical_names(variable) is not None:
            spec = PartitionSpec(None, *spec)  # the layer axis, as mm.place adds it
        sizes = dict(first.jax_mesh.shape)
        sharded = shard_largest(spec, shape, self.axis, sizes, skip=1 if stacked else 0)
        if sharded is None:
            warnings.warn(
                f"fsdp_rules: Variable {path!r} of shape {shape} on task {self.task.name!r} stays "
                f"whole over axis {self.axis!r} of size {sizes[self.axis]}: no dimension of it "
                f"is divisible by that (times the axes its spec {spec} puts on it)",
                FSDPReplicatedWarning,
                stacklevel=2,
            )
            return spec
        return sharded

    def _base(self, task: Task, path: str, variable: nnx.Variable) -> PartitionSpec:
        if isinstance(self.base, PartitionSpec):
            return self.base
        if self.base is not None:
            return self.base(path, variable)
        return declared_spec(task, variable, f"Variable {path!r} on task {task.name!r}")


def fsdp_rules(rules: Sequence[tuple] | Mapping, axis: str = "fsdp") -> list[tuple]:
    """Rules placing as ``rules`` do, each Variable's largest free dimension also sharded over its
    task's mesh axis ``axis`` (FSDP, ZeRO-3, inside each task: :class:`ShardLargest`). Raises
    ``ValueError`` for a task without ``axis``, and what ``mm.place`` raises for ``rules``.

    Example:
        >>> from mmnnx.sharding import TaskMesh, place
        >>> t = Task("t", mesh=TaskMesh(devices=range(4), axis_sizes=(2, 2),
        ...                              axis_names=("data", "fsdp")))
        >>> model = place(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), fsdp_rules([(".*", t)]))
        >>> model.kernel.get_value().sharding.spec, model.bias.get_value().sharding.spec
        (P(None, 'fsdp'), P('fsdp',))
    """
    if not isinstance(axis, str):
        raise TypeError(f"fsdp_rules: axis {axis!r} is not a mesh axis name (a str)")
    given = list(rules.items()) if isinstance(rules, Mapping) else rules
    compiled = compile_rules(given)
    out = []
    for rule, original in zip(compiled, given, strict=True):
        members = rule.task.tasks if isinstance(rule.task, TaskStack) else (rule.task,)
        for task in members:
            if axis not in task.axis_names:
                raise ValueError(
                    f"fsdp_rules: {rule.describe()}: task {task.name!r} has no mesh axis "
                    f"{axis!r} to shard over; its axes are {task.axis_names}"
                )
        out.append((original[0], original[1], ShardLargest(rule.task, axis, rule.spec)))
    return out
