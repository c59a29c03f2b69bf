"""The engine's entry: a traced step and what is known of its inputs and outputs -> its plan.

``mm.jit`` (``jit.py``) traces a step (``trace_step.py``) and describes each input leaf
(:class:`~mmnnx.mpmd.step_io.StepInput`) and each output leaf
(:class:`~mmnnx.mpmd.step_io.StepOutput`); :func:`plan_step` then splits stacked layers over their
tasks, colours every op with a task, cuts the graph into fragments (pipelined per microbatch
where the step has an ``mm.microbatch`` loop), lowers them to a typed program and runs the
passes (``passes.py``). Nothing here knows Flax NNX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.cores import share_cores
from mmnnx.mpmd.lower.lower import lower
from mmnnx.mpmd.lower.passes import Passes
from mmnnx.mpmd.lower.plan import Plan
from mmnnx.mpmd.lower.program import StepProgram
from mmnnx.mpmd.plan.carry import resolve_rng_counts
from mmnnx.mpmd.plan.colour import colour
from mmnnx.mpmd.plan.cut import cut
from mmnnx.mpmd.plan.pipeline import plan_pipeline
from mmnnx.mpmd.plan.stack_split import Expansion, chunk_sharding, split_stacks
from mmnnx.mpmd.schedules import Schedule
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.mpmd.trace.trace_state import Trace
from mmnnx.sharding import Task


@dataclasses.dataclass(frozen=True)
class PlanningOptions:
    """How to plan a step (``mm.jit``'s options)."""

    residual_bytes: int = 0  # the largest residual packed (mm.jit(pack_residuals=...))
    weight_bytes: int = 0  # the largest block weight packed (mm.jit(pack_weights=...))
    recompute_residuals: bool = True  # backwards recompute cheap residuals
    schedule: str | Schedule | None = None  # replaces each mm.microbatch's schedule
    share_cores: bool = True  # edge stages cut around a middle stage's program


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """A planned step: what the runner needs, and what the processes compare."""

    graph: Graph  # the traced graph, stacked layers split over their tasks
    plan: Plan  # this process's plan
    lowered: StepProgram  # the program before the passes: the same on every process
    expansion: Expansion | None  # how stacked inputs and outputs map to the graph's
    plan_for: Callable[[int], Plan]  # another process's plan


def plan_step(
    graph: Graph,
    trace: Trace,
    inputs: Sequence[StepInput],
    outputs: Sequence[StepOutput],
    options: PlanningOptions,
    *,
    name: str = "the step",
    process: int = 0,
    num_processes: int = 1,
) -> PlannedStep:
    """Plans a traced step (``graph``, with its ``trace`` state) for ``process`` of
    ``num_processes``: one record per graph input and output, in order. ``name``: the step's,
    for messages. Compiles nothing.

    Example::

        planned = plan_step(graph, trace, inputs, outputs, PlanningOptions())
        print(planned.plan)
    """
    expansion = None
    if any(i.stack is not None for i in inputs):
        graph, expansion = split_stacks(graph, inputs, outputs)
        inputs = expansion.expand_inputs(inputs, _input_chunk)
        outputs = expansion.expand_outputs(outputs, _output_chunk)
    resolve_rng_counts(graph, {g: m.num_microbatches for g, m in trace.microbatches.items()})
    tasks = _tasks([i.task for i in inputs], trace.regions.values())
    colouring = colour(graph, inputs, outputs, tasks, trace.regions)
    free = {v for v, i in zip(graph.inputs, inputs, strict=True) if i.task is None}
    pipeline, op_tasks = plan_pipeline(
        graph,
        colouring.op_tasks,
        tasks,
        trace.microbatches,
        free,
        colouring.pinned,
        recompute_residuals=options.recompute_residuals,
        schedule=options.schedule,
        names={v: i.name for v, i in zip(graph.inputs, inputs, strict=True) if i.placed},
    )
    if pipeline is None:
        order = [(f, None) for f in cut(graph, op_tasks, tasks, free_inputs=free)]
    else:
        if options.share_cores:
            pipeline = share_cores(graph, pipeline)
        order = pipeline.order
    if graph.specs and any(t.jax_mesh.shape != tasks[0].jax_mesh.shape for t in tasks):
        raise MPMDError(
            f"mm.jit: {name} uses explicit mesh axes, but its mm.task regions run on meshes of "
            f"other shapes ({', '.join(repr(t.name) for t in tasks)}); give every task the same "
            "axis names and sizes"
        )
    lowered, transfers = lower(graph, tasks, inputs, outputs, order, pipeline)
    fragments = list({id(f): f for f, _ in order}.values())
    passes = Passes.of(
        lowered,
        graph,
        residual_bytes=options.residual_bytes,
        weight_bytes=options.weight_bytes,
        inputs=inputs,
        num_processes=num_processes,
    )

    def plan_for(process: int) -> Plan:
        return Plan(
            tasks=list(tasks),
            fragments=fragments,
            transfers=transfers,
            program=passes.share(process),
            pipeline=pipeline,
            inputs=list(graph.inputs),
            input_names=[i.name for i in inputs],
            unrolled=list(trace.unrolled),
        )

    return PlannedStep(
        graph=graph,
        plan=plan_for(process),
        lowered=lowered,
        expansion=expansion,
        plan_for=plan_for,
    )


def _input_chunk(item: StepInput, task: Task, index: int, home: Any) -> StepInput:
    return StepInput(
        name=f"{item.name}[{index}]",
        task=task,
        sharding=chunk_sharding(item, task, index, home),
        donated=item.donated,
    )


def _output_chunk(item: StepOutput, task: Task, index: int, home: Any) -> StepOutput:
    return StepOutput(home=task, spec=home[1], sharding=chunk_sharding(item, task, index, home))


def _tasks(input_tasks: Sequence[Task | None], regions: Any) -> list[Task]:
    """The step's tasks: those of its placed inputs, then of its ``mm.task`` regions."""
    tasks = list(dict.fromkeys([*(t for t in input_tasks if t is not None), *regions]))
    by_name: dict[str, Task] = {}
    for t in tasks:
        if by_name.setdefault(t.name, t) != t:
            raise MPMDError(f"mm.jit: two different tasks are named {t.name!r}")
    if not tasks:
        raise MPMDError(
            "mm.jit: no argument holds state placed on a task; place the model with mm.place or "
            "mm.init first"
        )
    return tasks
