"""The multimesh.jax API on stock JAX, run by mmnnx's engine.

Code written for multimesh.jax runs with its import changed to ``multimesh_compat.jax`` (or
unchanged after :func:`multimesh_compat.install_alias`). ``MultiMesh``, ``Task`` and
``TaskMesh`` are mmnnx's classes (``MultiMesh`` with ``register_task`` added); the programs that
``parallelize``, ``mjit`` and ``multimesh_compat.jax.flax.parallelize_step`` build run through
``mm.jit``. See docs/multimesh_compat.md for what is the same and what differs.

Example:
    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from multimesh_compat.jax import TaskMesh, parallelize, task, with_sharding_constraint
    >>> layer = task(lambda p, x: x @ p, mesh=TaskMesh(devices=range(4)),
    ...              logical_axes=[("batch", "x")])
    >>> def model(p, x):
    ...     return layer(p, with_sharding_constraint(x, P("batch", None)))
    >>> f, init, batch = parallelize(model, lambda: jnp.eye(4), lambda: jnp.ones((8, 4)))
    >>> sorted(d.id for d in batch().devices())
    [0, 1, 2, 3]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

import mmnnx as mm
from multimesh_compat._init import init
from multimesh_compat.jax import _tasks
from multimesh_compat.jax._context import (
    autoshard,
    context,
    enable_fast_path,
    enable_recomputation,
    enable_task_fusion,
    flag,
    ignore_transforms,
    only_fuse_loop_tasks,
)
from multimesh_compat.jax._engine import (
    ShardedFunction,
    mjit,
    parallelize,
    run_in_task,
    with_sharding_constraint,
)
from multimesh_compat.jax._microbatch import SCHEDULES, microbatch
from multimesh_compat.jax._tasks import MultiMesh

Task = _tasks.Task
TaskMesh = mm.TaskMesh

__version__ = "0.1.0+mmnnx"

__all__ = [
    "SCHEDULES",
    "MultiMesh",
    "ShardedFunction",
    "Task",
    "TaskMesh",
    "autoshard",
    "clear_tasks",
    "context",
    "custom_partitioning",
    "enable_fast_path",
    "enable_recomputation",
    "enable_task_fusion",
    "flag",
    "ignore_transforms",
    "init",
    "microbatch",
    "mjit",
    "only_fuse_loop_tasks",
    "parallelize",
    "register_task",
    "shard_map",
    "slice_global_mesh",
    "task",
    "with_sharding_constraint",
]


def task(
    fun: Callable,
    name: str | None = None,
    *,
    task: mm.Task | None = None,
    mesh: Any = None,
    devices: Any = None,
    device_axes: Sequence[str] | None = None,
    logical_axes: Sequence[tuple[str, Any]] | None = None,
    **task_fields: Any,
) -> Callable:
    """Runs ``fun`` (forward and backward) as a task on a submesh.

    Gen-B: pass ``task=Task(...)``, or ``Task`` fields as keywords (``mesh=TaskMesh(...)``,
    ``logical_axes=...``, ``extra_axes=...``). With no mesh the task spans all devices on one
    axis ``"x"``. Gen-A: ``mesh=`` a ``jax.sharding.Mesh``, or ``devices=`` (a device array
    gives the mesh shape, a list a 1-D mesh) with ``device_axes=`` names; without
    ``device_axes`` the task's constraints replicate. ``logical_axes`` are priority-ordered
    ``(logical, device_axis)`` pairs and default to the identity over the device axes.

    The task's name defaults to ``fun.__name__``; two different tasks with one name (the same
    function on two submeshes) are told apart. Outside this layer's programs the wrapped
    function simply calls ``fun``; under ``ignore_transforms()`` ``fun`` itself is returned.

    Example:
        >>> import jax.numpy as jnp
        >>> stage = task(jnp.tanh, mesh=TaskMesh(devices=range(4)), logical_axes=[("batch", "x")])
        >>> stage(jnp.zeros(3)).tolist()  # outside mjit/parallelize it just calls the function
        [0.0, 0.0, 0.0]
    """
    if _context_ignored():
        return fun
    default_name = name or getattr(fun, "__name__", "task")
    gen_a = devices is not None or device_axes is not None or isinstance(mesh, Mesh)
    if gen_a:
        if task is not None or task_fields:
            raise ValueError(f"task {default_name}: Gen-A arguments cannot be mixed with Task")
        args = _tasks.GenAArgs(
            default_name,
            mesh,
            devices,
            tuple(device_axes) if device_axes is not None else None,
            logical_axes,
        )
        args.check()
        resolve = args.resolve
    else:
        if task is None:
            fields = dict(task_fields)
            if mesh is not None:
                fields["mesh"] = mesh
            if logical_axes is not None:
                fields["logical_axes"] = logical_axes
            task = Task(name, **fields)
        elif mesh is not None or logical_axes is not None or task_fields:
            raise ValueError(f"task {default_name}: give either task= or Task fields, not both")
        spec = task
        resolve = lambda: _tasks.resolve_gen_b(spec, default_name)
    return run_in_task(resolve, fun)


def _context_ignored() -> bool:
    from multimesh_compat.jax._context import transforms_ignored

    return transforms_ignored()


def register_task(
    matcher: str,
    *,
    callback: Callable | None = None,
    task: mm.Task | None = None,
    **gen_a: Any,
) -> None:
    """Runs every op whose name scope matches ``matcher`` on a task.

    ``matcher`` (a name or regex, fully matched) is tried against each component of an op's
    name scope: Linen module names such as ``layer_0`` and ``jax.named_scope`` names; the
    innermost matching component wins. Gen-B: a fixed ``task`` (with a ``mesh`` or a
    ``mesh_slice`` of the entered ``MultiMesh``) or ``callback(name, backprop) -> Task``, where
    ``backprop`` is True for ops of the backward pass. Gen-A keywords (``name``, ``mesh``,
    ``dims``, ``devices``, ``device_axes``, ``logical_axes``, and a callback returning devices or
    ``((start, stop), name)``) are accepted too. Registrations go to the innermost entered
    ``MultiMesh``, else to the default context; :func:`clear_tasks` drops them.

    Example:
        >>> register_task("layer_1", task=Task(mesh=TaskMesh(devices=range(4, 8))))
        >>> clear_tasks()
    """
    _tasks.innermost_context().register_task(matcher, callback=callback, task=task, **gen_a)


def clear_tasks() -> None:
    """Drops the registrations of the default context and of the entered ``MultiMesh``.

    Example:
        >>> clear_tasks()
    """
    for c in _tasks.active_contexts():
        c.clear()


def slice_global_mesh(**mesh_slice: int) -> TaskMesh:
    """The entered ``MultiMesh`` sliced at ``mesh_slice``, as a ``TaskMesh`` whose sliced axes
    keep size 1.

    Example:
        >>> with MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x")):
        ...     slice_global_mesh(stage=1).devices.tolist()
        [[4, 5, 6, 7]]
    """
    mesh = _tasks.slice_global_mesh(mesh_slice, "slice_global_mesh")
    ids = _tasks._mesh_indices(mesh)
    return TaskMesh(devices=ids, axis_sizes=tuple(mesh.axis_sizes), axis_names=mesh.axis_names)


def shard_map(f: Callable, *args: Any, mesh: Mesh | None = None, **kwargs: Any) -> Callable:
    """``jax.shard_map`` whose mesh becomes the mesh of the task it runs in.

    Inside a task (explicit, or a registered scope while this layer traces) the task's
    submesh replaces ``mesh``; elsewhere ``mesh`` (default: the ambient mesh) is used.

    Example:
        >>> import jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> m = Mesh(jax.devices()[:2], ("x",))
        >>> shard_map(lambda x: 2 * x, mesh=m, in_specs=P("x"), out_specs=P("x"))(
        ...     jnp.arange(4.0)).tolist()
        [0.0, 2.0, 4.0, 6.0]
    """

    def call(*call_args, **call_kwargs):
        use = mesh
        current = _tasks.CURRENT_TASK.get()
        if current is not None:
            use = current.engine_task().jax_mesh
        elif use is None and mm.current_multimesh() is not None:
            use = mm.current_multimesh().mesh
        fn = (
            jax.shard_map(f, *args, mesh=use, **kwargs)
            if use is not None
            else jax.shard_map(f, *args, **kwargs)
        )
        return fn(*call_args, **call_kwargs)

    return call


def _scope_placement() -> _tasks.Placement | None:
    """The task of the code being traced: an explicit task, else the innermost registered
    name scope that matches the current name stack."""
    current = _tasks.CURRENT_TASK.get()
    if current is not None:
        return current
    from jax.extend import source_info_util

    from multimesh_compat.jax._engine import Matcher, registered

    scope = str(source_info_util.current_name_stack())
    return Matcher(registered())(scope, mm.mpmd.is_backward_scope(scope))


class custom_partitioning:  # noqa: N801 - multimesh's name
    """``jax.experimental.custom_partitioning`` run on the mesh of the task it is called in.

    The ambient mesh must be an entered ``MultiMesh``; the call traces with the submesh of the
    current task (an explicit task, or the innermost matching registered scope, as
    ``MultiMesh.slice(...)``) as JAX's mesh, or with the whole global mesh outside any task.
    ``def_partition`` is JAX's.

    Example:
        >>> import jax.numpy as jnp
        >>> double = custom_partitioning(lambda x: 2 * x)
        >>> try:
        ...     double(jnp.ones(2))
        ... except Exception as e:
        ...     print(e)
        The global mesh context should a MultiMesh
    """

    def __init__(self, *args: Any, **kwargs: Any):
        from jax.experimental.custom_partitioning import custom_partitioning as _jax_cp

        self.partitioner = _jax_cp(*args, **kwargs)

    def def_partition(self, *args: Any, **kwargs: Any) -> Any:
        return self.partitioner.def_partition(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        multi = mm.current_multimesh()
        if not isinstance(multi, mm.MultiMesh):
            raise Exception("The global mesh context should a MultiMesh")
        placement = _scope_placement()
        mesh = placement.engine_task().jax_mesh if placement is not None else multi.mesh
        with warnings.catch_warnings():
            # JAX's custom_partitioning reads the legacy ``with mesh:`` context, not set_mesh's
            warnings.filterwarnings("ignore", "`with mesh:`", DeprecationWarning)
            mesh.__enter__()
        try:
            return self.partitioner(*args, **kwargs)
        finally:
            mesh.__exit__(None, None, None)
