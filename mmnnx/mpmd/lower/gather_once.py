"""Weights gathered once per step (``mm.jit(gather_weights=axis)``): FSDP under pipelining
without a gather per microbatch.

Each pipeline action is its own SPMD program, so a weight sharded over an FSDP axis is gathered
inside every forward and backward that reads it: about ``2M`` gathers per weight per step.
With ``gather_weights``, lowering gives each pipeline stage's programs the weight laid out
without ``axis`` instead: the step gathers it once, before the first program on its task reads
it, and every microbatch reads that copy, released after the last (torchtitan's
``reshard_after_forward=False`` under pipelining). The gathered copies of a stage's weights are
then held through its busy span: the memory FSDP saved for the parameters is spent again during
the step, while the optimizer state and the gradient sums stay sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.step_io import StepInput
from mmnnx.sharding import Task


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with mesh axis ``axis`` taken out of every entry.

    Example:
        >>> without_axis(PartitionSpec(("model", "fsdp"), "fsdp", None), "fsdp")
        P('model', None, None)
    """
    entries = []
    for entry in spec:
        kept = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def gathered_layouts(
    graph: Graph, inputs: Sequence[StepInput], tasks: Sequence[Task], axis: str
) -> dict[int, NamedSharding]:
    """The layout without ``axis`` of each step input (value id) placed on a task and sharded
    over ``axis``: where pipeline stages read it.

    Raises:
        ValueError: no task of ``tasks`` has a mesh axis ``axis``, naming the tasks' axes.

    Example:
        >>> from mmnnx.sharding import TaskMesh
        >>> t = Task("t", mesh=TaskMesh(devices=range(2), axis_names=("fsdp",)))
        >>> w = StepInput(name="w", task=t, spec=PartitionSpec("fsdp"),
        ...               sharding=t.sharding(PartitionSpec("fsdp")))
        >>> gathered_layouts(Graph(inputs=[0]), [w], [t], "fsdp")[0].spec
        P(None,)
    """
    if not any(axis in t.axis_names for t in tasks):
        axes = ", ".join(f"{t.name!r}: {t.axis_names}" for t in tasks)
        raise ValueError(
            f"mm.jit: gather_weights={axis!r} names no mesh axis of the step's tasks ({axes})"
        )
    out = {}
    for v, item in zip(graph.inputs, inputs, strict=True):
        layout = item.task_sharding if item.task is not None else None
        if isinstance(layout, NamedSharding):
            spec = without_axis(layout.spec, axis)
            if spec != layout.spec:
                out[v] = NamedSharding(layout.mesh, spec)
    return out
