"""State on no task that a step left on a task, in a job of several processes: before its first
step each process holds its own copy (an optimizer's step count made outside ``mm.jit``); a step
hands the new value back on one task, and the next step must read it there, as that task's input
(:func:`homes_of` names the task)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from jax.sharding import NamedSharding

from mmnnx.sharding import Task


def homes_of(values: Sequence[Any], which: Iterable[int], tasks: Iterable[Task]) -> dict[int, Task]:
    """For each index ``i`` in ``which``: the task among ``tasks`` whose mesh ``values[i]`` is laid
    out on whole (a step's result handed back on its task, or a placeholder of it), the first in
    ``tasks``' order of those on that mesh (virtual stages share one: every process must name the
    same); a value on one device of its own process (its own copy) has none."""
    by_mesh: dict[Any, Task] = {}
    for task in tasks:
        by_mesh.setdefault(task.jax_mesh, task)
    shardings = {i: getattr(values[i], "sharding", None) for i in which}
    return {
        i: by_mesh[s.mesh]
        for i, s in shardings.items()
        if isinstance(s, NamedSharding) and s.is_fully_replicated and s.mesh in by_mesh
    }
