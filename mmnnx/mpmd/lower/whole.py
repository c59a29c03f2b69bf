"""Whether every value of a step is whole on each device of its task (nothing split): then every
fragment's results are pinned replicated, as on one device, so their readers know their layout
before their producers compile, and packing (:mod:`~mmnnx.mpmd.lower.pack`) may take them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax.extend import core as jcore

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task

# Primitives that choose their results' layout (a sharding constraint: see _splits)
_LAYOUT_SETTERS = frozenset(
    {"reshard", "shard_map", "shard_alike", "custom_partitioning", "device_put"}
)


def _splits(name: str, params: dict, task: Task | None) -> bool:
    """Whether an op of primitive ``name`` on ``task`` may lay its result out split."""
    if name == "mm_sharding_constraint":
        return task is None or any(entry is not None for entry in task.resolve(params["names"]))
    if name == "sharding_constraint":
        return not getattr(params.get("sharding"), "is_fully_replicated", False)
    return name in _LAYOUT_SETTERS


def _sets_layout(name: str, params: dict, task: Task | None, known: dict) -> bool:
    """Whether an op on ``task``, or one at any depth inside it, splits a value (``known``: per
    nested jaxpr and task)."""
    if _splits(name, params, task):
        return True
    for sub in jcore.jaxprs_in_params(params):
        key = (id(sub), task)
        if key not in known:
            known[key] = any(
                _sets_layout(eqn.primitive.name, eqn.params, task, known) for eqn in sub.eqns
            )
        if known[key]:
            return True
    return False


def whole_everywhere(
    graph: Graph,
    tasks: Sequence[Task],
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    task_of: Mapping[int, Task],
) -> bool:
    """Whether every value of the step is whole on each device of its task: some task has several
    devices, the placed inputs and outputs' layouts are whole, and no op splits a value
    (``task_of``: each op's task by index)."""
    if all(task.jax_mesh.devices.size == 1 for task in tasks):
        return False
    shardings = [i.task_sharding for i in inputs] + [o.sharding for o in outputs]
    if not all(s is None or s.is_fully_replicated for s in shardings):
        return False
    known: dict[tuple, bool] = {}
    return not any(
        _sets_layout(op.name, op.params, task_of.get(op.index), known) for op in graph.ops
    )
