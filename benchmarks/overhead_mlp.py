"""Issue 54 item 5's benchmark model and the readings of its timelines, shared by
``pipeline_overhead.py`` (both stages in one process) and ``overhead_processes.py`` (a process
per stage): an MLP of 8 parts (two ``nnx.Linear(256, 256)`` each, ``tanh`` after each), a batch
of 8 x 64 rows, M = 8, pipelined over 2 one-device stages (4 parts each).

Importing it starts nothing (no device is touched): a process joining a multi-process run
imports it before ``mm.distributed.initialize``.
"""

import statistics

import jax
import jax.numpy as jnp
from flax import nnx

import mmnnx as mm

PARTS, WIDTH, ROWS, M, S = 8, 256, 64, 8, 2
WAITS = {
    "busy": "busy",
    "inputs": "waiting for inputs",
    "transfers": "waiting for a transfer",
    "host": "waiting for host",
}
"""What :func:`waits` returns per rank, and how a results file names it."""


class Part(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.b = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.b(jnp.tanh(self.a(x))))


class MLP(nnx.Module):
    def __init__(self):
        self.parts = nnx.List([Part(nnx.Rngs(i)) for i in range(PARTS)])

    def __call__(self, x):
        for part in self.parts:
            x = part(x)
        return x


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def batch() -> jax.Array:
    """The benchmark's batch: M x ROWS rows of WIDTH, on this process's default device."""
    return jax.random.normal(jax.random.key(2), (M * ROWS, WIDTH))


def placement(schedule: str) -> tuple[list, int]:
    """Rules placing the parts: 4 per rank, or for ZB-V in a V (stages 0, 1 going down on
    ranks 0, 1, stages 2, 3 coming back up as their second virtual stages); the virtual
    stages per rank."""
    tasks = [mm.Task(f"s{r}", mesh=mm.TaskMesh(devices=[r])) for r in range(S)]
    if schedule == "zero-bubble-v":
        order = [tasks[0], tasks[1], tasks[1].virtual_stage(1), tasks[0].virtual_stage(1)]
    else:
        order = tasks
    per = PARTS // len(order)
    return [(f"^parts/{p}/", order[p // per]) for p in range(PARTS)], len(order) // S


def pipelined(schedule: str, x: jax.Array):
    """The ``mm.jit`` step of ``schedule`` (the loss and the gradients) and its placed model,
    compiled and run once on ``x``."""
    rules, virtual = placement(schedule)
    model = mm.place(MLP(), rules)
    grads = mm.microbatch(
        nnx.value_and_grad(loss_fn),
        num=M,
        reduce="mean",
        schedule=schedule,
        virtual_stages=virtual,
    )
    step = mm.jit(grads)
    jax.block_until_ready(step(model, x))
    return step, model


def stage_time(events) -> float:
    """A stage's forward + backward timed one action at a time: the slower stage's median F
    plus median B over its microbatches, from one ``timeline``'s events."""
    per: dict = {}
    for e in events:
        per.setdefault((e.rank, e.kind), []).append(e.end - e.start)
    return max(
        statistics.median(per[(rank, "F")]) + statistics.median(per[(rank, "B")])
        for rank in {rank for rank, kind in per if kind == "F"}
    )


def waits(events) -> dict[str, dict[str, float]]:
    """Per rank of an overlapped timeline: seconds of its actions (``busy``), and of the gaps
    before them, each split into waiting for the other rank to make an input (``inputs``:
    until the transfer bringing it could leave), for that transfer to arrive (``transfers``)
    and for the host to launch the program (``host``: what is left, the program launched
    after the rank went idle)."""
    actions = [e for e in events if e.kind != mm.schedules.TRANSFER]
    arrivals: dict[str, list] = {}
    for e in events:
        if e.kind == mm.schedules.TRANSFER:
            arrivals.setdefault(e.rank, []).append(e)
    out: dict[str, dict[str, float]] = {}
    by_rank: dict[str, list] = {}
    for e in sorted(actions, key=lambda e: (e.start, e.end)):
        by_rank.setdefault(e.rank, []).append(e)
    for rank, evs in by_rank.items():
        total = {"busy": 0.0, "inputs": 0.0, "transfers": 0.0, "host": 0.0}
        previous = 0.0
        seen = set()
        for e in evs:
            if (e.start, e.end) in seen:  # the other action of a fused pair
                continue
            seen.add((e.start, e.end))
            gap = max(0.0, e.start - previous)
            landed = [t for t in arrivals.get(rank, ()) if previous < t.end <= e.start + 1e-6]
            if gap and landed:
                last = max(landed, key=lambda t: t.end)
                made = min(gap, max(0.0, last.start - previous))
                moving = min(gap - made, max(0.0, last.end - max(previous, last.start)))
                total["inputs"] += made
                total["transfers"] += moving
                total["host"] += gap - made - moving
            elif gap:
                launching = min(gap, max(0.0, e.launched - previous))
                total["host"] += launching
                total["inputs"] += gap - launching
            total["busy"] += e.end - e.start
            previous = max(previous, e.end)
        out[rank] = total
    return out
