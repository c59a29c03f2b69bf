"""``mm.schedules.tune``: measure a pipelined step once, simulate the candidate schedules, pick.

The step runs twice in ``timeline`` mode (a warm-up that compiles, then one measured run), once
to record live activations (``memory_profile``) and a few times to time the host's launches
(``measure_launch_cost``), on the caller's arguments, whose values are put back afterwards;
the links its stage boundaries cross are measured (``measure_transfers``). The measured
durations per action kind and stage and the bytes each boundary moves, scaled by the microbatch
size, the links and the launch cost drive :func:`~mmnnx.mpmd.schedules.simulate` for every
candidate; memory is each device's placed state plus the candidate's peak in-flight
microbatches times the measured activation bytes of one.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
from rich import box
from rich.table import Table

from mmnnx import _nnx
from mmnnx._tables import Tabulation, render
from mmnnx.errors import MPMDError, NoCandidateError
from mmnnx.link_timing import StepTransfers, measure_launch_cost, measure_transfers
from mmnnx.mpmd import schedules as sched

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
_TIMED_RUNS = 3  # timelines pooled per measurement


def parse_bytes(size: int | str) -> int:
    """``2GiB``, ``512 MiB``, ``1.5GB`` or an int, in bytes.

    Example:
        >>> parse_bytes("2GiB"), parse_bytes(4096)
        (2147483648, 4096)
    """
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    found = re.fullmatch(r"\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    unit = found.group(2).upper() if found else None
    if found is None or unit not in _UNITS:
        raise ValueError(f"memory size {size!r}: expected a number of bytes such as '2GiB'")
    return int(float(found.group(1)) * _UNITS[unit])


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One simulated choice: its predicted step time (seconds), bubble fraction, the largest
    device's predicted memory (bytes), and why it was rejected ("" when it fits). ``table`` is
    the schedule simulated, to pass as ``mm.microbatch(schedule=candidate.table)``: for the
    zero-bubble schedules built by list scheduling it orders the passes for the measured
    durations, which the schedule's name alone (equal durations) does not."""

    schedule: str
    num_microbatches: int
    predicted_seconds: float | None
    bubble: float | None
    peak_bytes: int | None
    rejected: str = ""
    table: sched.Schedule | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class TuneResult:
    """The fastest candidate that fits (``best``) and every candidate, fastest first; ``str``
    draws the table. ``stage_costs``: the seconds measured per ``(action kind, stage)`` at
    ``measured_microbatches`` (each stage's programs timed alone, all they run included, e.g. a
    mixture of experts' all_to_all); a candidate's simulation takes these, times
    ``measured_microbatches / M`` (``I`` and ``W``, of a split backward, are there when one was
    measured; otherwise a candidate that splits it takes half a ``B`` each). ``transfers``:
    the links between the step's tasks and the bytes each stage boundary moves, and
    ``launch_cost`` the host's seconds per launched program, which every candidate's
    simulation takes too."""

    best: Candidate
    candidates: list[Candidate]
    measured_schedule: str
    measured_microbatches: int
    stage_costs: dict[tuple[str, int], float] = dataclasses.field(default_factory=dict)
    transfers: StepTransfers | None = None
    launch_cost: float = 0.0

    def table(self) -> Tabulation:
        """The candidates as a table (text, and HTML in Jupyter)."""
        return _candidates_table(self.candidates, self.best)

    def __str__(self) -> str:
        return str(self.table())

    def _repr_html_(self) -> str:
        return self.table().html


def _candidates_table(candidates: Sequence[Candidate], best: Candidate | None) -> Tabulation:
    table = Table(title="mm.schedules.tune", box=box.SQUARE)
    for column in ("schedule", "M", "predicted step", "bubble", "peak memory/device", "note"):
        table.add_column(column, justify="left" if column in ("schedule", "note") else "right")
    for c in candidates:
        note = c.rejected or ("chosen" if c == best else "")
        table.add_row(
            c.schedule,
            str(c.num_microbatches),
            "-" if c.predicted_seconds is None else f"{c.predicted_seconds * 1e3:.1f} ms",
            "-" if c.bubble is None else f"{c.bubble:.3f}",
            "-" if c.peak_bytes is None else f"{c.peak_bytes:,} B",
            note,
        )
    return render(table)


def _state_bytes_per_device(values: Sequence[Any]) -> dict[Any, int]:
    """Bytes of the step's array arguments on each device."""
    per_device: dict[Any, int] = {}
    for value in values:
        if not isinstance(value, jax.Array):
            continue
        shard = value.sharding.shard_shape(value.shape)
        nbytes = math.prod(shard) * value.dtype.itemsize
        for device in value.sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return per_device


def _built(name: str, num_stages: int, m: int, virtual: int, stage_cost: Any) -> sched.Schedule:
    """Schedule ``name``, ordered for the measured durations when its builder takes them."""
    costs = {(kind, s): stage_cost(kind, s) or 1e-9 for kind in "FIW" for s in range(num_stages)}
    try:
        return sched.get(name, num_stages, m, virtual, costs=costs)
    except sched.CostsNotUsed:
        return sched.get(name, num_stages, m, virtual)


def _fits(name: str, measured: sched.Schedule, virtual: int, stage_home: Sequence[str]) -> bool:
    """Whether schedule ``name`` places the stages as the tasks hold them (and is not plain)."""
    if virtual == 1 and name.startswith("interleaved"):
        return False
    try:
        schedule = sched.get(name, measured.num_stages, measured.num_stages * measured.num_ranks,
                             virtual)  # fmt: skip
    except (ValueError, TypeError):
        return False
    return _places_like(schedule.stage_to_rank, measured, stage_home)


def _places_like(
    stage_to_rank: Sequence[int], measured: sched.Schedule, stage_home: Sequence[str]
) -> bool:
    """Whether two stages share a rank exactly when they share devices (or did in the step)."""
    return _same_ranks(stage_to_rank, stage_home) or _same_ranks(
        stage_to_rank, measured.stage_to_rank
    )


def _same_ranks(stage_to_rank: Sequence[int], stage_home: Sequence[str]) -> bool:
    """Whether two stages share a rank in the schedule exactly when they share devices here."""
    pairs = list(zip(stage_to_rank, stage_home, strict=True))
    return all((ra == rb) == (ha == hb) for ra, ha in pairs for rb, hb in pairs)


def _peak_held(
    events: Sequence[sched.Event], held: dict[int, float], stage_home: Sequence[str]
) -> dict[str, float]:
    """Most activation bytes each home task holds at once, from an F to its B (or W)."""
    changes = []
    for e in events:
        if e.kind == "F":
            changes.append((e.start, 1, stage_home[e.stage], held[e.stage]))
        elif e.kind in "BW":
            changes.append((e.end, 0, stage_home[e.stage], -held[e.stage]))
    now: dict[str, float] = dict.fromkeys(stage_home, 0.0)
    peak = dict(now)
    for _, _, home, delta in sorted(changes):  # at one instant, releases before new forwards
        now[home] += delta
        peak[home] = max(peak[home], now[home])
    return peak


def tune(
    step: Any,
    *args: Any,
    memory_budget: int | str | None = None,
    schedules: str | Sequence[str] | None = None,
    microbatches: int | Sequence[int] | None = None,
    candidates: Sequence[tuple[str, int]] | None = None,
    **kwargs: Any,
) -> TuneResult:
    """Measures ``step(*args, **kwargs)`` (an ``mm.jit`` step with a pipelined
    ``mm.microbatch``) once and returns the fastest candidate schedule and microbatch count
    whose predicted memory per device fits ``memory_budget``, with a table of all.

    Candidates are every registered schedule that runs the step's stages as they are placed
    (``schedules``: default all of those; the interleaved ones need ``virtual_stages`` > 1 and
    are tried only when the step already uses that many, ``zero-bubble-v`` only on a V
    placement) times ``microbatches`` (default: the step's own count); or exactly the
    ``candidates`` given, as ``(schedule, microbatches)`` pairs. A microbatch count that does
    not divide the step's batch is listed as one that cannot run. A candidate's memory is
    each device's arguments plus the most activation bytes its stages hold at once in the
    simulated run. A candidate's per-action time is the measured one scaled by the
    microbatch size; each value crossing between tasks takes what the link between them
    measured for its bytes (scaled alike), and each program waits for the host to launch it
    (in the order the runner does, at the host time per launch measured), so that more
    microbatches pay for more launches. When the step runs a joint backward, it is measured a second
    time with a split one (ZB-H1), whose two programs per stage cost more than half a joint
    backward each. The arguments keep the values they had (an ``mm.cached_partial``'s bound
    ones too).

    Example:
        >>> # result = mm.schedules.tune(train_step, model, opt, batch, memory_budget="2GiB")
        >>> # print(result); result.best.schedule
        >>> # mm.schedules.tune(train_step, model, opt, batch,
        >>> #                   candidates=[("1f1b", 8), ("zero-bubble-h1", 16)])

    Raises:
        ValueError: a malformed budget, schedule list, microbatch count or candidate (before
            anything runs).
        MPMDError: the step has no pipeline or donates its arguments.
        NoCandidateError: no candidate can run or fits the budget (an ``MPMDError`` holding
            the candidates, drawn as a table in its message).
    """
    budget = _budget("tune", memory_budget)
    pairs = _candidate_pairs(schedules, microbatches, candidates)
    partial = hasattr(step, "cached_args")  # an mm.cached_partial: its step, arguments bound
    bound = step.cached_args if partial else ()
    if getattr(step.fn if partial else step, "donate_argnums", ()):
        raise MPMDError("tune: the step donates its arguments, which tune must put back")
    plan = step.plan(*args, **kwargs)
    pipeline = plan.pipeline
    if pipeline is None:
        raise MPMDError(
            "tune: the step has no pipelined mm.microbatch (see plan().unrolled for why a "
            "microbatched function runs unrolled)"
        )
    measured = pipeline.schedule
    m0 = pipeline.num_microbatches
    leaves = jax.tree.leaves((bound, args, kwargs), is_leaf=_nnx.is_variable)
    variables = [v for v in leaves if _nnx.is_variable(v)]
    before = [v.get_raw_value() for v in variables]

    def measure(run: Any) -> dict[tuple[str, int], float]:
        events = []
        try:
            run.timeline(*args, **kwargs)  # compiles
            for _ in range(_TIMED_RUNS):  # pooled: one stall on a busy host is not the median
                _nnx.set_values(variables, before)
                events += run.timeline(*args, **kwargs)
        finally:
            _nnx.set_values(variables, before)
        return sched.measured_costs(events)

    cost = measure(step)
    try:
        memory = step.memory_profile(*args, **kwargs)
        _nnx.set_values(variables, before)
        launch_cost = measure_launch_cost(step, *args, **kwargs)
    finally:
        _nnx.set_values(variables, before)
    transfers = measure_transfers(step, *args, **kwargs)
    split_cost = cost if measured.splits_backward else None
    stage_task = [t.name for t in pipeline.stage_tasks]
    stage_home = [t.home.name for t in pipeline.stage_tasks]
    per_microbatch = {
        task: (total / count if count else 0.0) for task, (total, count) in memory.items()
    }
    state = _state_bytes_per_device(before)
    task_devices = {t.name: list(t.jax_mesh.devices.flat) for t in plan.tasks}
    task_state = {name: max(state.get(d, 0) for d in devs) for name, devs in task_devices.items()}

    def stage_cost(kind: str, stage: int) -> float:
        costs = split_cost if kind in "IW" and split_cost is not None else cost
        if (kind, stage) in costs:
            return costs[(kind, stage)]
        if kind == "B":
            return costs.get(("I", stage), 0.0) + costs.get(("W", stage), 0.0)
        if kind in "IW" and ("B", stage) in costs:
            return costs[("B", stage)] / 2
        return 0.0  # a pass with no ops (the first stage's input gradient)

    results: list[Candidate] = []
    virtual = measured.num_stages // measured.num_ranks
    fitting_names = [n for n in sched.names() if _fits(n, measured, virtual, stage_home)]
    pairs = [
        (name, m or m0)
        for n, m in pairs or [(None, None)]
        for name in ([n] if n is not None else fitting_names)
    ]
    names = list(dict.fromkeys(n for n, _ in pairs))
    if split_cost is None and "zero-bubble-h1" in names and hasattr(step, "with_options"):
        # a split backward runs two programs per stage: measure them rather than halve B
        try:
            sched.get("zero-bubble-h1", measured.num_stages, m0)
        except ValueError:
            pass
        else:
            split_cost = measure(step.with_options(schedule="zero-bubble-h1"))
    rows = pipeline.batch_size
    for name, m in pairs:
        if rows is not None and rows % m:
            why = f"cannot run: {m} microbatches do not divide the batch of {rows}"
            results.append(_rejected(name, m, why))
            continue
        try:
            schedule = _built(name, measured.num_stages, m, virtual, stage_cost)
        except (ValueError, TypeError) as e:
            results.append(_rejected(name, m, f"cannot run: {e}"))
            continue
        if not _places_like(schedule.stage_to_rank, measured, stage_home):
            ranks = list(schedule.stage_to_rank)
            why = f"cannot run: it places stages on ranks {ranks}, this step on tasks {stage_home}"
            results.append(_rejected(name, m, why))
            continue
        scale = m0 / m
        costs = {
            (a.kind, a.stage): stage_cost(a.kind, a.stage) * scale
            for row in schedule.actions
            for a in row
        }
        result = sched.simulate(
            schedule, action_costs=costs, **transfers.simulate_options(schedule, launch_cost)
        )
        held = {
            stage: per_microbatch.get(task, 0.0) * scale for stage, task in enumerate(stage_task)
        }
        activations = _peak_held(result.events, held, stage_home)
        peak = max(int(task_state.get(home, 0) + a) for home, a in activations.items())
        over = budget is not None and peak > budget
        rejected = f"over the budget of {budget:,} B" if over else ""
        results.append(Candidate(
            schedule=name, num_microbatches=m, predicted_seconds=result.makespan, peak_bytes=peak,
            bubble=float(result.bubble_fraction), rejected=rejected, table=schedule,
        ))  # fmt: skip
    fitting = [c for c in results if not c.rejected]
    runnable = [c for c in results if c.peak_bytes is not None]
    results.sort(key=lambda c: (c.predicted_seconds is None, c.predicted_seconds or 0))
    if not runnable:
        reasons = "; ".join(f"{c.schedule} (M={c.num_microbatches}): {c.rejected}" for c in results)
        raise NoCandidateError(
            f"tune: no candidate can run this step's stages: {reasons or 'none'}", results
        )
    if not fitting:
        raise NoCandidateError(
            f"tune: no candidate fits the memory budget of {budget:,} B; the smallest needs "
            f"{min(c.peak_bytes for c in runnable):,} B\n{_candidates_table(results, None)}",
            results,
        )
    best = min(fitting, key=lambda c: c.predicted_seconds)
    kinds = "FBIW" if split_cost is not None else "FB"  # I and W only where measured
    return TuneResult(
        best=best,
        candidates=results,
        measured_schedule=measured.name,
        measured_microbatches=m0,
        stage_costs={(k, s): stage_cost(k, s) for k in kinds for s in range(measured.num_stages)},
        transfers=transfers,
        launch_cost=launch_cost,
    )


def _rejected(name: str, m: int, why: str) -> Candidate:
    """A candidate that cannot run (nothing simulated)."""
    return Candidate(name, m, predicted_seconds=None, bubble=None, peak_bytes=None, rejected=why)


def _candidate_pairs(
    schedules: str | Sequence[str] | None,
    microbatches: int | Sequence[int] | None,
    candidates: Sequence[tuple[str, int]] | None,
) -> list[tuple[str, int | None]] | None:
    """The (schedule, microbatch count) pairs to simulate (``None``: every schedule that runs
    the step's stages as placed, or the step's own count), or ``None`` for all of them at the
    step's own count; a ValueError for bad ones."""
    if candidates is not None:
        if schedules is not None or microbatches is not None:
            raise ValueError("tune: give candidates= or schedules=/microbatches=, not both")
        pairs = list(candidates)
        for pair in pairs:
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError(f"tune: candidate {pair!r} is not a (schedule, microbatches) pair")
        if not pairs:
            raise ValueError("tune: candidates= is empty")
    else:
        names = [schedules] if isinstance(schedules, str) else schedules
        counts = [microbatches] if isinstance(microbatches, int) else microbatches
        if names is not None and not list(names):
            raise ValueError("tune: schedules= is empty")
        if counts is not None and not list(counts):
            raise ValueError("tune: microbatches= is empty")
        if names is None and counts is None:
            return None
        pairs = [
            (n, m)
            for n in (list(names) if names is not None else [None])
            for m in (list(counts) if counts is not None else [None])
        ]
    for name, m in pairs:
        if name is not None and name not in sched.names():
            raise ValueError(
                f"tune: unknown schedule {name!r}; valid schedules are {', '.join(sched.names())}"
            )
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"tune: a microbatch count must be an int >= 1, got {m!r}")
    return pairs


def _budget(caller: str, memory_budget: int | str | None) -> int | None:
    """``memory_budget`` in bytes (``None``: none); a ValueError naming ``caller`` unless > 0."""
    if memory_budget is None:
        return None
    budget = parse_bytes(memory_budget)
    if budget <= 0:
        raise ValueError(f"{caller}: memory_budget must be positive, got {memory_budget!r}")
    return budget
