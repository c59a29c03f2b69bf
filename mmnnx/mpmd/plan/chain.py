"""A pipeline's stage chain in words, for its messages: the tasks its forward pass visits, and what
brings it back to a task it ran on before (the Variable an op there reads, else the op)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Op
from mmnnx.mpmd.op_kinds import is_view
from mmnnx.sharding import Task

_NAMED = 3  # returns named in a message (the first ones and the last); the others counted


def read_variable(op: Op, producer: Mapping[int, Op], names: Mapping[int, str]) -> str | None:
    """The name of a step input ``op`` reads, directly or through views of it, if any."""
    stack = [a for a in op.ins if isinstance(a, int)]
    seen: set[int] = set()
    while stack:
        v = stack.pop(0)
        if v in names:
            return names[v]
        p = producer.get(v)
        if p is not None and is_view(p) and v not in seen:
            seen.add(v)
            stack += [a for a in p.ins if isinstance(a, int)]
    return None


def culprit(ops: Sequence[Op], producer: Mapping[int, Op], names: Mapping[int, str]) -> str:
    """What ``ops`` run there for: the first Variable they read (and the op reading it), else their
    first op, with its source line."""
    for op in ops:
        name = read_variable(op, producer, names)
        if name is not None:
            return f"{name!r} (read by `{op.name}` at {op.source})"
    return f"`{ops[0].name}` at {ops[0].source}"


def describe(
    stage_tasks: Sequence[Task],
    stage_ops: Sequence[Sequence[Op]],
    producer: Mapping[int, Op],
    names: Mapping[int, str],
) -> str:
    """The stage chain in words, with the :func:`culprit` of each return to a task."""
    chain = " -> ".join(t.name for t in stage_tasks)
    returns = [
        f"stage {s} comes back to {task.name} for {culprit(stage_ops[s], producer, names)}"
        for s, task in enumerate(stage_tasks)
        if task in stage_tasks[:s] and stage_ops[s]
    ]
    if not returns:
        return f"the forward pass runs on {chain}"
    if len(returns) > _NAMED:  # the first ones and the last, which ends the pass
        between = len(returns) - _NAMED
        returns = [*returns[: _NAMED - 1], f"{between} more", returns[-1]]
    return f"the forward pass runs on {chain}: {'; '.join(returns)}"


def not_a_chain(
    depth: int,
    ops_at: Mapping[Task, Sequence[Op]],
    again: Sequence[Task],
    producer: Mapping[int, Op],
    names: Mapping[int, str],
) -> MPMDError:
    """The error for a forward pass that runs on several tasks at one ``depth``."""
    tasks = ", ".join(sorted(t.name for t in ops_at)) or "no task"
    hint = (
        f" (the forward pass visits {', '.join(sorted(t.name for t in again))} more than once; "
        "a task whose Variables it reads at two points, such as an output head tied to the "
        "embedding, pipelines in the V placement, mm.stage_rules(..., virtual_stages=2, "
        "order='v'), or with one stage per task)"
        if again
        else ""
    )
    each = "; ".join(
        f"on {t.name}: {culprit(ops_at[t], producer, names)}"
        for t in sorted(ops_at, key=lambda t: t.name)
    )
    where = f" ({each}; place the Variables these read on one task)" if len(ops_at) > 1 else ""
    return MPMDError(
        "mm.jit: mm.microbatch pipelines need the stages to form a chain, but the forward "
        f"pass at depth {depth} runs on {tasks}{hint}{where}"
    )
