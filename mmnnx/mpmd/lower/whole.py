"""Whether every value of a step is whole on each device of its task (nothing split).

A step whose inputs are all whole (one device, or replicated over their task) and which holds no
op choosing a layout gives the compiler nothing to split a value by: every fragment's results
come out replicated. The lowering then pins them so, as on a one-device task, and the programs
reading them know their layout before their producers compile; and packing
(:mod:`~mmnnx.mpmd.lower.pack`) may put them into flat buffers, as it does on one device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jax.extend import core as jcore

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.sharding import Task

# Primitives that choose their results' layout: with one at any depth, a value may be split over
# its task's devices however whole the step's inputs are. A sharding constraint counts only
# where it splits its value (:func:`_splits`).
_LAYOUT_SETTERS = frozenset(
    {"reshard", "shard_map", "shard_alike", "custom_partitioning", "device_put"}
)


def _splits(name: str, params: dict, task: Task | None) -> bool:
    """Whether an op of primitive ``name`` (with ``params``) on ``task`` may lay its result out
    split: a layout setter, or a sharding constraint naming an axis there."""
    if name == "mm_sharding_constraint":
        return task is None or any(entry is not None for entry in task.resolve(params["names"]))
    if name == "sharding_constraint":
        return not getattr(params.get("sharding"), "is_fully_replicated", False)
    return name in _LAYOUT_SETTERS


def _sets_layout(name: str, params: dict, task: Task | None, known: dict) -> bool:
    """Whether an op on ``task`` splits a value (:func:`_splits`), itself or an op at any depth
    inside it; ``known`` caches the answer per nested jaxpr and task (the same body is often
    called many times)."""
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


def _whole(sharding: Any) -> bool:
    return sharding is None or sharding.is_fully_replicated


def whole_everywhere(
    graph: Graph,
    tasks: Sequence[Task],
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    task_of: Mapping[int, Task],
) -> bool:
    """Whether every value of the step traced as ``graph`` is whole on each device of its task:
    some task has several devices (on one device every value is whole anyway), the step's
    placed inputs and its outputs' layouts are whole (an unplaced input is put replicated on
    its readers' tasks), and no op splits a value (:func:`_splits`, at any depth; ``task_of``:
    the task of each op by index)."""
    if all(task.jax_mesh.devices.size == 1 for task in tasks):
        return False
    if not all(_whole(i.task_sharding) for i in inputs):
        return False
    if not all(_whole(o.sharding) for o in outputs):
        return False
    known: dict[tuple, bool] = {}
    return not any(
        _sets_layout(op.name, op.params, task_of.get(op.index), known) for op in graph.ops
    )
