"""Measuring the :class:`~mmnnx.mpmd.schedules.Link` between two tasks of this process: the
time the runner's own copy takes to move a value laid out on one task onto the other."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mmnnx._jax.arrays import copier
from mmnnx.mpmd.schedules.links import Link
from mmnnx.sharding import Task

SIZES = (4 << 10, 4 << 20)
"""The value sizes (bytes) a link is measured at: a small one for the latency, a large one for
the bandwidth."""


def measure_link(
    source: Task, target: Task, *, sizes: Sequence[int] = SIZES, repeats: int = 7
) -> Link:
    """The latency and bandwidth of moving a replicated float32 value from ``source``'s devices
    to ``target``'s, as the runner moves one (median of ``repeats`` copies per size, each
    waited for).

    Example:
        >>> import mmnnx as mm
        >>> a, b = (mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2))
        >>> link = measure_link(a, b)
        >>> link.latency >= 0 and link.bandwidth > 0
        True

    Raises:
        ValueError: a task's devices are not all in this process, or the two tasks share none
            of the sizes' layouts (nothing to measure).
    """
    for task in (source, target):
        if not all(d.process_index == jax.process_index() for d in task.jax_mesh.devices.flat):
            raise ValueError(
                f"measure_link: task {task.name!r} has devices in another process; a link "
                "across processes is measured from both sides (mm.distributed)"
            )
    src, dst = source.sharding(PartitionSpec()), target.sharding(PartitionSpec())
    seconds = []
    for nbytes in sizes:
        shape = (max(nbytes // 4, 1),)
        move = copier(src, dst, 1, np.float32) or (lambda x: jax.device_put(x, dst))
        value = jax.device_put(jnp.zeros(shape, jnp.float32), src)
        jax.block_until_ready(move(value))  # the first copy sets up the route
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(move(value))
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return Link.fit([4 * max(n // 4, 1) for n in sizes], seconds)
