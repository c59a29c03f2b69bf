"""User annotations that steer the engine: ``mm.task`` regions, logical sharding constraints and
scope resolvers; what they record while ``mm.jit`` traces lives in ``trace_state.py``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import REGION_PREFIX, Graph
from mmnnx.mpmd.primitives import constraint_p
from mmnnx.mpmd.trace.trace_state import Trace, current_trace, is_shapes_only
from mmnnx.sharding import Task

ScopeResolver = Callable[[str, bool], "Task | None"]
"""``resolver(scope, backward) -> Task | None``: the task of an op traced under name scope
``scope`` (``backward``: in a backward pass), or ``None`` to leave it to colouring."""


def task(fn: Callable, task: Task) -> Callable:
    """Forces the computation of ``fn`` (a function or a Module) onto ``task``.

    Inside ``mm.jit`` every op traced in ``fn`` (and its backward pass) runs on ``task``; state it
    reads must be placed there. Outside ``mm.jit`` it simply calls ``fn``.

    Example:
        >>> import jax.numpy as jnp
        >>> head = Task("head", mesh=None)
        >>> task(jnp.tanh, head)(jnp.zeros(2)).shape
        (2,)
    """
    if not isinstance(task, Task):
        raise TypeError(f"mm.task: {task!r} is not an mm.Task")
    if not callable(fn):
        raise TypeError(f"mm.task: {fn!r} is not callable")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        trace = current_trace()
        if trace is None:
            return fn(*args, **kwargs)
        if task.name is None or task.mesh is None:
            raise MPMDError(f"mm.task: task {task!r} needs a name and a mesh inside mm.jit")
        if trace.regions.setdefault(task.name, task) != task:
            raise MPMDError(f"mm.task: two different tasks are named {task.name!r}")
        with jax.named_scope(f"{REGION_PREFIX}{task.name}"):
            return fn(*args, **kwargs)

    return wrapped


def resolve_scopes(resolver: ScopeResolver) -> None:
    """Assigns ops of the step being traced to tasks by their name scope.

    Called while ``mm.jit`` traces a step. After tracing, every op outside an ``mm.task`` region is
    offered to ``resolver(scope, backward)``: ``scope`` its name scope (see
    :func:`scope_components`), ``backward`` whether it is in a backward pass. A returned task runs
    the op as if it were in an ``mm.task`` region; ``None`` leaves it to colouring
    (``multimesh_compat`` maps ``register_task`` patterns so).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from mmnnx.sharding import TaskMesh
        >>> head = Task("head", mesh=TaskMesh(devices=[1]))
        >>> def step(x):
        ...     resolve_scopes(lambda scope, backward: head if "head" in scope else None)
        ...     with jax.named_scope("head"):
        ...         return jnp.tanh(x)
        >>> from mmnnx.jit import jit
        >>> [d.id for d in jit(step)(jnp.zeros(2)).devices()]
        [1]
    """
    trace = current_trace()
    if trace is None:
        raise MPMDError("mm.mpmd.resolve_scopes is for code that runs while mm.jit traces a step")
    if not callable(resolver):
        raise TypeError(f"mm.mpmd.resolve_scopes: {resolver!r} is not callable")
    trace.resolvers.append(resolver)


def apply_resolvers(graph: Graph, trace: Trace) -> None:
    """Gives each op outside an ``mm.task`` region the task a resolver of ``trace`` returns for its
    scope; records those tasks as regions."""
    if not trace.resolvers:
        return
    for op in graph.ops:
        if op.region is not None:
            continue
        for resolver in trace.resolvers:
            task = resolver(op.scope, op.backward)
            if task is None:
                continue
            if not isinstance(task, Task) or task.name is None or task.mesh is None:
                raise MPMDError(
                    f"mm.mpmd.resolve_scopes: the resolver returned {task!r} for scope "
                    f"{op.scope!r}; it must return an mm.Task with a name and a mesh, or None"
                )
            if trace.regions.setdefault(task.name, task) != task:
                raise MPMDError(f"mm.task: two different tasks are named {task.name!r}")
            op.region = task.name
            break


def with_sharding_constraint(x: Any, spec: PartitionSpec | Sequence[str | None]) -> Any:
    """Constrains the sharding of ``x``; inside a task, logical names use the task's rules.

    Inside ``mm.jit`` each entry of ``spec`` is a logical name (translated by the ``logical_axes``
    of the task running the op) or a device axis of that task's mesh, also inside a scan, cond,
    while loop or checkpoint; an input constrained before anything else uses it is sent to its
    task with that sharding. Outside ``mm.jit`` it is ``jax.lax.with_sharding_constraint``, except
    while ``mm.tabulate`` computes shapes, where it returns ``x``.

    Example:
        >>> import jax.numpy as jnp
        >>> with_sharding_constraint(jnp.ones(4), PartitionSpec()).shape  # doctest: +SKIP
        (4,)
    """
    if current_trace() is None:
        if is_shapes_only():
            return x
        return jax.lax.with_sharding_constraint(x, spec)
    names = tuple(spec)
    return jax.tree.map(lambda leaf: constraint_p.bind(leaf, names=names), x)
