"""``TaskStack``: a stacked Variable's leading (layer) axis split over several tasks in order.

Models written with ``nnx.vmap`` / ``nnx.scan`` keep their layers as one Variable per weight with
a leading layer axis. A placement rule that names a list of tasks, ``("blocks", [s0, s1, s2,
s3])``, gives each task a contiguous chunk of that axis: the Variable's array is one
``jax.Array`` over the tasks' devices together (a mesh with a leading ``mm_stack`` axis), and
``mm.jit`` runs each task's chunk of a scan over the layers on that task.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mmnnx._jax.arrays import array_from_shards, shards_by_device
from mmnnx.sharding.arrays import placeholder
from mmnnx.sharding.task import Task

STACK_AXIS = "mm_stack"
"""The device axis of a :class:`TaskStack`'s mesh that runs over its tasks."""


@dataclasses.dataclass(frozen=True)
class TaskStack:
    """Tasks sharing a stacked Variable's leading axis, task ``i`` holding chunk ``i`` of equal
    contiguous chunks; their meshes must be of one shape (one ``jax.Array`` holds the stack).

    Example:
        >>> from mmnnx.sharding.task_mesh import TaskMesh
        >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
        >>> stack = TaskStack((s0, s1))
        >>> stack.name, stack.chunks(4)
        ('s0+s1', [(0, 2), (2, 4)])
    """

    tasks: tuple[Task, ...]

    def __post_init__(self):
        tasks = tuple(self.tasks)
        object.__setattr__(self, "tasks", tasks)
        if not tasks or not all(isinstance(t, Task) for t in tasks):
            raise TypeError(f"a task stack needs a non-empty sequence of mm.Task, got {tasks!r}")
        names = [t.name for t in tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"a task stack names a task twice: {names}")
        holder: dict[Any, Task] = {}
        for t in tasks:
            for device in t.jax_mesh.devices.flat:
                other = holder.setdefault(device, t)
                if other is not t:
                    raise ValueError(
                        f"tasks {other.name!r} and {t.name!r} cannot share stacked Variables: "
                        f"both run on device {device.id} (one jax.Array holds the stack, one "
                        "chunk per device), as two virtual stages of one task do; give each "
                        "virtual stage its layers as a list of modules "
                        "(mm.stage_rules(..., virtual_stages=2)), or one chunk per task"
                    )
        first = tasks[0]
        for t in tasks[1:]:
            if t.axis_names != first.axis_names or t.jax_mesh.devices.shape != (
                first.jax_mesh.devices.shape
            ):
                raise ValueError(
                    f"tasks {first.name!r} and {t.name!r} cannot share stacked Variables: their "
                    f"meshes differ ({dict(first.jax_mesh.shape)} vs {dict(t.jax_mesh.shape)}); "
                    "a stack's tasks need meshes of one shape and axis names"
                )

    def __getstate__(self):  # the mesh is remade where the stack is unpickled
        return {k: v for k, v in self.__dict__.items() if k != "jax_mesh"}

    @property
    def name(self) -> str:
        return "+".join(t.name for t in self.tasks)

    def __repr__(self):
        return f"TaskStack({self.name!r})"

    @functools.cached_property
    def jax_mesh(self) -> Mesh:
        """The tasks' devices together, with a leading ``mm_stack`` axis over the tasks."""
        devices = np.stack([t.jax_mesh.devices for t in self.tasks])
        return Mesh(devices, (STACK_AXIS, *self.tasks[0].axis_names))

    def chunks(self, length: int, *, where: str | None = None) -> list[tuple[int, int]]:
        """The ``(start, stop)`` of each task's chunk of ``length``; ``ValueError`` unless the
        tasks divide it."""
        k = len(self.tasks)
        if length % k:
            raise ValueError(
                f"{where or 'a stacked Variable'}: its leading axis of {length} layers cannot be "
                f"split evenly over the {k} tasks {self.name!r} (one jax.Array holds the stack, "
                f"and its shards are equal); use a layer count divisible by {k}, or fewer tasks"
            )
        size = length // k
        return [(i * size, (i + 1) * size) for i in range(k)]

    def spec(self, chunk_spec: PartitionSpec) -> PartitionSpec:
        """The whole stack's spec for a chunk spec (whose leading entry is ``None``)."""
        return PartitionSpec(STACK_AXIS, *tuple(chunk_spec)[1:])

    def sharding(self, spec: PartitionSpec | None = None) -> NamedSharding:
        """The sharding of a whole stacked array whose chunks are laid out by ``spec``.

        Example:
            >>> from mmnnx.sharding.task_mesh import TaskMesh
            >>> ts = [Task(f"s{i}", mesh=TaskMesh(devices=[i])) for i in range(2)]
            >>> TaskStack(tuple(ts)).sharding().spec
            P('mm_stack',)
        """
        return NamedSharding(self.jax_mesh, self.spec(PartitionSpec() if spec is None else spec))

    def split(self, array: jax.Array, spec: PartitionSpec) -> list[jax.Array]:
        """Each task's chunk of a stacked ``array`` as an array on that task (no copy); a task
        on another process gets a placeholder of its chunk's shape."""
        shape = (array.shape[0] // len(self.tasks), *array.shape[1:])
        by_device = shards_by_device(array)
        chunks = []
        for task in self.tasks:
            sharding = task.sharding(spec)
            if all(d in by_device for d in task.jax_mesh.devices.flat):
                chunks.append(array_from_shards(shape, sharding, by_device))
            else:
                chunks.append(placeholder(shape, array.dtype, sharding))
        return chunks

    def join(self, chunks: Sequence[Any], spec: PartitionSpec) -> jax.Array:
        """The stacked array whose chunk ``i`` is ``chunks[i]`` (each laid out on task ``i`` by
        ``spec``; no copy)."""
        first = chunks[0]
        shape = (first.shape[0] * len(chunks), *first.shape[1:])
        by_device = {d: a for c in chunks for d, a in shards_by_device(c).items()}
        if not by_device:
            return placeholder(shape, first.dtype, self.sharding(spec))
        return array_from_shards(shape, self.sharding(spec), by_device)
