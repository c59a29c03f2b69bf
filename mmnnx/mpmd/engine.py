"""The engine's entry: a pure function of array leaves traced (:func:`trace`), planned
(:func:`build_step`, :func:`plan_step`) and wrapped in the runner's
:class:`~mmnnx.mpmd.run.runner.Executable`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from mmnnx._gc import cyclic_gc_paused
from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.cores import share_cores
from mmnnx.mpmd.lower.lower import lower
from mmnnx.mpmd.lower.pack import (
    PACK_RESIDUAL_BYTES,
    PACK_WEIGHT_BYTES,
    residual_bound,
    weight_bound,
)
from mmnnx.mpmd.lower.passes import Passes
from mmnnx.mpmd.lower.plan import Plan
from mmnnx.mpmd.lower.program import StepProgram
from mmnnx.mpmd.plan.carry import resolve_rng_counts
from mmnnx.mpmd.plan.checkpoint_split import split_checkpoints
from mmnnx.mpmd.plan.colour import colour
from mmnnx.mpmd.plan.cut import cut
from mmnnx.mpmd.plan.pipeline import plan_pipeline
from mmnnx.mpmd.plan.stack_split import Expansion, chunk_sharding, split_stacks
from mmnnx.mpmd.run.runner import Executable
from mmnnx.mpmd.schedules import Schedule
from mmnnx.mpmd.schedules import names as schedule_names
from mmnnx.mpmd.step_io import StepInput, StepOutput
from mmnnx.mpmd.trace import trace_state
from mmnnx.mpmd.trace.callbacks import CallbackFailures
from mmnnx.mpmd.trace.mesh_context import no_ambient_mesh
from mmnnx.mpmd.trace.trace_state import Trace
from mmnnx.mpmd.trace.trace_step import TracedStep, trace_step
from mmnnx.sharding import Task

__all__ = ["PACK_RESIDUAL_BYTES", "PACK_WEIGHT_BYTES", "Plan"]


@dataclasses.dataclass(frozen=True)
class PlanningOptions:
    """How to plan a step (``mm.jit``'s options), checked; the packing bounds as bytes."""

    residual_bytes: int = 0  # the largest residual packed (mm.jit(pack_residuals=...))
    weight_bytes: int = 0  # the largest block weight packed (mm.jit(pack_weights=...))
    recompute_residuals: bool = True  # backwards recompute cheap residuals
    schedule: str | Schedule | None = None  # replaces each mm.microbatch's schedule
    share_cores: bool = True  # edge stages cut around a middle stage's program
    gather_weights: str | None = None  # the axis stages' weights are gathered over once a step

    def __post_init__(self) -> None:
        object.__setattr__(self, "residual_bytes", residual_bound(self.residual_bytes))
        object.__setattr__(self, "weight_bytes", weight_bound(self.weight_bytes))
        for name in ("recompute_residuals", "share_cores"):
            if not isinstance(got := getattr(self, name), bool):
                raise TypeError(f"mm.jit: {name} must be True or False, got {got!r}")
        if isinstance(self.schedule, str) and self.schedule not in schedule_names():
            raise ValueError(
                f"mm.jit: unknown schedule {self.schedule!r}; valid schedules are "
                f"{', '.join(schedule_names())} (or a Schedule object)"
            )
        if not isinstance(self.gather_weights, str | None):
            raise TypeError(
                f"mm.jit: gather_weights {self.gather_weights!r} is not a mesh axis name or None"
            )
        if not isinstance(self.schedule, str | Schedule | None):
            raise TypeError(f"mm.jit: schedule {self.schedule!r} is not a name or a Schedule")


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A step traced, planned and ready to run: what each call of it needs."""

    executable: Executable  # runs this process's plan (compiled on first use)
    tree: Any  # the pytree structure of the step's own return value (its first result)
    expansion: Expansion | None  # stacked layers: their chunks, joined again
    plan_for: Callable[[int], Plan]  # the plan of another process
    callback_failures: CallbackFailures  # what the step's host callbacks raised
    donated: bool  # some input is donated (a failed step keeps the others)

    @property
    def num_outputs(self) -> int:
        """How many leaves the step's own return value has (they come first in its results)."""
        return self.tree.num_leaves


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """A step traced for one kind of call: what :func:`build_step` plans, under any options."""

    step: TracedStep  # the graph, the annotations' record, the results' shapes
    outputs: Sequence[StepOutput]  # one record per result leaf
    callback_failures: CallbackFailures  # what the step's host callbacks raise, when run
    name: str  # the step's name in errors


def trace(
    pure: Callable,
    inputs: Sequence[StepInput],
    outputs_of: Callable[[Any], Sequence[StepOutput]],
    *,
    name_as: Callable,
    located: Callable[[BaseException], BaseException] = lambda e: e,
) -> TracedCall:
    """Traces ``pure(*leaves)`` (JAX's errors name it ``name_as``; a ``TypeError``/``ValueError``
    becomes ``located(error)``) and describes its results with ``outputs_of(out_shape)``."""
    callback_failures = CallbackFailures()
    with no_ambient_mesh(), cyclic_gc_paused():
        step = trace_step(
            pure, inputs, name_as=name_as, callback_failures=callback_failures, located=located
        )
    name = getattr(name_as, "__name__", "the step")
    return TracedCall(
        step=step,
        outputs=outputs_of(step.out_shape),
        callback_failures=callback_failures,
        name=name,
    )


def build_step(
    traced: TracedCall,
    inputs: Sequence[StepInput],
    options: PlanningOptions,
    *,
    peers: Callable[[PlannedStep, Sequence[StepInput], str], Any] | None = None,
) -> BuiltStep:
    """Plans a traced step for this process and wraps the plan in an ``Executable``
    (``peers(planned, inputs, name)``: the other processes). Compiles nothing; ``traced`` is
    left as it was, so the same trace plans again under other options."""
    with no_ambient_mesh(), cyclic_gc_paused():
        planned = plan_step(
            traced.step.graph.copy(),
            traced.step.trace,
            inputs,
            traced.outputs,
            options,
            name=traced.name,
            process=jax.process_index(),
            num_processes=jax.process_count(),
        )
    remote = None if peers is None else peers(planned, inputs, traced.name)
    executable = Executable(planned.graph, planned.plan, peers=remote)
    return BuiltStep(
        executable=executable,
        tree=jax.tree.structure(traced.step.out_shape[0]),
        expansion=planned.expansion,
        plan_for=planned.plan_for,
        callback_failures=traced.callback_failures,
        donated=any(i.donated for i in inputs),
    )


def inside_step() -> bool:
    """Whether an ``mm.jit`` step (or ``mm.microbatch``'s own trace) is being traced now."""
    return trace_state.current_trace() is not None


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
    """Plans a traced step for ``process`` of ``num_processes``: one record per graph input and
    output, in order. Compiles nothing."""
    expansion = None
    if any(i.stack is not None for i in inputs):
        graph, expansion = split_stacks(graph, inputs, outputs)
        inputs = expansion.expand_inputs(inputs, _input_chunk)
        outputs = expansion.expand_outputs(outputs, _output_chunk)
    resolve_rng_counts(graph, {g: m.num_microbatches for g, m in trace.microbatches.items()})
    split_checkpoints(graph, inputs)
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
    if options.gather_weights is not None and num_processes > 1:
        raise MPMDError(
            f"mm.jit: gather_weights={options.gather_weights!r} runs in one process only; "
            "with several, leave it None (each program gathers the weights it reads)"
        )
    lowered, transfers = lower(
        graph, tasks, inputs, outputs, order, pipeline, options.gather_weights
    )
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
        graph=graph, plan=plan_for(process), lowered=lowered, expansion=expansion, plan_for=plan_for
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
