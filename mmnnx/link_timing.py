"""Measuring what a step's transfers and launches cost, for the simulator, ``tune`` and the
partition planner: the :class:`~mmnnx.mpmd.schedules.Link` between two tasks (in one process,
the time the runner's own copy takes; across processes, a round trip through the runner's
cross-process route), the bytes each stage boundary of a step moves (:func:`boundary_bytes`),
both together for a step (:func:`measure_transfers`), and the host's time per launched
program (:func:`measure_launch_cost`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from mmnnx._jax.arrays import copier
from mmnnx.distributed.gather import gather
from mmnnx.distributed.transport import transport
from mmnnx.errors import MPMDError
from mmnnx.mpmd.lower.localize import processes_of
from mmnnx.mpmd.lower.program import PackWeights, Run, Zeros
from mmnnx.mpmd.run.emit import stage_outputs
from mmnnx.mpmd.run.routes import RoutePlan
from mmnnx.mpmd.schedules import Schedule, transfer_costs
from mmnnx.mpmd.schedules.links import Link, _reader_stage
from mmnnx.sharding import Task
from mmnnx.sharding.arrays import put

SIZES = (4 << 10, 4 << 20)
"""The value sizes (bytes) a link is measured at: a small one for the latency, a large one for
the bandwidth."""


def measure_link(
    source: Task,
    target: Task,
    *,
    sizes: Sequence[int] = SIZES,
    repeats: int = 7,
    spec: PartitionSpec | None = None,
) -> Link:
    """The latency and bandwidth of moving a float32 value from ``source``'s devices to
    ``target``'s, as the runner moves one (median of ``repeats`` copies per size, each waited
    for). ``spec``: how the value (a vector) is laid out on both tasks: replicated by default
    (``None``), each target device receiving all of it; ``PartitionSpec("data")``, say,
    splits it over the tasks' ``data`` axis, as a batch-sharded activation is, each device
    moving its slice.

    In one process: the runner's own copy between the two tasks' devices. With several
    processes it is a collective, which every process calls (in the same order as its other
    collectives and steps), and all get the same link: two tasks of one process are measured
    there; across processes, the first process of ``source`` times a round trip (``source``
    to ``target`` and back) through the runner's cross-process route (the transfer server),
    and a one-way transfer is taken as half of it.

    Example:
        >>> import mmnnx as mm
        >>> a, b = (mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2))
        >>> link = measure_link(a, b)
        >>> link.latency >= 0 and link.bandwidth > 0
        True

    Raises:
        ValueError: ``sizes`` has fewer than two distinct sizes, or ``repeats`` < 1.
    """
    if len(set(sizes)) < 2 or not all(isinstance(n, int) and n > 0 for n in sizes):
        raise ValueError(
            f"measure_link: sizes must be two or more distinct byte counts, got {sizes}"
        )
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"measure_link: repeats must be an int >= 1, got {repeats!r}")
    spec = PartitionSpec() if spec is None else spec
    layouts = (source.sharding(spec), target.sharding(spec))
    if jax.process_count() == 1:
        return _measure_here(*layouts, sizes, repeats)
    me = jax.process_index()
    involved = processes_of(source) | processes_of(target)
    link = None
    if involved == {me}:
        link = _measure_here(*layouts, sizes, repeats)
    elif me in involved:
        link = _measure_across(*layouts, sizes, repeats)
    what = f"measure_link({source.name!r}, {target.name!r})"
    found = [x for x in gather(link and [link.latency, link.bandwidth], what=what) if x]
    return Link(*found[0])


def _vector(nbytes: int, *layouts: Any) -> tuple[int]:
    """The shape of a float32 vector of about ``nbytes`` each of ``layouts`` splits evenly."""
    whole = 1 << 20
    parts = math.lcm(*(whole // layout.shard_shape((whole,))[0] for layout in layouts))
    return (max(nbytes // 4 // parts, 1) * parts,)


def _fit(shapes: Sequence[tuple[int]], seconds: Sequence[float]) -> Link:
    return Link.fit([4 * shape[0] for shape in shapes], seconds)


def _measure_here(src: Any, dst: Any, sizes: Sequence[int], repeats: int) -> Link:
    """The runner's copy from layout ``src`` to ``dst`` (devices of this process), timed."""
    seconds, shapes = [], [_vector(nbytes, src, dst) for nbytes in sizes]
    for shape in shapes:
        move = copier(src, dst, 1, np.float32) or (lambda x: jax.device_put(x, dst))
        value = jax.device_put(jnp.zeros(shape, jnp.float32), src)
        seconds.append(_median_seconds(repeats, move, value))
    return _fit(shapes, seconds)


def _median_seconds(repeats: int, once: Callable[..., Any], *args: Any) -> float:
    """The median time of ``repeats`` calls of ``once(*args)``, each waited for, after one more
    (which sets up the route or connects the processes)."""
    jax.block_until_ready(once(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(once(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure_across(src: Any, dst: Any, sizes: Sequence[int], repeats: int) -> Link | None:
    """Half a round trip from ``src`` to ``dst`` and back, timed by ``src``'s first process."""
    me = jax.process_index()
    seconds, shapes = [], [_vector(nbytes, src, dst) for nbytes in sizes]
    for shape in shapes:
        there = RoutePlan.plan(shape, np.float32, src, dst, me)
        back = RoutePlan.plan(shape, np.float32, dst, src, me)
        value = put(np.zeros(shape, np.float32), src) if there.sends else None
        seconds.append(_median_seconds(repeats, _round_trip, there, back, value) / 2)
    timer = min(d.process_index for d in src.device_set)
    return _fit(shapes, seconds) if me == timer else None


def _round_trip(there: RoutePlan, back: RoutePlan, value: jax.Array | None) -> Any:
    """``value`` sent along ``there`` (waited for) and back along ``back``: what returned here."""
    arrived = jax.block_until_ready(there(value, transport()))
    return back(arrived, transport())


def boundary_bytes(plan: Any) -> dict[tuple[str, int], int]:
    """The bytes each action of a pipelined step's plan (``step.plan(...)``) sends to the stage
    that reads it on another task's devices, per microbatch: ``("F", s)`` stage ``s``'s
    activations to stage ``s + 1``, ``("B", s)`` or ``("I", s)`` its input gradient to stage
    ``s - 1``, as :func:`~mmnnx.mpmd.schedules.transfer_costs` takes them. Read off the plan's
    transfers (each value moved between tasks) and the stage fragment that makes each value;
    boundaries within one task's devices move nothing and are left out.

    Example::

        boundary_bytes(step.plan(model, x))  # {("F", 0): 4194304, ("B", 1): 4194304}

    Raises:
        MPMDError: the plan has no pipeline.
    """
    pipeline = plan.pipeline
    if pipeline is None:
        raise MPMDError("boundary_bytes: the step has no pipelined mm.microbatch")
    made_by = stage_outputs(pipeline)
    homes = [t.home.name for t in pipeline.stage_tasks]
    out: dict[tuple[str, int], int] = {}
    for transfer in plan.transfers:
        made = made_by.get(transfer.value)
        if made is None or transfer.source is None:
            continue
        kind, stage = made
        reader = _reader_stage(kind, stage)
        if reader is None or not 0 <= reader < len(homes):
            continue
        if homes[stage] != homes[reader] and transfer.target.home.name == homes[reader]:
            out[made] = out.get(made, 0) + transfer.nbytes
    return out


@dataclasses.dataclass(frozen=True)
class StepTransfers:
    """What a pipelined step's stage boundaries cost, measured by :func:`measure_transfers`.

    ``links[(a, b)]``: the link from task ``a``'s devices to task ``b``'s (tasks whose devices
    run the stages: a virtual stage's own task). ``nbytes``: :func:`boundary_bytes` at
    ``num_microbatches``. ``stage_homes[s]``: the task whose devices run stage ``s``.
    ``processes[task]``: the process whose host launches that task's programs (the first of
    its devices' processes).

    Example::

        transfers = mm.schedules.measure_transfers(step, model, x)
        schedule = step.plan(model, x).pipeline.schedule
        mm.schedules.simulate(schedule, action_costs=costs,
                              transfer_costs=transfers.transfer_costs(schedule),
                              processes=transfers.processes_of(schedule))
    """

    links: dict[tuple[str, str], Link]
    nbytes: dict[tuple[str, int], int]
    stage_homes: tuple[str, ...]
    processes: dict[str, int]
    num_microbatches: int

    def transfer_costs(self, schedule: Schedule) -> dict[tuple[str, int], float]:
        """The seconds each action of ``schedule`` (over the same stages, on the same tasks)
        takes to reach its reader, as ``simulate``'s ``transfer_costs``: the bytes per
        microbatch scaled by ``num_microbatches / schedule.num_microbatches`` (a microbatch of
        another size), an input gradient's alike whether a ``B`` or an ``I`` makes it."""
        rank_home = self._rank_homes(schedule)
        scale = self.num_microbatches / schedule.num_microbatches
        nbytes: dict[tuple[str, int], float] = {}
        for (kind, stage), size in self.nbytes.items():
            for k in ("B", "I") if kind in "BI" else (kind,):
                nbytes[(k, stage)] = size * scale
        links = {
            (a, b): self.links[(rank_home[a], rank_home[b])]
            for a in rank_home
            for b in rank_home
            if (rank_home[a], rank_home[b]) in self.links
        }
        present = {(a.kind, a.stage) for row in schedule.actions for a in row}
        return transfer_costs(
            schedule, links, {key: n for key, n in nbytes.items() if key in present}
        )

    def processes_of(self, schedule: Schedule) -> tuple[int, ...]:
        """The process launching each rank of ``schedule``'s programs, as ``simulate``'s
        ``processes``."""
        rank_home = self._rank_homes(schedule)
        return tuple(self.processes[rank_home[r]] for r in range(schedule.num_ranks))

    def simulate_options(self, schedule: Schedule, launch_cost: float = 0.0) -> dict[str, Any]:
        """``simulate``'s ``transfer_costs``, ``processes`` and ``launch_cost`` (given, e.g.
        :func:`measure_launch_cost`'s) for ``schedule``.

        Example::

            mm.schedules.simulate(schedule, action_costs=costs,
                                  **transfers.simulate_options(schedule, launch_cost))
        """
        return {
            "transfer_costs": self.transfer_costs(schedule),
            "processes": self.processes_of(schedule),
            "launch_cost": launch_cost,
        }

    def _rank_homes(self, schedule: Schedule) -> dict[int, str]:
        if schedule.num_stages != len(self.stage_homes):
            raise ValueError(
                f"StepTransfers: schedule {schedule.name!r} has {schedule.num_stages} stages, "
                f"the step measured {len(self.stage_homes)}"
            )
        return {r: self.stage_homes[s] for s, r in enumerate(schedule.stage_to_rank)}


def measure_transfers(
    step: Any, *args: Any, sizes: Sequence[int] = SIZES, repeats: int = 7, **kwargs: Any
) -> StepTransfers:
    """Measures the links between the tasks of a pipelined ``step`` (an ``mm.jit`` step or
    ``mm.cached_partial``) that its stage boundaries cross, each way a boundary is crossed
    (:func:`measure_link`), and reads off its plan for ``step(*args, **kwargs)`` the bytes
    each boundary moves (:func:`boundary_bytes`); the step is planned, not run. With several
    processes every process calls it and gets the same result.

    Example::

        transfers = mm.schedules.measure_transfers(step, model, x)
        transfers.transfer_costs(step.plan(model, x).pipeline.schedule)  # {("F", 0): 0.0021, ...}

    Raises:
        MPMDError: the step has no pipelined ``mm.microbatch``.
    """
    plan = step.plan(*args, **kwargs)
    nbytes = boundary_bytes(plan)
    tasks = [t.home for t in plan.pipeline.stage_tasks]
    pairs: dict[tuple[str, str], tuple[Task, Task]] = {}
    for kind, stage in nbytes:
        a, b = tasks[stage], tasks[_reader_stage(kind, stage)]
        pairs[(a.name, b.name)] = (a, b)
    links = {
        names: measure_link(a, b, sizes=sizes, repeats=repeats)
        for names, (a, b) in sorted(pairs.items())
    }
    return StepTransfers(
        links=links,
        nbytes=nbytes,
        stage_homes=tuple(t.name for t in tasks),
        processes={t.name: min(processes_of(t)) for t in tasks},
        num_microbatches=plan.pipeline.num_microbatches,
    )


def _launches(program: Any) -> int:
    """How many programs this process's share of a step launches (a fused pair: one)."""
    runs = [a for a in program.actions if isinstance(a, Run)]
    others = sum(isinstance(a, Zeros | PackWeights) for a in program.actions)
    return len(runs) - sum(run.fused for run in runs) + others


def measure_launch_cost(step: Any, *args: Any, calls: int = 3, **kwargs: Any) -> float:
    """The host's CPU time per program launched by ``step(*args, **kwargs)`` (an ``mm.jit``
    step or ``mm.cached_partial``), as ``simulate``'s ``launch_cost``: the median over
    ``calls`` calls (after one more that compiles) of the calling thread's CPU time per call
    (``time.thread_time``: what it spends dispatching, moving and bookkeeping, not the time it
    waits for a value from another process), divided by the programs this process launches
    in it. It runs the step, updating its arguments as a call does.

    Example::

        mm.schedules.measure_launch_cost(step, model, x)  # e.g. 0.0002 (seconds)
    """
    if not (isinstance(calls, int) and calls >= 1):
        raise ValueError(f"measure_launch_cost: calls must be an int >= 1, got {calls!r}")
    launches = _launches(step.plan(*args, **kwargs).program)
    if not launches:
        raise MPMDError("measure_launch_cost: the step launches no program in this process")
    _addressable(step(*args, **kwargs))
    spent = []
    for _ in range(calls):
        start = time.thread_time()
        out = step(*args, **kwargs)
        spent.append(time.thread_time() - start)
        _addressable(out)
    return statistics.median(spent) / launches


def _addressable(out: Any) -> None:
    """Waits for the parts of ``out`` this process holds."""
    jax.block_until_ready(
        [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array) and x.is_fully_addressable]
    )
