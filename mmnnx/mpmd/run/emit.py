"""The program emitter: a :class:`StepProgram`'s actions turned, once, into the flat list of typed
steps the runner interprets (:class:`Launch`, :class:`Move`, :class:`Put`, :class:`Cross`), each
holding what it needs resolved: its compiled program, the layouts it moves between.

The actions are walked in dispatch order: a fragment's input layouts are those of the values it
reads, so they are known by the time it is reached. Programs are submitted to the compiler as
they are met and compile side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.lower import compatible
from mmnnx.mpmd.lower.program import (
    AwaitLayout,
    Constant,
    ConstantOutput,
    PackWeights,
    PublishLayout,
    Recv,
    Release,
    Route,
    Run,
    Send,
    StepProgram,
    Zeros,
)
from mmnnx.mpmd.run.early_sends import send_early
from mmnnx.mpmd.run.peers import Peers
from mmnnx.mpmd.run.programs import Compiler
from mmnnx.mpmd.run.routes import RoutePlan
from mmnnx.mpmd.run.timing import Transfer
from mmnnx.sharding.arrays import placeholder, put


def _rank(task: Any) -> str:
    """The task whose devices run ``task``'s programs: itself, or a virtual stage's task."""
    return task.home.name


def stage_outputs(pipeline: Any) -> dict[int, tuple[str, int]]:
    """Value id -> ``(kind, stage)`` of the pipeline stage fragment that makes it (``{}`` for
    a step with no pipeline)."""
    if pipeline is None:
        return {}
    return {v: key for key, frag in pipeline.stages.items() for op in frag.ops for v in op.outs}


def _transfer(action: Recv | Route, made_by: dict[int, tuple[str, int]]) -> Transfer | None:
    """What ``action`` carries, when a pipeline stage made its value and it crosses ranks."""
    made = made_by.get(action.value)
    if made is None or action.source is None or _rank(action.source) == _rank(action.target):
        return None
    kind, stage = made
    return Transfer(
        task=action.target.name,
        rank=_rank(action.target),
        source=_rank(action.source),
        kind=kind,
        stage=stage,
        microbatch=action.microbatch or 0,
    )


# The steps the runner interprets; ``drop``: the slots released right after each.


@dataclasses.dataclass(slots=True)
class Launch:
    """Launches a compiled program on ``args``, writing its results into ``results``.
    ``labels``: the pipeline actions it runs (``(label, microbatch)`` each), on ``rank``."""

    program: Any
    args: tuple[int, ...]
    results: tuple[int, ...]
    labels: tuple
    rank: str
    drop: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class Move:
    """Moves the value in ``source`` into ``target``, laid out as ``sharding``: by ``mover``
    (decided at compile) where it is laid out as ``source_layout``. ``transfer``: what it carries,
    for timers."""

    source: int
    target: int
    sharding: Any
    mover: Callable[[Any], Any] | None
    source_layout: Any
    drop: tuple[int, ...] = ()
    transfer: Transfer | None = None


@dataclasses.dataclass(slots=True)
class Put:
    """Puts a step input (the same on every process) onto ``sharding``, a layout spanning
    processes: each process keeps its part."""

    source: int
    target: int
    sharding: Any
    drop: tuple[int, ...] = ()


@dataclasses.dataclass(slots=True)
class Cross:
    """This process's end of a move between processes (``route``), through the step's peers."""

    route: RoutePlan
    source: int
    target: int
    drop: tuple[int, ...] = ()
    transfer: Transfer | None = None  # what it carries, for timers (see Move)


Step = Launch | Move | Put | Cross


def _writes(step: Step) -> tuple[int, ...]:
    """The slots ``step`` writes."""
    return step.results if type(step) is Launch else (step.target,)


@dataclasses.dataclass
class Emitted:
    """A program's steps and what the runner sets up around them."""

    steps: list[Step]  # in dispatch order; a Launch's program still compiling (a Future)
    constants: list[tuple[int, Any]]  # (slot, array) written before the steps run
    outputs: list[tuple[int | None, Any]]  # per output: its slot, or (None, its value)
    rewrap: list[tuple[int, Any]]  # outputs presented on their task's layout
    num_slots: int  # the slots the steps read and write
    resolved: dict[tuple, Any]  # (value, source, target) -> the layout a transfer chose
    fragment_programs: list[Any]  # the lowered fragment programs (to count those loaded)


def emit(
    graph: Graph,
    program: StepProgram,
    compiler: Compiler,
    peers: Peers | None,
    mover: Callable[[Any, Any, int], Callable[[Any], Any] | None],
    pipeline: Any = None,
) -> Emitted:
    """The steps of ``program``, its programs submitted to ``compiler``; ``mover(source, target,
    value)`` decides how a value moves between two layouts; ``pipeline``'s stages' results crossing
    ranks are labelled for timers."""
    sharding_of = list(program.shardings)
    compiled_of: dict[tuple, Any] = {}
    constants: list[tuple[int, Any]] = []
    resolved: dict[tuple, Any] = {}
    fragment_programs: list[Any] = []  # lowered, to count those loaded
    steps: list[Step] = []
    made_by = stage_outputs(pipeline)
    actions = program.actions
    position = 0
    while position < len(actions):
        action = actions[position]
        position += 1
        if isinstance(action, Run):
            runs = [action]
            while runs[-1].fused:
                runs.append(actions[position])
                position += 1
            # A program per layout of its arguments: a value made by a fused pair may be
            # laid out otherwise than the same value made by its fragment alone.
            key = tuple(
                (
                    *run.variant,
                    run.donate,
                    run.packing.layout if run.packing else None,
                    tuple(sharding_of[s] for s in run.args),
                )
                for run in runs
            )
            if key not in compiled_of:
                lowered = compiler.lower_fragments(
                    runs, [[sharding_of[s] for s in run.args] for run in runs]
                )
                compiling = compiler.submit(lowered)
                fragment_programs.append(lowered)
                compiled_of[key] = (compiling, compiler.output_shardings(lowered, compiling))
            compiled, output_shardings = compiled_of[key]
            results = tuple(s for run in runs for s in run.results)
            for s, sharding in zip(results, output_shardings, strict=True):
                sharding_of[s] = sharding
            labels = tuple((run.label, run.microbatch) for run in runs)
            args = tuple(s for run in runs for s in run.args)
            steps.append(Launch(compiled, args, results, labels=labels, rank=_rank(action.task)))
        elif isinstance(action, Recv | Route):
            source_layout = sharding_of[action.from_slot]
            sharding = action.sharding
            if sharding is None and source_layout is not None:
                sharding = compatible(source_layout, action.target)
                resolved.setdefault((action.value, action.source, action.target), sharding)
            sharding_of[action.slot] = sharding
            if isinstance(action, Recv):
                move = mover(source_layout, sharding, action.value)
                steps.append(
                    Move(
                        source=action.from_slot,
                        target=action.slot,
                        sharding=sharding,
                        mover=move,
                        source_layout=source_layout,
                        transfer=_transfer(action, made_by),
                    )
                )
            elif action.source is None:
                steps.append(Put(source=action.from_slot, target=action.slot, sharding=sharding))
            else:
                shape, dtype = graph.shapes[action.value], graph.dtypes[action.value]
                route = RoutePlan.plan(shape, dtype, source_layout, sharding, program.process)
                steps.append(
                    Cross(
                        route=route,
                        source=action.from_slot,
                        target=action.slot,
                        transfer=_transfer(action, made_by),
                    )
                )
        elif isinstance(action, Zeros | PackWeights):
            members = action.members
            lowered = (
                compiler.lower_zeros(action)
                if isinstance(action, Zeros)
                else compiler.lower_packing(action, [sharding_of[m] for m in members])
            )
            submitted = compiler.submit(lowered)
            rank = _rank(action.task)
            steps.append(Launch(submitted, members, action.made, labels=(), rank=rank))
        elif isinstance(action, Constant):
            sharding_of[action.slot] = action.task.sharding()
            constants.append((action.slot, put(jnp.int32(action.value), action.task.sharding())))
        elif isinstance(action, PublishLayout):
            peers.publish_layout(action.slot, action.task, sharding_of[action.slot])
        elif isinstance(action, AwaitLayout):
            sharding_of[action.slot] = peers.layout(action.slot, action.task)
        elif isinstance(action, Release):
            if steps:  # dropped after the previous step
                steps[-1].drop = (*steps[-1].drop, *action.slots)
        elif not isinstance(action, Send):  # a Send is its Recv's transfer here
            raise TypeError(f"unknown action {action!r}")
    outputs = []
    rewrap = []
    for i, out in enumerate(program.outputs):
        if isinstance(out, ConstantOutput):
            value = out.value if out.home is None else put(out.value, out.home)
            outputs.append((None, value))
        elif out.here:
            outputs.append((out.slot, None))
            layout = sharding_of[out.slot]
            if (
                program.process is not None
                and out.task is not None
                and isinstance(layout, SingleDeviceSharding)
            ):  # presented on its task, as other processes' placeholders of it are
                rewrap.append((i, out.task.sharding()))
        else:
            shape, dtype = graph.shapes[out.value], graph.dtypes[out.value]
            outputs.append((None, placeholder(shape, dtype, sharding_of[out.slot])))
    if program.process is not None:
        steps = send_early(steps, Cross, _writes)
    return Emitted(
        steps=steps,
        constants=constants,
        outputs=outputs,
        rewrap=rewrap,
        num_slots=len(sharding_of),
        resolved=resolved,
        fragment_programs=fragment_programs,
    )
