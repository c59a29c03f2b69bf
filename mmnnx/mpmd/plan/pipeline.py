"""Pipelining a traced step: ``pre`` ops, an ``mm.microbatch`` region cut into per-stage F/B (or
I/W) fragments run per microbatch in a schedule's order, and ``post`` ops."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import jax.numpy as jnp

from mmnnx.errors import MPMDError
from mmnnx.mpmd import schedules as sched
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.op_kinds import is_cheap
from mmnnx.mpmd.plan import remat
from mmnnx.mpmd.plan.carry import Carry, carry_of, is_marker
from mmnnx.mpmd.plan.chain import describe, not_a_chain
from mmnnx.mpmd.plan.cut import (
    Fragment,
    after_backward,
    cut,
    kinds_of,
    make_fragment,
    replicable_ops,
    with_replicas,
)
from mmnnx.mpmd.plan.flow import follow_the_flow
from mmnnx.mpmd.plan.stage_levels import check_stage_order, forward_levels
from mmnnx.mpmd.primitives import is_accumulate, is_index
from mmnnx.mpmd.trace.control_flow import scan_first_part, split_scan
from mmnnx.mpmd.trace.trace_state import MicrobatchGroup
from mmnnx.sharding import Task

_SMALL_STATE = 4096  # bytes: inputs this small may be sent to every stage that reads them
_SMALL_TABLE = 64 * 2**10  # bytes: constant tables this small are remade by every stage


@dataclasses.dataclass
class Pipeline:
    """The pipelined plan of a step: fragments and the order to dispatch them in."""

    schedule: sched.Schedule  # the schedule its stages run (the tuned or named one)
    stage_tasks: list[Task]  # the task of each stage, in stage order
    pre: list[Fragment]  # before the microbatch loop
    stages: dict[tuple[str, int], Fragment]  # (kind F/B/I/W, stage) -> its fragment
    post: list[Fragment]  # after the loop (optimizer updates)
    index_value: int | None  # the microbatch index the stages read, if any
    accumulated: dict[int, int]  # accumulate op output -> its per-microbatch input
    region_values: set[int]  # values made once per microbatch
    order: list[tuple[Fragment, int | None]]  # dispatch order, with each one's microbatch
    carry: Carry = dataclasses.field(default_factory=lambda: Carry({}, {}))  # state chained
    num_microbatches: int = 1
    fused: frozenset[int] = frozenset()  # positions in ``order`` run as one program with the next
    batch_size: int | None = None  # rows split into the microbatches
    # fragment id -> (task, kind, stage, part) of the stage fragment it is a part of (share_cores)
    parts: dict[int, tuple[str, str, int, int]] = dataclasses.field(default_factory=dict)

    @property
    def fragments(self) -> list[Fragment]:
        return [*self.pre, *self.stages.values(), *self.post]


def plan_pipeline(
    graph: Graph,
    op_tasks: Sequence[Task],
    tasks: Sequence[Task],
    groups: dict[int, MicrobatchGroup],
    free_inputs: set[int],
    pinned: AbstractSet[int] = frozenset(),
    *,
    recompute_residuals: bool = True,
    schedule: str | sched.Schedule | None = None,
    names: Mapping[int, str] | None = None,
) -> tuple[Pipeline | None, tuple[Task, ...]]:
    """The pipelined plan (``None`` when the step has no traced microbatch region) and the task
    of every op, which planning may change. ``free_inputs``: the graph inputs placed on no task;
    ``pinned``: the ops whose task is fixed; ``schedule``, if given, replaces the one the
    ``mm.microbatch`` call named; ``names`` (graph input value -> its path) are for errors."""
    names = names or {}
    region_groups = {op.group for op in graph.ops if op.group is not None}
    if not region_groups:
        return None, tuple(op_tasks)
    if len(region_groups) > 1:
        raise MPMDError(
            f"mm.jit: a step may contain one mm.microbatch call; this one has {len(region_groups)}"
        )
    (gid,) = region_groups
    group = groups[gid]
    if schedule is not None:
        group = dataclasses.replace(group, schedule=schedule)
    consumers = graph.consumers()

    index_ops = [op for op in graph.ops if is_index(op)]
    index_value = index_ops[0].outs[0] if index_ops else None
    accumulate_ops = [op for op in graph.ops if is_accumulate(op)]
    chained = carry_of(graph)

    def special(op: Op) -> bool:
        return is_index(op) or is_accumulate(op) or is_marker(op)

    region = [op for op in graph.ops if op.group == gid and not special(op)]
    region_ids = {op.index for op in region}
    region_values = {v for op in region for v in op.outs}
    accumulated = {op.outs[0]: op.ins[0] for op in accumulate_ops}

    for v in region_values:
        for c in consumers.get(v, ()):
            if c.index not in region_ids and not is_accumulate(c) and not is_marker(c):
                raise MPMDError(
                    f"mm.jit: `{c.name}` at {c.source} reads a value computed inside "
                    "mm.microbatch that is not one of its outputs (differentiate inside the "
                    "microbatched function: mm.microbatch(nnx.value_and_grad(loss_fn), ...))"
                )
    if any(v in region_values for v in graph.outputs if isinstance(v, int)):
        raise MPMDError("mm.jit: a value computed inside mm.microbatch is returned directly")

    downstream: set[int] = set(accumulated) | set(chained.results)
    post_ops, pre_ops = [], []
    for op in graph.ops:
        if op.index in region_ids or special(op):
            continue
        if any(isinstance(a, int) and a in downstream for a in op.ins):
            downstream.update(op.outs)
            post_ops.append(op)
        else:
            pre_ops.append(op)
    pre_ops, post_ops = _sink_to_post(graph, pre_ops, post_ops, region_ids, special)

    # Index arithmetic, the batch's slicing, side inputs made from them and constants, and RNG
    # keys drawn from small non-float state are recomputed in every stage that reads them.
    seeds = {index_value} if index_value is not None else set()
    small_state = {v for v in graph.inputs if graph.nbytes[v] <= _SMALL_STATE}
    draws = {v for v in small_state if not jnp.issubdtype(graph.dtypes[v], jnp.floating)}
    batch = set(free_inputs) | draws
    replicable = replicable_ops(
        graph, region, seeds, batch | _batch_derived(pre_ops, batch), side_inputs=True
    )
    made_here = _stage_constants(graph, pre_ops, region_ids, small_state)
    made_ids = {op.index for op in made_here}
    pre_ops = [op for op in pre_ops if op.index not in made_ids]
    replicable = sorted([*replicable, *made_here], key=lambda op: op.index)
    replicable_ids = {op.index for op in replicable}
    staged = [op for op in region if op.index not in replicable_ids]
    op_tasks = follow_the_flow(graph, staged, op_tasks, pinned)
    stages, stage_tasks = stage_fragments(graph, staged, op_tasks, replicable, names)
    chain = chain_of(graph, stages, stage_tasks, replicable_ids, names)
    schedule = _schedule(group, len(stage_tasks), chain)
    _check_ranks(schedule, stage_tasks, chain)
    if schedule.splits_backward:
        stages = split_backward(graph, stages, op_tasks, schedule.split_stages)
        region_values |= {v for f in stages.values() for op in f.ops for v in op.outs}
    _check_chains(graph, chained, stages)
    if recompute_residuals:
        stages = remat.recompute_residuals(graph, stages, replicable_ids, chained.marker_values)

    pre = cut(graph, op_tasks, tasks, pre_ops, suffix="pre", free_inputs=free_inputs)
    post = cut(graph, op_tasks, tasks, post_ops, suffix="post", free_inputs=free_inputs)
    order: list[tuple[Fragment, int | None]] = [(f, None) for f in pre]
    fused: set[int] = set()
    for first, second in sched.dispatch_order(schedule):
        frag = stages.get((first.kind, first.stage))
        paired = second and stages.get((second.kind, second.stage))
        if frag is not None and paired is not None:
            fused.add(len(order))
            order += [(frag, first.microbatch), (paired, second.microbatch)]
        else:  # absent: that pass of that stage has no ops (e.g. I of stage 0)
            order += [(f, e.microbatch) for f, e in ((frag, first), (paired, second)) if f]
    order += [(f, None) for f in post]
    pipeline = Pipeline(
        schedule=schedule,
        stage_tasks=stage_tasks,
        pre=pre,
        stages=stages,
        post=post,
        index_value=index_value,
        accumulated=accumulated,
        region_values=region_values,
        order=order,
        carry=chained,
        num_microbatches=group.num_microbatches,
        fused=frozenset(fused),
        batch_size=group.batch_size,
    )
    return pipeline, tuple(op_tasks)


def _sink_to_post(
    graph: Graph,
    pre_ops: list[Op],
    post_ops: list[Op],
    region_ids: set[int],
    special: Callable[[Op], bool],
) -> tuple[list[Op], list[Op]]:
    """Moves the pure ops of ``pre_ops`` the microbatch loop does not need after it."""
    producer = graph.producers()
    needed: set[int] = set()
    stack = [
        a
        for op in graph.ops
        if op.index in region_ids or special(op)
        for a in op.ins
        if isinstance(a, int)
    ]
    while stack:
        op = producer.get(stack.pop())
        if op is None or op.index in needed or op.index in region_ids or special(op):
            continue
        needed.add(op.index)
        stack += [a for a in op.ins if isinstance(a, int)]
    sunk = {
        op.index
        for op in pre_ops
        if op.index not in needed and not op.effectful and not op.may_fail
    }
    if not sunk:
        return pre_ops, post_ops
    keep = [op for op in pre_ops if op.index not in sunk]
    after = sorted([*post_ops, *(op for op in pre_ops if op.index in sunk)], key=lambda o: o.index)
    return keep, after


def _batch_derived(pre_ops: list[Op], sources: AbstractSet[int]) -> set[int]:
    """The values that ``pre_ops`` compute from ``sources`` and constants only."""
    derived = set(sources)
    for op in sorted(pre_ops, key=lambda op: op.index):
        pure = not op.effectful and not op.may_fail
        if pure and all(not isinstance(a, int) or a in derived for a in op.ins):
            derived.update(op.outs)
    return derived - set(sources)


def _stage_constants(
    graph: Graph, pre_ops: list[Op], region_ids: set[int], small_inputs: AbstractSet[int]
) -> list[Op]:
    """The cheap ops of ``pre_ops`` computed from constants and ``small_inputs`` only, whose
    results (up to ``_SMALL_TABLE`` bytes) only pipeline stages or other such ops read: each
    stage makes its own."""
    consumers = graph.consumers()
    outputs = {v for v in graph.outputs if isinstance(v, int)}
    made: dict[int, Op] = {}
    for op in pre_ops:
        small = all(graph.nbytes[v] <= _SMALL_TABLE for v in op.outs)
        if op.outs and small and not op.effectful and not op.may_fail and is_cheap(op):
            made[op.index] = op
    changed = True
    while changed:  # a table read by anything but the stages and other tables stays as it is
        changed = False
        made_values = {v for op in made.values() for v in op.outs}
        for index, op in list(made.items()):
            reads_other = any(
                isinstance(a, int) and a not in small_inputs and a not in made_values
                for a in op.ins
            )
            read_elsewhere = any(
                c.index not in region_ids and c.index not in made
                for v in op.outs
                for c in consumers.get(v, ())
            )
            if reads_other or read_elsewhere or outputs.intersection(op.outs):
                del made[index]
                changed = True
    return list(made.values())


def _check_chains(graph: Graph, chained: Carry, stages: dict[tuple[str, int], Fragment]) -> None:
    """Raises unless each chained Variable is read and written by one stage's forward program."""
    where = {op.index: key for key, frag in stages.items() for op in frag.ops}
    producer = graph.producers()
    consumers = graph.consumers()
    for start, (_, new) in chained.starts.items():
        if new is None:
            continue
        maker = producer.get(new)
        keys = {where.get(maker.index)} if maker is not None else {None}
        keys |= {where.get(c.index) for c in consumers.get(start, ()) if c.index in where}
        if len(keys) != 1 or None in keys or next(iter(keys))[0] != "F":
            source = maker.source if maker is not None else "?"
            raise MPMDError(
                f"mm.microbatch: the state updated at {source} is read and written by different "
                f"pipeline stages or passes ({sorted(str(k) for k in keys)}); each microbatch "
                "starts from the previous one's value, so one stage's forward pass must both "
                "read and update it (place the Variable with the layer that updates it)"
            )


def stage_fragments(
    graph: Graph,
    region: list[Op],
    op_tasks: list[Task],
    replicable: list[Op],
    names: Mapping[int, str] | None = None,
) -> tuple[dict[tuple[str, int], Fragment], list[Task]]:
    """Each op of ``region`` in its stage's F or B fragment; and the task of each stage."""
    names = names or {}
    level, late = forward_levels(graph, region, op_tasks)
    updates = after_backward(graph)
    backward = {op.index for op in region if op.backward or op.index in updates} | late
    at_depth: dict[int, dict[Task, list[Op]]] = {}  # depth -> each task's forward ops there
    for op in region:
        if op.index not in backward:
            at_depth.setdefault(level[op.index], {}).setdefault(op_tasks[op.index], []).append(op)
    num_stages = max(at_depth) + 1 if at_depth else 1
    stage_tasks: list[Task] = []
    for s in range(num_stages):
        found = at_depth.get(s, {})
        if len(found) != 1:
            again = [t for t in found if any(t in ts for d, ts in at_depth.items() if d != s)]
            raise not_a_chain(s, found, again, graph.producers(), names)
        stage_tasks.append(next(iter(found)))

    # A backward op's depth counts task changes along the backward pass only
    inside = {op.index: op for op in region}
    producer_of = {v: op for op in region for v in op.outs}
    depth: dict[int, int] = {}
    stage_of: dict[int, int] = {}

    def nearest_stage(task: Task, target: int, op: Op) -> int:
        candidates = [s for s, t in enumerate(stage_tasks) if t == task]
        if not candidates:
            raise MPMDError(
                f"mm.jit: `{op.name}` at {op.source} runs on task {task.name!r}, which does not "
                f"fit the pipeline's stage chain ({', '.join(t.name for t in stage_tasks)})"
            )
        return min(candidates, key=lambda s: (abs(s - target), s))

    for op in region:
        task = op_tasks[op.index]
        if op.index not in backward:
            stage_of[op.index] = level[op.index]
            if level[op.index] >= num_stages or stage_tasks[level[op.index]] != task:
                stage_of[op.index] = nearest_stage(task, level[op.index], op)
            continue
        if op.index in late:
            continue
        d = 0
        for a in op.ins:
            p = producer_of.get(a) if isinstance(a, int) else None
            if p is not None and p.index in backward and p.index not in late:
                d = max(d, depth[p.index] + (op_tasks[p.index] != task))
        depth[op.index] = d
        stage_of[op.index] = nearest_stage(task, num_stages - 1 - d, op)
    consumers = graph.consumers()
    for op in reversed(region):  # read only by the backward pass: runs with its readers
        if op.index in late:
            task = op_tasks[op.index]
            readers = [
                stage_of[c.index]
                for v in op.outs
                for c in consumers.get(v, ())
                if c.index in inside and c.index in stage_of and op_tasks[c.index] == task
            ]
            stage_of[op.index] = min(readers) if readers else nearest_stage(task, 0, op)
    # A task's ops right after one of its virtual stages run in that stage
    merged, kept = [0] * num_stages, [0]
    for s in range(1, num_stages):
        if stage_tasks[s] is not stage_tasks[s - 1] and stage_tasks[s] is stage_tasks[s - 1].home:
            merged[s] = merged[s - 1]
        else:
            merged[s] = len(kept)
            kept.append(s)
    if len(kept) < num_stages:
        for index, s in stage_of.items():
            stage_of[index] = merged[s]
            op_tasks[index] = stage_tasks[kept[merged[s]]]
        stage_tasks = [stage_tasks[s] for s in kept]
    members: dict[tuple[str, int], list[Op]] = {}
    for op in region:
        kind = "B" if op.index in backward else "F"
        members.setdefault((kind, stage_of[op.index]), []).append(op)
    fragments = {}
    for key, ops in sorted(members.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        task = stage_tasks[key[1]]
        name = f"{task.name}/{key[0]}{key[1]}"
        fragments[key] = with_replicas(graph, name, task, ops, kinds_of(ops, updates), replicable)
    replicas = {op.index for op in replicable}
    check_stage_order(
        graph, fragments, stage_tasks, chain_of(graph, fragments, stage_tasks, replicas, names)
    )
    return fragments, stage_tasks


def chain_of(
    graph: Graph,
    stages: dict[tuple[str, int], Fragment],
    stage_tasks: Sequence[Task],
    replicas: AbstractSet[int],
    names: Mapping[int, str],
) -> str:
    """The stage chain in words, from each stage's forward ops but ``replicas``."""
    forward = [stages.get(("F", s)) for s in range(len(stage_tasks))]
    ops = [[op for op in f.ops if op.index not in replicas] if f else [] for f in forward]
    return describe(stage_tasks, ops, graph.producers(), names)


def _schedule(group: MicrobatchGroup, num_stages: int, chain: str) -> sched.Schedule:
    """The schedule ``group`` names (or holds) for ``num_stages`` stages."""
    m = group.num_microbatches
    v = group.virtual_stages
    tied = (
        "; a task whose Variables the forward pass reads at two points, such as an output head "
        "tied to the embedding, pipelines in the V placement, mm.stage_rules(..., "
        "virtual_stages=2, order='v')"
        if v > 1 and num_stages % v
        else ""
    )
    why = f" ({chain}{tied})"
    if isinstance(group.schedule, sched.Schedule):
        schedule = group.schedule
        if schedule.num_stages != num_stages or schedule.num_microbatches != m:
            raise MPMDError(
                f"mm.jit: the schedule {schedule.name!r} passed to mm.microbatch is for "
                f"{schedule.num_stages} stages and "
                f"{schedule.num_microbatches} microbatches; this step has {num_stages} stages "
                f"and {m} microbatches{why}"
            )
        return schedule
    try:
        return sched.get(group.schedule, num_stages, m, v)
    except ValueError as e:
        raise MPMDError(f"mm.jit: mm.microbatch(schedule={group.schedule!r}): {e}{why}") from None


def _check_ranks(schedule: sched.Schedule, stage_tasks: Sequence[Task], chain: str) -> None:
    """Raises unless the stages a schedule runs on one rank run on one task's devices."""
    for s, task in enumerate(stage_tasks):
        together = schedule.stages_of(schedule.stage_to_rank[s])
        first = stage_tasks[together[0]]
        if first.home == task.home:
            continue
        ranks, num_ranks = schedule.stage_to_rank, schedule.num_ranks
        if ranks == tuple(i % num_ranks for i in range(len(ranks))):
            fix = "order='loop', the default"
        elif ranks == (*range(num_ranks), *reversed(range(num_ranks))):
            fix = "order='v'"
        else:
            fix = None
        how = (
            f"; mm.stage_rules(model, tasks, virtual_stages={len(ranks) // num_ranks}, {fix}) "
            "places them so"
            if fix
            else ""
        )
        raise MPMDError(
            f"mm.jit: schedule {schedule.name!r} runs stages {together} on one rank, but stage "
            f"{s} runs on task {task.name!r} and stage {together[0]} on task {first.name!r} "
            f"({chain}; the schedule "
            f"puts stage 0, 1, ... on ranks {', '.join(map(str, ranks))}{how})"
        )


def split_backward(
    graph: Graph,
    stages: dict[tuple[str, int], Fragment],
    op_tasks: Sequence[Task],
    split: frozenset[int],
) -> dict[tuple[str, int], Fragment]:
    """Zero-bubble: each split stage's backward also as an I fragment and a W fragment."""
    out: dict[tuple[str, int], Fragment] = dict(stages)
    consumers = graph.consumers()
    in_stage = {op.index for frag in stages.values() for op in frag.ops}
    for (kind, stage), frag in stages.items():
        if kind != "B" or stage not in split:
            continue
        inside = {op.index for op in frag.ops}
        producer = {v: op for op in frag.ops for v in op.outs}
        critical = {
            v
            for v in frag.out_ids
            if any(
                c.index not in inside and (c.index in in_stage or op_tasks[c.index] != frag.task)
                for c in consumers.get(v, ())
            )
        }
        needed, scans = _input_gradient_ops(critical, producer)
        i_ops: list[Op] = []
        w_ops: list[Op] = []
        reads = consumers
        for op in frag.ops:
            parts = split_scan(op, scans[op.index], graph) if op.index in scans else None
            if parts is not None:  # its input-gradient part now, its weight-gradient part later
                for k, part in enumerate(parts):
                    part.index = len(graph.ops) + 2 * op.index + k
                reads = _with_split(reads, op, parts)
                i_ops.append(parts[0])
                w_ops.append(parts[1])
            else:
                (i_ops if op.index in needed else w_ops).append(op)
        name = frag.task.name
        if i_ops:
            out[("I", stage)] = make_fragment(
                graph, f"{name}/I{stage}", frag.task, i_ops, ("backward",), reads
            )
        if w_ops:
            out[("W", stage)] = make_fragment(
                graph, f"{name}/W{stage}", frag.task, w_ops, frag.kinds, reads
            )
    return out


def _input_gradient_ops(
    critical: set[int], producer: dict[int, Op]
) -> tuple[set[int], dict[int, list[bool]]]:
    """The ops an I pass runs for ``critical``, and the results of each split scan it needs."""
    needed: set[int] = set()
    scans: dict[int, list[bool]] = {}
    whole: set[int] = set()  # scans the I pass runs whole
    seen: set[int] = set()
    stack = list(critical)
    while stack:
        v = stack.pop()
        op = producer.get(v)
        if v in seen or op is None:
            continue
        seen.add(v)
        needed.add(op.index)
        if op.name == "scan" and op.index not in whole:
            wanted = scans.setdefault(op.index, [False] * len(op.outs))
            wanted[op.outs.index(v)] = True
            part = scan_first_part(op, wanted)
            if part is not None:
                outs, operands = part
                stack += [o for o, w in zip(op.outs, outs, strict=True) if w]
                stack += [a for a, r in zip(op.ins, operands, strict=True) if r]
                continue
            del scans[op.index]
            whole.add(op.index)
        stack += [a for a in op.ins if isinstance(a, int)]
    return needed, scans


def _with_split(
    consumers: dict[int, list[Op]], op: Op, parts: tuple[Op, Op]
) -> dict[int, list[Op]]:
    """``consumers`` with ``op``'s reads replaced by those of the two scans it was split into."""
    out = dict(consumers)
    for part in parts:
        for a in part.ins:
            if isinstance(a, int):
                mine = [c for c in out.get(a, ()) if c is not op]
                out[a] = [*mine, part] if part not in mine else mine
    for a in op.ins:
        if isinstance(a, int) and not any(a in part.ins for part in parts):
            out[a] = [c for c in out.get(a, ()) if c is not op]
    return out
