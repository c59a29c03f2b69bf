"""``mm.schedules.partition``: which layers go on which task, with the schedule, microbatch
count and stages per task, from measured per-layer times, transfers and memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from mmnnx.errors import NoCandidateError
from mmnnx.link_timing import measure_link
from mmnnx.models.stages import _check_depth, _stage_tasks, find_layers, split_rules
from mmnnx.mpmd import schedules as sched
from mmnnx.mpmd.schedules.registry import registered
from mmnnx.partition.measure import Timing, launch_seconds, measure, shardings_on
from mmnnx.partition.pieces import Model, Piece, _abstract
from mmnnx.partition.result import PartitionResult, Split
from mmnnx.partition.search import Option, Profile, equal_split, search
from mmnnx.sharding import Task
from mmnnx.tuning import _budget


def partition(
    model: Any,
    loss_fn: Callable[[Any, Any], Any],
    batch: Any,
    tasks: Sequence[Task],
    *,
    optimizer: Any = None,
    wrt: Any = nnx.Param,
    blocks: str | Callable | None = None,
    last: Sequence[str] | None = None,
    memory_budget: int | str | None = None,
    schedules: str | Sequence[str] | None = None,
    microbatches: int | Sequence[int] | None = None,
    virtual_stages: int | Sequence[int] = 1,
    repeats: int = 5,
    report: bool = True,
) -> PartitionResult:
    """Plans which of ``model``'s layers go on which of ``tasks`` (one per rank, in pipeline order),
    with the schedule, microbatch count and stages per task: the fastest simulated candidate whose
    predicted memory per device fits ``memory_budget`` (docs/pipelining.md says how).

    ``loss_fn(model, batch)`` is the loss as the pipelined step computes it, ``batch`` one step's
    batch. The embedding, each layer (``stage_rules``'s, ``blocks`` and ``last`` as it takes them)
    and the head with the loss are timed alone on their tasks (F, B, I, W) at each microbatch size;
    candidates are the contiguous splits times ``schedules`` times ``microbatches`` (default: the
    counts dividing the batch from ``len(tasks)`` to ``4 * len(tasks)``) times ``virtual_stages``.
    ``model`` is not changed. With ``report`` the table is printed.

    Example:
        >>> # result = mm.schedules.partition(model, lambda m, b: m.loss(b), batch, tasks,
        >>> #                                 optimizer=optax.adamw(3e-4), microbatches=8)
        >>> # model = mm.place(model, result.rules)

    Raises:
        ValueError: bad input, before anything is measured (no tasks, a task of another process,
            no layers or stacked ones, a tied head, too few layers, a count not dividing the
            batch, an unknown schedule, a malformed budget, ...).
        NoCandidateError: no candidate fits ``memory_budget`` (naming the smallest budget that
            would) or none can run.
    """
    tasks = _checked_tasks(tasks)
    budget = _budget("partition", memory_budget)
    found = find_layers(model, blocks, last, who="partition")
    _check_model(model, found)
    rows = _rows(batch)
    counts = _microbatches(microbatches, rows, len(tasks))
    options = _options(schedules, virtual_stages, found.count, len(tasks))
    if repeats < 1:
        raise ValueError(f"partition: repeats must be >= 1, got {repeats}")
    pieces = Model(model, found, wrt)
    parts = {rows // m: _parts(pieces, loss_fn, batch, rows // m) for m in counts}
    # each kind of task's layout of the Variables: a bad one is refused before anything is timed
    shardings = {sig: shardings_on(model, task) for sig, task in _firsts(tasks).items()}
    launches = _launches(tasks, repeats)
    timings = _measure_all(
        parts, shardings, tasks, optimizer=optimizer, repeats=repeats, launches=launches
    )
    links = _links(tasks, options)
    profile = Profile(
        tasks=tuple(tasks), rows=rows, timings=timings, links=links, launches=launches,
        ends=found.ends,
    )  # fmt: skip
    candidates = search(options, counts, profile)
    best, candidates = _choose(candidates, budget)
    order = next(o.order for o in options if o.schedule == best.schedule)
    rules = split_rules(
        model, tasks, list(best.sizes), virtual_stages=best.virtual_stages, order=order,
        blocks=blocks, last=last,
    )  # fmt: skip
    equal = _equal_to(best, candidates, found.count)
    result = PartitionResult(
        rules=rules,
        best=best,
        equal=None if equal is best else equal,
        candidates=candidates,
        layers=found.where,
    )
    if report and jax.process_index() == 0:
        print(result)
    return result


def _equal_to(best: Split, candidates: Sequence[Split], n: int) -> Split | None:
    """The equal split under ``best``'s schedule, microbatch count and stages per task."""
    equal = (equal_split(n, len(best.sizes)), best.schedule, best.num_microbatches)
    same = [c for c in candidates if (c.sizes, c.schedule, c.num_microbatches) == equal]
    return next((c for c in same if c.virtual_stages == best.virtual_stages), None)


def _checked_tasks(tasks: Sequence[Task]) -> list[Task]:
    tasks = list(tasks)
    if not tasks:
        raise ValueError("partition: no tasks given")
    for t in tasks:
        if not isinstance(t, Task):
            raise TypeError(f"partition: {t!r} is not an mm.Task")
        if not all(d.process_index == jax.process_index() for d in t.jax_mesh.devices.flat):
            raise ValueError(
                f"partition: task {t.name!r} has devices of another process; the planner "
                "times each task's programs here, so it needs every task in this process"
            )
    names = [t.name for t in tasks]
    if len(set(names)) < len(names):
        raise ValueError(f"partition: task names must differ, got {names}")
    return tasks


def _check_model(model: Any, found: Any) -> None:
    if found.stacked:
        raise ValueError(
            f"partition: {found.where} is one stacked module (nnx.vmap, scan_layers), whose "
            "layer axis is split into equal chunks; the planner cuts layers held as a list"
        )
    if getattr(getattr(model, "config", None), "tie_embeddings", False):
        raise ValueError(
            "partition: the model's head is tied to its embedding (config.tie_embeddings): "
            "the forward pass comes back to the first task for the head, a stage the planner "
            "does not model; untie it (tie_embeddings=False) or use stage_rules"
        )


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    sizes = {x.shape[0] for x in leaves if getattr(x, "ndim", 0) >= 1}
    if len(sizes) != 1 or len(leaves) != sum(getattr(x, "ndim", 0) >= 1 for x in leaves):
        raise ValueError(
            "partition: batch must hold arrays sharing one leading (batch) axis, got leading "
            f"sizes {sorted(sizes)} over {len(leaves)} leaves"
        )
    return sizes.pop()


def _microbatches(microbatches: int | Sequence[int] | None, rows: int, k: int) -> list[int]:
    if microbatches is None:
        return [m for m in range(k, 4 * k + 1) if rows % m == 0] or [rows]
    counts = [microbatches] if isinstance(microbatches, int) else list(microbatches)
    if not counts:
        raise ValueError("partition: microbatches= is empty")
    for m in counts:
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"partition: a microbatch count must be an int >= 1, got {m!r}")
        if rows % m:
            raise ValueError(f"partition: {m} microbatches do not divide the batch of {rows}")
    return list(dict.fromkeys(counts))


def _options(
    schedules: str | Sequence[str] | None,
    virtual_stages: int | Sequence[int],
    n: int,
    k: int,
) -> list[Option]:
    """The (schedule, stages per task, order) choices to search."""
    vs = [virtual_stages] if isinstance(virtual_stages, int) else list(virtual_stages)
    if not vs:
        raise ValueError("partition: virtual_stages= is empty")
    for v in vs:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"partition: virtual_stages must be ints >= 1, got {v!r}")
        _check_depth("partition", n, k * v, v)
    named = [schedules] if isinstance(schedules, str) else schedules
    if named is not None and not list(named):
        raise ValueError("partition: schedules= is empty")
    for name in named or ():
        if name not in sched.names():
            raise ValueError(
                f"partition: unknown schedule {name!r}; valid schedules are "
                f"{', '.join(sched.names())}"
            )
    options = [
        Option(schedule=name, virtual_stages=v, order=order)
        for name in named or sched.names()
        for v in vs
        if (order := registered(name).placement.order(v)) is not None
    ]
    if not options:
        raise ValueError(
            f"partition: no schedule of {list(named or sched.names())} runs virtual_stages="
            f"{vs} (one stage per task: gpipe, 1f1b, zero-bubble-*; 2 or more: interleaved-*; "
            "2: zero-bubble-v, dualpipev)"
        )
    return options


def _signature(task: Task) -> tuple:
    """Tasks with equal signatures run a piece alike (same mesh shape and rules)."""
    mesh = task.jax_mesh
    return (tuple(mesh.shape.items()), task.rules, mesh.devices.flat[0].platform)


def _firsts(tasks: Sequence[Task]) -> dict[tuple, Task]:
    """The first task of each signature: the one a piece is measured on for all of them."""
    firsts: dict[tuple, Task] = {}
    for task in tasks:
        firsts.setdefault(_signature(task), task)
    return firsts


def _measure_all(
    parts: dict[int, list[Piece]],
    shardings: dict[tuple, Any],
    tasks: Sequence[Task],
    **options: Any,
) -> dict[tuple[str, int], list[Timing]]:
    """Every piece's timings per (task name, rows), timed once per task signature."""
    launches = options.pop("launches")
    firsts = _firsts(tasks)
    every = {}
    for rows, pieces in parts.items():
        timed = {
            sig: _timed(pieces, task, shardings[sig], rows, launch=launches[task.name], **options)
            for sig, task in firsts.items()
        }
        for task in tasks:
            every[(task.name, rows)] = timed[_signature(task)]
    return every


def _parts(pieces: Model, loss_fn: Callable, batch: Any, rows: int) -> list[Piece]:
    """The embedding, each layer and the head with the loss, on microbatches of ``rows``."""
    micro = jax.tree.map(lambda x: x[:rows], batch)
    calls = pieces.record(loss_fn, _abstract(micro))
    layers = [pieces.layer(i, call) for i, call in enumerate(calls)]
    return [pieces.embedding(loss_fn, micro), *layers, pieces.head(loss_fn, micro, calls)]


def _timed(parts: Sequence[Piece], task: Task, *args: Any, **options: Any) -> list[Timing]:
    """Each of ``parts`` timed on ``task`` (:func:`measure`'s arguments), alike ones once."""
    seen: list[tuple[Any, Timing]] = []  # by equality: a layer's static state may not hash

    def timing(piece: Piece) -> Timing:
        if piece.key is not None:
            for key, timed in seen:
                if _same(key, piece.key):
                    return timed
        timed = measure(piece, task, *args, **options)
        seen.append((piece.key, timed))
        return timed

    return [timing(piece) for piece in parts]


def _same(a: Any, b: Any) -> bool:
    """Whether two pieces' keys are equal (not where their comparison fails)."""
    try:
        return a is not None and bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _launches(tasks: Sequence[Task], repeats: int) -> dict[str, float]:
    """What a program costs on each task besides its work (tasks of one signature alike)."""
    by_signature = {sig: launch_seconds(task, repeats) for sig, task in _firsts(tasks).items()}
    return {task.name: by_signature[_signature(task)] for task in tasks}


def _links(tasks: Sequence[Task], options: Sequence[Option]) -> dict[tuple[str, str], Any]:
    """The link each way between the tasks of every two consecutive stages."""
    links: dict[tuple[str, str], Any] = {}
    by_name = {t.name: t for t in tasks}
    for option in options:
        homes = [
            t.home.name for t in _stage_tasks(list(tasks), option.virtual_stages, option.order)
        ]
        for a, b in zip(homes, homes[1:], strict=False):
            for pair in ((a, b), (b, a)):
                if a != b and pair not in links:
                    links[pair] = measure_link(by_name[pair[0]], by_name[pair[1]])
    return links


def _choose(candidates: Sequence[Split], budget: int | None) -> tuple[Split, list[Split]]:
    """The fastest candidate that fits ``budget``, and the candidates, those over it marked."""
    runnable = [c for c in candidates if c.predicted_seconds is not None]
    if not runnable:
        reasons = "; ".join(f"{c.schedule} (M={c.num_microbatches}): {c.rejected}"
                            for c in candidates[:5])  # fmt: skip
        raise NoCandidateError(f"partition: no candidate can run: {reasons}", list(candidates))
    fitting = [c for c in runnable if budget is None or c.peak_bytes <= budget]
    if not fitting:
        smallest = min(runnable, key=lambda c: c.peak_bytes)
        raise NoCandidateError(
            f"partition: no split fits the memory budget of {budget:,} B per device; the "
            f"smallest that would fit is {smallest.peak_bytes:,} B (layers "
            f"{'/'.join(map(str, smallest.sizes))} with {smallest.schedule}, M="
            f"{smallest.num_microbatches})",
            list(candidates),
        )
    over = f"over the budget of {budget:,} B" if budget is not None else ""
    marked = [
        dataclasses.replace(c, rejected=over)
        if c.predicted_seconds is not None and budget is not None and c.peak_bytes > budget
        else c
        for c in candidates
    ]
    best = min((c for c in marked if not c.rejected), key=lambda c: c.predicted_seconds)
    return best, marked
