"""``mmnnx train --partition``: how the blocks are split over the stages (``params``, ``3,1``
or ``auto``, planned by ``mm.schedules.partition``). The split is recorded with each checkpoint,
and ``--resume`` with ``auto`` places the blocks as the run was planned."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from mmnnx.train.validate import given_sizes

if TYPE_CHECKING:
    from mmnnx.train.config import RunConfig

KEY = "partition"
"""The entry of a checkpoint's ``extra`` holding the split (``{"sizes": [3, 1]}``)."""


@dataclasses.dataclass(frozen=True)
class Stages:
    """Where a run's blocks go, and the schedule and microbatch count a planner chose."""

    rules: list
    sizes: tuple[int, ...] | None = None  # None: as stage_rules balanced them
    schedule: Any = None  # a Schedule, as mm.microbatch takes it; None: the run's own
    microbatches: int | None = None

    def extra(self) -> dict[str, Any]:
        """The split as a checkpoint's ``extra`` records it (nothing for ``params``)."""
        return {} if self.sizes is None else {KEY: {"sizes": list(self.sizes)}}

    def train_config(self, config: Any) -> Any:
        """``config`` (a ``TrainConfig``) with the planner's schedule and microbatch count."""
        if self.schedule is None:
            return config
        return dataclasses.replace(config, schedule=self.schedule, microbatches=self.microbatches)


def stages(
    run: RunConfig,
    config: Any,
    tasks: Sequence[Any],
    batch: Any,
    extra: Mapping[str, Any] | None,
    *,
    data_axis: int,
) -> Stages:
    """The run's stages as ``--partition`` says; with ``auto``, the split ``extra`` (the newest
    checkpoint's) records if it still fits, else planned on ``batch`` (a ``ValueError`` or
    ``NoCandidateError`` when the planner refuses)."""
    from mmnnx.train.run_model import run_placement  # noqa: PLC0415

    lay = run.layout
    placed = {"virtual_stages": lay.virtual_stages, "schedule": run.training.schedule}
    if lay.partition == "params":
        return Stages(rules=run_placement(config, tasks, **placed, report=True))
    sizes = given_sizes(lay.partition) or _recorded(extra, run, config.depth)
    if sizes is not None:
        return Stages(rules=run_placement(config, tasks, **placed, sizes=sizes), sizes=sizes)
    return _planned(run, config, tasks, batch, data_axis)


def _recorded(extra: Mapping[str, Any] | None, run: RunConfig, depth: int):
    """The split a resumed run recorded, when it has as many stages and blocks as now."""
    sizes = ((extra or {}).get(KEY) or {}).get("sizes")
    stages = run.layout.stages * run.layout.virtual_stages
    if not (isinstance(sizes, list) and len(sizes) == stages and sum(sizes) == depth):
        return None
    print(
        f"partition auto: the split the run was planned with, {'/'.join(map(str, sizes))} "
        "blocks per stage (recorded with its checkpoint)"
    )
    return tuple(sizes)


def _planned(run: RunConfig, config: Any, tasks: Sequence[Any], batch: Any, data_axis: int):
    """``mm.schedules.partition`` of the run's model on ``batch``."""
    import jax  # noqa: PLC0415

    from mmnnx.partition import partition  # noqa: PLC0415
    from mmnnx.train.config import train_config  # noqa: PLC0415
    from mmnnx.train.loop import make_optimizer  # noqa: PLC0415
    from mmnnx.train.run_model import abstract_model, trainable  # noqa: PLC0415

    if jax.process_count() > 1:
        raise ValueError(
            "the planner times every stage's programs in one process; plan in one process "
            "(--partition auto), then run the job with the split it prints (--partition 3,1)"
        )
    training = run.training
    auto = training.schedule == "auto"
    schedules = None if auto else training.schedule
    counts = _microbatches(run, data_axis) if auto else training.microbatches
    if training.memory_budget is not None:
        schedules, counts = _within_budget(run, config, data_axis, schedules, counts)
    result = partition(
        abstract_model(run, config),
        lambda model, b: model.loss(b),
        batch,
        tasks,
        optimizer=make_optimizer(train_config(run)),
        wrt=trainable(run),
        memory_budget=training.memory_budget,
        schedules=schedules,
        microbatches=counts,
        virtual_stages=run.layout.virtual_stages,
        report=True,
    )
    print(
        f"partition auto: {'/'.join(map(str, result.sizes))} blocks per stage, "
        f"{result.schedule} with {result.num_microbatches} microbatches (predicted "
        f"{result.predicted_seconds * 1e3:.1f} ms per step)"
    )
    return Stages(
        rules=result.rules,
        sizes=result.sizes,
        schedule=result.best.table if auto else None,
        microbatches=result.num_microbatches if auto else None,
    )


def _microbatches(run: RunConfig, data_axis: int) -> list[int]:
    """``--microbatches`` and the counts up to 4 x ``--stages`` the data (expert) axis splits."""
    shards, stages = data_axis * run.layout.expert_axis, run.layout.stages
    batch = run.training.batch_size
    counts = [
        m for m in range(stages, 4 * stages + 1) if batch % m == 0 and (batch // m) % shards == 0
    ]
    return sorted({run.training.microbatches, *counts})


def _within_budget(
    run: RunConfig, config: Any, data_axis: int, schedules: Any, counts: Any
) -> tuple[list[str], list[int]]:
    """The schedules and microbatch counts left to plan once the candidates whose predicted
    peak (``mm.predict_memory``, blocks split by parameters) exceeds ``--memory-budget`` are
    skipped, printing which; a ``ValueError`` naming the stage when none is left."""
    from mmnnx.mpmd.schedules import names  # noqa: PLC0415
    from mmnnx.partition.memory import fitting_candidates, format_bytes  # noqa: PLC0415
    from mmnnx.train.validate import memory_inputs  # noqa: PLC0415
    from mmnnx.tuning import parse_bytes  # noqa: PLC0415

    layout, options = memory_inputs(run, data_axis)
    budget = run.training.memory_budget
    named = [schedules] if isinstance(schedules, str) else list(schedules or names())
    many = [counts] if isinstance(counts, int) else list(counts)
    pairs = [(s, m) for s in named for m in many]
    fits, over = fitting_candidates(config, layout, parse_bytes(budget), pairs, **options)
    if over:
        skipped = ", ".join(
            f"{s} M={m} (task {p.worst.task}: {format_bytes(p.peak)})" for (s, m), p in over.items()
        )
        print(f"partition auto: skipped, predicted over --memory-budget {budget}: {skipped}")
    if not fits:
        (s, m), p = min(over.items(), key=lambda item: item[1].peak)
        raise ValueError(
            f"no candidate fits --memory-budget {budget}: the smallest, {s} with {m} "
            f"microbatches, needs {format_bytes(p.peak)} per device on task {p.worst.task}"
        )
    return list(dict.fromkeys(s for s, _ in fits)), list(dict.fromkeys(m for _, m in fits))
