"""A step (a pure function of its flat input leaves) traced to the engine's graph, under the mesh it
needs: an abstract mesh of its tasks' axes, or their shared mesh shape for explicit axes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.step_io import StepInput
from mmnnx.mpmd.trace import annotations, trace_state
from mmnnx.mpmd.trace.callbacks import CallbackFailures
from mmnnx.mpmd.trace.constraints import abstract_mesh_of, needs_a_mesh
from mmnnx.mpmd.trace.mesh_context import explicit_tracing, needs_explicit_axes, typed_aval
from mmnnx.mpmd.trace.trace_state import Trace
from mmnnx.mpmd.trace.tracing import trace

# Python numbers a step takes and returns as arrays
PYTHON_SCALARS = (bool, int, float, complex)


@dataclasses.dataclass(frozen=True)
class TracedStep:
    """A traced step: its graph, what its annotations recorded, its results' shapes."""

    graph: Graph
    trace: Trace
    out_shape: Any


def trace_step(
    pure: Callable,
    inputs: Sequence[StepInput],
    *,
    name_as: Callable,
    callback_failures: CallbackFailures | None = None,
    located: Callable[[BaseException], BaseException] = lambda e: e,
) -> TracedStep:
    """Traces ``pure(*leaves)``, one leaf per record of ``inputs``; JAX's errors name it as
    ``name_as``, and a ``TypeError`` or ``ValueError`` it raises becomes ``located(error)``."""
    names = [i.name for i in inputs]

    def traced(avals: Sequence[Any], context: Any = None) -> TracedStep:
        with trace_state.tracing() as recorded, context or contextlib.nullcontext():
            graph, out_shape = trace(
                pure, avals, name_as=name_as, arg_names=names, callback_failures=callback_failures
            )
        return TracedStep(graph=graph, trace=recorded, out_shape=out_shape)

    avals = [jax.ShapeDtypeStruct(i.shape, i.dtype, weak_type=i.weak_type) for i in inputs]
    try:
        step = traced(avals)
    except Exception as e:
        if needs_a_mesh(e):  # a bare PartitionSpec constraint: traced on the tasks' axes
            meshes = [i.task.jax_mesh for i in inputs if i.task is not None]
            meshes += [i.sharding.mesh for i in inputs if isinstance(i.sharding, NamedSharding)]
            step = traced(avals, jax.sharding.use_abstract_mesh(abstract_mesh_of(meshes)))
        elif needs_explicit_axes(e):
            mesh, avals = _typed_inputs(inputs, getattr(name_as, "__name__", "the step"), e)
            step = traced(avals, explicit_tracing(mesh))
        elif not isinstance(e, TypeError | ValueError) or (error := located(e)) is e:
            raise
        else:
            raise error from e
    annotations.apply_resolvers(step.graph, step.trace)
    return step


def check_outputs(out: Any, step: str) -> None:
    """Raises if a step returned a leaf that is not an array (a string, an object)."""
    for path, leaf in jax.tree.flatten_with_path(out)[0]:
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, *PYTHON_SCALARS)):
            where = "output" + jax.tree_util.keystr(path)
            raise MPMDError(
                f"mm.jit: {step} returned a {type(leaf).__name__} at {where}; a step must "
                "return arrays or pytrees of arrays (Python numbers count as arrays). Return "
                "other values from a function that calls the step"
            )


def _typed_inputs(
    inputs: Sequence[StepInput], step: str, cause: BaseException
) -> tuple[Any, list[Any]]:
    """For a step written for explicit mesh axes: the mesh shape every task shares, and the inputs
    with their placement in their type; raises, naming the tasks, when there is none."""
    tasks = list(dict.fromkeys(i.task for i in inputs if i.task is not None))
    shapes = {(t.jax_mesh.axis_names, t.jax_mesh.axis_sizes): t for t in tasks}
    stacked = any(i.stack is not None for i in inputs)
    if stacked or len(shapes) != 1:
        why = (
            "stacked layers (a rule naming a list of tasks) are placed"
            if stacked
            else "its tasks' meshes differ: "
            + "; ".join(
                f"{t.name!r} {dict(zip(*shape, strict=True))}" for shape, t in shapes.items()
            )
        )
        raise MPMDError(
            f"mm.jit: {step} uses explicit mesh axes ({str(cause).splitlines()[0]}), which "
            "mm.jit gives meaning by tracing the step on the mesh shape all its tasks share; "
            f"but {why}. Give every task the same axis names and sizes, or use "
            "mm.with_sharding_constraint"
        ) from cause
    mesh = tasks[0].jax_mesh

    def spec_of(item: StepInput) -> PartitionSpec:
        if item.task is not None:
            return item.sharding.spec
        sharding = item.sharding  # a batch laid out on a mesh of this shape
        if isinstance(sharding, NamedSharding) and (
            sharding.mesh.axis_names,
            sharding.mesh.axis_sizes,
        ) == (mesh.axis_names, mesh.axis_sizes):
            return sharding.spec
        return PartitionSpec()

    return mesh, [typed_aval(i.shape, i.dtype, mesh, spec_of(i)) for i in inputs]
