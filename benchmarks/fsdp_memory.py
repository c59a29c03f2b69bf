"""FSDP inside each stage (``mm.fsdp_rules``, ``mmnnx train --fsdp-axis N``): per-device bytes of
parameters + AdamW state, the collectives each stage's programs run, and the step time, for
N = 1, 2, 4 on the reference GPT of benchmarks/memory.py (dim 256, 8 blocks) over 2 stages x a
data axis of 4 (8 simulated CPU devices; the fsdp axis carved out of the data axis).

Targets: the device holding the most parameter + optimizer bytes holds 1/N of what it holds with
N = 1 (bytes read from the arrays' own shards); the gradients' running sums take 1/N too (each
laid out as its parameter: the accumulators' own shard shapes); each stage's forward program
all-gathers each sharded weight it reads, once per microbatch (what GSPMD compiles; counted in the
HLO), unless ``mm.jit(gather_weights="fsdp")`` ("once" below) gathers it once per step, on its
task, before the first microbatch (counted: the step's moves within a task; the gathered copies'
bytes per device held through the step).
Step times: median [min-max] of interleaved rounds (A, B, C, A, B, C, ...), and each round's
ratio to N = 1; on CPU devices a collective is a memory copy, so this bounds the gathers' host
cost, not a network's.

Run: python benchmarks/fsdp_memory.py [--rounds N]  (writes benchmarks/results/fsdp_memory.json)
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import math  # noqa: E402
import re  # noqa: E402
from collections import Counter  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from memory import CONFIG, bytes_per_device  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    per_call,
    publish,
    ratio_spread,
    results_path,
    rounds_option,
    spread,  # noqa: E402
)

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT  # noqa: E402
from mmnnx.mpmd.lower.program import PackWeights, Zeros  # noqa: E402
from mmnnx.mpmd.run.emit import Launch, Move  # noqa: E402
from mmnnx.train.generation import run_tasks  # noqa: E402
from mmnnx.train.run_model import fsdp_placement, run_placement  # noqa: E402

RESULTS = results_path("fsdp_memory.json")
SIZES = (1, 2, 4)
RUNS = ((1, None), (2, None), (2, "fsdp"), (4, None), (4, "fsdp"))  # (N, gather_weights)
MICROBATCHES = 4
COLLECTIVE = re.compile(
    r"\b(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\("
)  # anywhere in an instruction: one with a tuple type (a combined all-reduce) has spaces


def _step(model, opt, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)),
        num=MICROBATCHES,
        reduce="mean",
        schedule="1f1b",
    )
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


def built(fsdp: int, gather: str | None = None):
    """The model, its AdamW optimizer and a jitted pipelined step with an fsdp axis of ``fsdp``,
    gathering the weights over ``gather`` once per step (``None``: in each program)."""
    tasks = run_tasks(2, 4, 1, fsdp_axis=fsdp)
    model = mm.init(
        lambda: GPT(CONFIG, rngs=nnx.Rngs(0)), fsdp_placement(run_placement(CONFIG, tasks))
    )
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mm.jit(_step, gather_weights=gather) if gather else mm.jit(_step)
    return model, opt, step


def _shard_bytes(shape, dtype, sharding) -> int:
    return math.prod(sharding.shard_shape(shape)) * jax.numpy.dtype(dtype).itemsize


def held_bytes(step) -> tuple[int, int, int]:
    """Per device, the largest over tasks: the bytes of the gradients' running sums (their
    shards), and of the weights gathered once per step; and the number of those gathers."""
    (executable, _), *_ = step._cache.values()
    sums: Counter = Counter()
    for action in executable.plan.program.actions:
        made = action.zeros if isinstance(action, PackWeights) else action
        if isinstance(made, Zeros):
            for shape, dtype, s in zip(made.shapes, made.dtypes, made.shardings, strict=True):
                sums[made.task.name] += _shard_bytes(shape, dtype, s)
    gathered: Counter = Counter()  # task's devices -> bytes each holds
    moves = 0
    graph = executable.graph
    for s in executable._steps:
        layout = getattr(s, "source_layout", None)
        if not isinstance(s, Move) or layout is None:
            continue
        devices = frozenset(s.sharding.device_set)
        if layout.device_set == devices:  # within a task: a gather
            v = _moved_value(executable, s)
            gathered[devices] += _shard_bytes(graph.shapes[v], graph.dtypes[v], s.sharding)
            moves += 1
    return max(sums.values(), default=0), max(gathered.values(), default=0), moves


def _moved_value(executable, move) -> int:
    """The value a move carries: the Recv writing its slot."""
    for action in executable.plan.program.actions:
        if getattr(action, "slot", None) == move.target and hasattr(action, "value"):
            return action.value
    raise LookupError(move.target)


def collectives(step) -> dict[str, dict[str, int]]:
    """Per stage and pass (F, B on microbatch 0; the update after the last): the collectives of
    its program, by kind."""
    (executable, _), *_ = step._cache.values()
    out: dict[str, dict[str, int]] = {}
    for s in executable._steps:
        if not (isinstance(s, Launch) and s.labels):
            continue
        (label, microbatch), *_ = s.labels
        if label is None:
            name = f"{s.rank} update"
        elif microbatch == 0:
            name = f"{label[0]} {label[1]}, one microbatch"
        else:
            continue
        out[name] = dict(Counter(COLLECTIVE.findall(s.program.as_text())))
    return dict(sorted(out.items()))


def _name(n: int, gather: str | None) -> str:
    return f"N = {n}" + (", once" if gather else "")


def main(argv: list[str]) -> None:
    rounds = rounds_option(argv)
    tokens = jax.random.randint(jax.random.key(0), (16, CONFIG.max_seq_len + 1), 0, 256)
    memory, gathers, steps, largest, losses = {}, {}, {}, {}, {}
    for n, gather in RUNS:
        name = _name(n, gather)
        model, opt, step = built(n, gather)
        per_device = bytes_per_device(nnx.state(model), nnx.state(opt))
        losses[name] = [float(step(model, opt, tokens)) for _ in range(2)]  # compiles
        sharded = sum("fsdp" in str(spec) for _, spec in mm.placement(model).values())
        largest[n] = max(per_device.values())
        sums, held, moved = held_bytes(step)
        memory[f"{name}: largest device, parameters + AdamW"] = f"{largest[n]:,} B"
        memory[f"{name}: / N = 1 (target 1/{n})"] = round(largest[n] / largest[1], 4)
        memory[f"{name}: Variables sharded over fsdp"] = sharded
        memory[f"{name}: largest device, gradient sums"] = f"{sums:,} B"
        memory[f"{name}: largest device, weights gathered once, held through the step"] = (
            f"{held:,} B ({moved} gathers a step)"
        )
        for program, kinds in collectives(step).items():
            counted = ", ".join(f"{k} {c}" for k, c in sorted(kinds.items())) or "none"
            gathers[f"{name}: {program}"] = counted
        steps[name] = per_call(lambda m=model, o=opt, s=step: s(m, o, tokens), calls=2,
                               wait=jax.block_until_ready)  # fmt: skip
    first = losses[_name(1, None)]
    memory["losses of 2 steps equal N = 1's (largest difference)"] = max(
        abs(a - b) for got in losses.values() for a, b in zip(got, first, strict=True)
    )
    samples = interleaved(steps, rounds)
    timing = {}
    base = samples[_name(1, None)]
    for name, got in samples.items():
        timing[f"{name}: seconds per step"] = spread(got, digits=3)
        timing[f"{name}: / N = 1"] = ratio_spread(got, base)
    results = {
        "config": {k: getattr(CONFIG, k) for k in ("vocab_size", "dim", "depth", "num_heads")},
        "layout": "2 stages x data axis 4 (data 4/N x fsdp N), model axis 1; 1F1B, M = 4",
        "bytes": memory,
        "collectives": gathers,
        "step time": timing,
    }
    sections = ("bytes", "collectives", "step time")
    publish(results, RESULTS, "FSDP inside each stage", sections, rounds)


if __name__ == "__main__":
    main(sys.argv[1:])
