"""Which forward stage each op of a pipelined region runs in (a value several later stages read
is a side input of each, not a stage of its own)."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.plan.cut import Fragment, after_backward, levels, reader_bounds
from mmnnx.mpmd.primitives import is_index
from mmnnx.sharding import Task


def settle_on_visits(
    graph: Graph,
    forward: Sequence[Op],
    op_tasks: Sequence[Task],
    level: dict[int, int],
    raw: dict[int, int] | None = None,
) -> dict[int, int]:
    """``level`` (a new dict) with each op of ``forward`` moved to the latest depth at which its
    task runs other forward ops and that its readers allow; ``raw`` (depths before
    :func:`join_consumers`): an op it moved marks no visit of its task."""
    level = dict(level)
    inside = {op.index for op in forward}
    consumers = graph.consumers()
    producer = {v: op for op in forward for v in op.outs}
    for _ in range(len(forward)):
        visits: dict[Task, set[int]] = {}
        runs: dict[int, set[Task]] = {}
        for op in forward:
            if raw is None or raw[op.index] == level[op.index]:  # not moved to its readers
                visits.setdefault(op_tasks[op.index], set()).add(level[op.index])
            runs.setdefault(level[op.index], set()).add(op_tasks[op.index])
        moved = False
        for op in reversed(forward):
            bounds = reader_bounds(op, level, op_tasks, consumers, inside)
            depth, task = level[op.index], op_tasks[op.index]
            mine = visits.get(task, {depth})
            if bounds and depth not in mine:  # moved where its task runs nothing
                lowest = max(
                    (
                        level[p.index] + (op_tasks[p.index] != task)
                        for a in op.ins
                        if isinstance(a, int) and (p := producer.get(a)) is not None
                    ),
                    default=0,
                )
                later, pick = [d for d in mine if lowest <= d <= min(bounds)], max
            elif bounds:
                later = [d for d in mine if depth < d <= min(bounds)]
                pick = max
            elif len(runs[depth]) > 1:  # an end of the pass (a microbatch's output, a sown
                # value) at a depth another task's stage runs: its own task's next visit
                later, pick = [d for d in mine if d > depth], min
            else:
                continue
            if later:
                level[op.index] = pick(later)
                moved = True
        if not moved:
            break
    return level


def check_stage_order(
    graph: Graph,
    fragments: dict[tuple[str, int], Fragment],
    stage_tasks: Sequence[Task],
    chain: str | None = None,
) -> None:
    """Raises an ``MPMDError`` unless each stage's fragment reads only what runs before it for
    the same microbatch; ``chain``: the stage chain in words for the message."""
    made_by = {v: key for key, frag in fragments.items() for v in frag.out_ids}
    producer = graph.producers()
    passes = {"F": "the forward pass", "B": "the backward pass"}
    for (kind, stage), frag in fragments.items():
        for v in frag.in_ids:
            source = made_by.get(v)
            if source is None or source == (kind, stage):
                continue
            made_kind, made_stage = source
            if made_kind == "F" and (kind == "B" or made_stage < stage):
                continue
            if made_kind == "B" and kind == "B" and made_stage > stage:
                continue
            maker = producer[v]
            reader = next(op for op in frag.ops if v in op.ins)
            where = stage_tasks[made_stage].name
            fix = stage_tasks[stage].name
            chain = chain or "the forward pass runs on " + " -> ".join(t.name for t in stage_tasks)
            raise MPMDError(
                f"mm.jit: `{reader.name}` at {reader.source} ({passes[kind]} of stage {stage}, "
                f"on task {frag.task.name!r}) reads the result of `{maker.name}` at "
                f"{maker.source} ({passes[made_kind]} of stage {made_stage}, on task "
                f"{where!r}), which runs after it ({chain}); place the "
                f"Variables the layer at {maker.source} reads on task {fix!r}, or put that code "
                f"in an mm.task({fix!r}) region"
            )


def forward_levels(
    graph: Graph, region: list[Op], op_tasks: Sequence[Task], raw: dict[int, int] | None = None
) -> tuple[dict[int, int], set[int]]:
    """The forward depth of each op of ``region``, and the ops only the backward reads."""
    if raw is None:
        raw = levels(graph, region, op_tasks, inputs_movable=False)
    level, late = join_consumers(graph, region, op_tasks, raw)
    skipped = late | after_backward(graph)
    forward = [op for op in region if not op.backward and op.index not in skipped]
    return settle_on_visits(graph, forward, op_tasks, level, raw), late


def join_consumers(
    graph: Graph, region: list[Op], op_tasks: Sequence[Task], levels_in: dict[int, int]
) -> tuple[dict[int, int], set[int]]:
    """New levels in which an op reading only values from outside the region joins the stage of
    its (forward, if any) readers, and one nothing in the region reads its task's first forward
    stage; and the "late" forward ops only the backward reads, which run there unless they
    compute on the microbatch (:func:`_microbatch_values`)."""
    level = dict(levels_in)
    inside = {op.index for op in region}
    producer = {v: op for op in region for v in op.outs}
    consumers = graph.consumers()
    fed = _microbatch_values(graph, inside)  # grows by the local ops' results made from them
    local: set[int] = set()
    late: set[int] = set()
    for op in region:
        task = op_tasks[op.index]
        if all(
            a not in producer
            or (producer[a].index in local and op_tasks[producer[a].index] == task)
            for a in op.ins
            if isinstance(a, int)
        ):
            local.add(op.index)
            if any(isinstance(a, int) and a in fed for a in op.ins):
                fed.update(op.outs)
    for op in reversed(region):
        if op.index not in local:
            continue
        task = op_tasks[op.index]
        readers = [c for v in op.outs for c in consumers.get(v, ()) if c.index in inside]
        forward_readers = [c for c in readers if not c.backward and c.index not in late]
        if not op.backward and forward_readers:
            readers = forward_readers
        elif readers and not op.backward:
            if any(v in fed for v in op.outs):
                continue  # on the microbatch: in the forward, at its own depth
            late.add(op.index)  # read by the backward pass only: it runs there
        bounds = [level[c.index] - (op_tasks[c.index] != task) for c in readers]
        if bounds:
            level[op.index] = max(level[op.index], min(bounds))
    unread = {
        op.index
        for op in region
        if op.index in local
        and not op.backward
        and not any(c.index in inside for v in op.outs for c in consumers.get(v, ()))
    }
    first: dict[Task, int] = {}
    for op in region:
        if not op.backward and op.index not in unread:
            task = op_tasks[op.index]
            first[task] = min(first.get(task, level[op.index]), level[op.index])
    for op in region:
        if op.index in unread and op_tasks[op.index] in first:
            level[op.index] = first[op_tasks[op.index]]
    return level, late


def _microbatch_values(graph: Graph, region: AbstractSet[int]) -> set[int]:
    """The values ops outside ``region`` (op indices) make from the microbatch index."""
    varying: set[int] = set()
    for op in graph.ops:
        outside = op.index not in region
        if is_index(op) or outside and any(isinstance(a, int) and a in varying for a in op.ins):
            varying.update(op.outs)
    return varying
