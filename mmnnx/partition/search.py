"""The search over splits (contiguous runs of layers per stage), each simulated with its stages'
measured times and transfers: every split up to :data:`EXHAUSTIVE` of them, else the minimax
split improved one boundary at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

from mmnnx.models.stages import _holds_layers, _split, _stage_tasks
from mmnnx.mpmd import schedules as sched
from mmnnx.partition.measure import Timing
from mmnnx.partition.pieces import EMBEDDING, HEAD
from mmnnx.partition.result import Split, StagePlan
from mmnnx.sharding import Task
from mmnnx.tuning import _built, _peak_held, _same_ranks

EXHAUSTIVE = 2000
"""The most splits per schedule and microbatch count tried one by one."""


@dataclasses.dataclass(frozen=True)
class Option:
    """A schedule with its stages per task, and the order its stages go on the tasks."""

    schedule: str
    virtual_stages: int
    order: str  # "loop" or "v", as stage_rules takes it


@dataclasses.dataclass(frozen=True)
class Profile:
    """What the search reads: timings per (task, rows), links, launches; ``ends``: empty end
    stages."""

    tasks: tuple[Task, ...]
    rows: int  # of the whole batch
    timings: dict[tuple[str, int], list[Timing]]
    links: dict[tuple[str, str], sched.Link]
    launches: dict[str, float] = dataclasses.field(default_factory=dict)
    ends: tuple[bool, bool] = (False, False)

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.timings.values()))) - 2


def splits(
    n: int, stages: int, ends: tuple[bool, bool] = (False, False)
) -> Iterator[tuple[int, ...]]:
    """Every way of cutting ``n`` layers into ``stages`` consecutive runs, each non-empty but the
    first and the last where ``ends`` allows."""
    for cuts in itertools.combinations(_cut_points(n, ends), stages - 1):
        bounds = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _cut_points(n: int, ends: tuple[bool, bool]) -> range:
    return range(0 if ends[0] else 1, n + 1 if ends[1] else n)


def equal_split(n: int, stages: int) -> tuple[int, ...]:
    """The same number of layers on every stage (the first ones one more where needed)."""
    return tuple(n // stages + (1 if j < n % stages else 0) for j in range(stages))


def evaluate(sizes: Sequence[int], option: Option, m: int, profile: Profile) -> Split:
    """``sizes`` under ``option`` with ``m`` microbatches, simulated."""
    stage_tasks = _stage_tasks(list(profile.tasks), option.virtual_stages, option.order)
    homes = [t.home.name for t in stage_tasks]
    rows = profile.rows // m
    n, count = sum(sizes), len(sizes)
    starts = [sum(sizes[:j]) for j in range(count)]
    pieces = []
    for s, (start, size) in enumerate(zip(starts, sizes, strict=True)):
        wanted = list(range(start + 1, start + size + 1))  # timings: embedding at 0, head n + 1
        pieces.append(([0] if s == 0 else []) + wanted + ([n + 1] if s == count - 1 else []))
    timed = [profile.timings[(homes[s], rows)] for s in range(count)]

    def total(s: int, field: str) -> float:
        return sum(getattr(timed[s][p], field) for p in pieces[s])

    costs = {}
    for s in range(count):
        launch = profile.launches.get(homes[s], 0.0)
        for kind, field in (("F", "forward"), ("B", "backward"), ("I", "input_grad"),
                            ("W", "weight_grad")):  # fmt: skip
            costs[(kind, s)] = total(s, field) + launch
    sent = [timed[s][starts[s] + sizes[s]].output_bytes for s in range(count)]
    transfers = {}
    for s in range(count - 1):
        transfers[("F", s)] = _send(profile, homes[s], homes[s + 1], sent[s])
        backward = _send(profile, homes[s + 1], homes[s], sent[s])
        transfers[("B", s + 1)] = transfers[("I", s + 1)] = backward
    base = dict(
        sizes=tuple(sizes), schedule=option.schedule, num_microbatches=m,
        virtual_stages=option.virtual_stages,
    )  # fmt: skip
    try:
        schedule = _built(option.schedule, count, m, option.virtual_stages, costs.get)
    except (ValueError, TypeError) as e:
        return Split(**base, predicted_seconds=None, peak_bytes=None, rejected=f"cannot run: {e}")
    if not _same_ranks(schedule.stage_to_rank, homes):
        why = f"cannot run: it places stages on ranks {list(schedule.stage_to_rank)}"
        return Split(**base, predicted_seconds=None, peak_bytes=None, rejected=why)
    result = sched.simulate(schedule, action_costs=costs, transfer_costs=transfers)
    held = {s: total(s, "held_bytes") for s in range(count)}
    peaks = _peak_held(result.events, held, homes)
    memory = dict.fromkeys(homes, 0.0)
    for s in range(count):
        memory[homes[s]] += total(s, "state_bytes") + total(s, "optimizer_bytes")
    stages = tuple(
        StagePlan(
            task=stage_tasks[s].name,
            first=starts[s],
            last=starts[s] + sizes[s] - 1,
            groups=(EMBEDDING,) * (s == 0) + (HEAD,) * (s == count - 1),
            forward=costs[("F", s)],
            backward=costs[("B", s)],
            input_grad=costs[("I", s)],
            weight_grad=costs[("W", s)],
            transfer=transfers.get(("F", s), 0.0),
            state_bytes=int(total(s, "state_bytes")),
            optimizer_bytes=int(total(s, "optimizer_bytes")),
            activation_bytes=int(held[s] * result.peak_in_flight[s]),
        )
        for s in range(count)
    )
    return Split(
        **base,
        predicted_seconds=float(result.makespan),
        peak_bytes=int(max(memory[h] + peaks[h] for h in memory)),
        stages=stages,
        table=schedule,
    )


def _send(profile: Profile, source: str, target: str, nbytes: int) -> float:
    """Seconds to move ``nbytes`` from task ``source`` to ``target`` (none on one task)."""
    if source == target:
        return 0.0
    return profile.links[(source, target)].seconds(nbytes)


def search(options: Sequence[Option], microbatches: Sequence[int], profile: Profile) -> list[Split]:
    """Every candidate simulated, fastest first, those that cannot run last."""
    n = profile.num_layers
    found: dict[tuple, Split] = {}

    def tried(sizes: Sequence[int], option: Option, m: int) -> Split:
        key = (tuple(sizes), option, m)
        if key not in found:
            found[key] = evaluate(sizes, option, m, profile)
        return found[key]

    for option in options:
        count = len(profile.tasks) * option.virtual_stages
        for m in microbatches:
            tried(equal_split(n, count), option, m)
            if math.comb(len(_cut_points(n, profile.ends)), count - 1) <= EXHAUSTIVE:
                for sizes in splits(n, count, profile.ends):
                    tried(sizes, option, m)
            else:
                start = _minimax(profile, m, count)
                _climb(start, lambda sizes, o=option, m=m: tried(sizes, o, m), profile.ends)
    return sorted(found.values(), key=_speed)


def _speed(split: Split) -> tuple:
    return (split.predicted_seconds is None, split.predicted_seconds or 0.0)


def _minimax(profile: Profile, m: int, count: int) -> tuple[int, ...]:
    """The split minimising the slowest stage's forward + backward (first task's timings)."""
    timed = profile.timings[(profile.tasks[0].name, profile.rows // m)]
    work = [t.forward + t.backward for t in timed]
    return tuple(_split(work[1:-1], count, work[0], work[-1]))


def _climb(
    start: tuple[int, ...], score: Callable[[Sequence[int]], Split], ends: tuple[bool, bool]
) -> None:
    """Moves one boundary at a time to the fastest neighbour while the step gets faster."""
    current = score(start)
    while current.predicted_seconds is not None:
        sizes = list(current.sizes)
        neighbours = []
        for j in range(len(sizes) - 1):
            for step in (-1, 1):
                moved = list(sizes)
                moved[j] += step
                moved[j + 1] -= step
                if _holds_layers(moved, ends):
                    neighbours.append(score(moved))
        fastest = min((c for c in neighbours if c.predicted_seconds is not None), key=_speed,
                      default=None)  # fmt: skip
        if fastest is None or fastest.predicted_seconds >= current.predicted_seconds:
            return
        current = fastest
