"""Dispatch overhead of mm.jit, measured against baselines in the same run (ratios only).

1. One-task step, a model of 50 nnx.Linear layers: mm.jit vs graph-mode nnx.jit vs jax.jit over
   (graphdef, state). Target: mm.jit <= 1.1x jax.jit, and faster than nnx.jit. Measured both
   ways: mm.jit walking the Module and Optimizer on every call, and mm.cached_partial (the walk
   done once, like nnx.cached_partial; the jax.jit baseline likewise holds its state pre-split).
2. Two-task step (a 2-stage MLP): mm.jit vs a hand-written loop over pre-compiled per-stage
   jax.jit executables with device_put between them. Target: <= 1.2x.
3. Pipelined GPT (dim 64, 8 blocks, 1F1B, AdamW) for stages x microbatches x devices per task:
   the host thread's own CPU time per step (``time.thread_time``: dispatch, transfers and
   bookkeeping, not the XLA worker threads; XLA:CPU runs a program of under 1000 flops, a zero
   fill, on the calling thread) per launched program, called as ``mm.jit`` (which walks the
   Module and Optimizer each call) and as ``mm.cached_partial`` (as ``mmnnx.train.fit`` calls
   it: the walk done once), and the step's wall time against the same model's data-parallel
   ``nnx.jit`` step over all 8 devices. Each configuration runs in a process of its own.
   Target (issue 16): <= 0.1 ms per launch, flat in parameter count; S = 4, M = 16 within 1.3x
   of data parallel. Measured with ``mm.jit``'s default packing (a forward's residuals of at
   most ``mm.PACK_RESIDUAL_BYTES`` returned as one buffer: all of this GPT's), with nothing
   packed (``pack_residuals=False``), and once with ``recompute_residuals=False`` (every
   residual returned, none recomputed); and the same GPT with its blocks stacked and scanned
   (``scan_layers=True``, the stack split over the stages) at 8, 16 and 32 blocks. Programs
   are launched directly once a checked call has found their arguments laid out as they expect
   (``DirectLaunch``); three cases run every program through JAX's checked call instead. A
   block's small weights travel as one buffer (``mm.jit(pack_weights=...)``); two cases pass
   each weight alone. ``pipelined_floor`` measures issue 54's two cases (S = 4, M = 16, 1 and 2
   devices per task) beside the same with the GPT shrunk to ``TINY``, whose programs barely
   compute: what the host's own work per launch costs when the devices' work no longer shares
   its 2 cores.

4. Host time per pipelined launch apart from the step's once-per-step cost: the slope of the
   host time per step between M = 4 and M = 32 (S = 4, one device per task, as
   ``mm.cached_partial``) at 8, 16 and 32 blocks, unrolled and stacked, and at 8 blocks on four
   times the batch (the devices' work per launch alone grows). What a step costs once
   (the optimizer's update returns every parameter as an array of its own, as any step does)
   grows with the parameter count; the target is that what grows with S x M does not.

6. The 4-stage (and 2-stage) pipeline against data parallelism over all 8 devices, interleaved
   fresh-process rounds, with XLA:CPU's defaults and with its Eigen
   thread pool off, separating what 2 shared cores impose from what the pipeline costs
   (``pipeline_vs_data_parallel``).

5. JAX's own cost per argument of a compiled call (a program summing 10 or 50 one-device
   arrays), with the devices idle and while two other devices compute, and per result (a
   program making 10 or 50 arrays): the floor under "host time per launch" above.

Every number is the median [min-max] over ``--rounds N`` rounds (default 5) in which the
candidates of a section take turns (A, B, A, B, ...), a ratio or slope taken per round: per-call
times average 200 (50 for two tasks) calls in each round; each pipelined configuration, and
each first call (``mm.jit compile s``), runs in a fresh process per round.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/dispatch.py
[--only SECTION ...] [--rounds N] (sections: call_cost one_task two_task pipelined
pipelined_targets pipelined_floor per_pipelined_launch pipeline_vs_data_parallel;
``pipelined_targets``: the two S4 M16 cases of ``pipelined`` that issue 54 sets targets for,
with the data-parallel step; ``pipelined_floor``: those two, and again with a GPT too small to
load the devices, which leaves the host's own time per launch).
Writes benchmarks/results/dispatch.json (with --only, replaces those sections in it).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    only_sections,
    per_call,
    ratio_spread,
    results_path,
    rounds_option,
    run_sections,
    spread,
)

import mmnnx as mm  # noqa: E402

RESULTS = results_path("dispatch.json")


def per_call_samples(fns, steps: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each ``fns[name]()`` (which returns something to block on), averaged
    over ``steps`` calls, in ``rounds`` interleaved rounds (each one warmed up first)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    candidates = {name: per_call(fn, steps, jax.block_until_ready) for name, fn in fns.items()}
    return interleaved(candidates, rounds)


class Deep(nnx.Module):
    def __init__(self, depth, width, rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    opt.update(model, grads)
    return loss


def _one_task_mm():
    """The 50-layer model on one task, its optimizer, a batch and its ``mm.jit`` step."""
    task = mm.Task("solo", mesh=mm.TaskMesh(devices=[0]))
    model = mm.place(Deep(50, 32, nnx.Rngs(0)), [(".*", task)])
    opt = nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)
    return mm.jit(step), model, opt, jnp.ones((8, 32))


def one_task(rounds: int):
    x = jnp.ones((8, 32))

    def build():
        model = Deep(50, 32, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(1e-3), wrt=nnx.Param)

    nnx_model, nnx_opt = build()
    nnx_step = nnx.jit(step)

    model, opt = build()
    graphdef, state = nnx.split((model, opt))

    @jax.jit
    def pure(state, x):
        m, o = nnx.merge(graphdef, state)
        loss = step(m, o, x)
        return loss, nnx.state((m, o))

    holder = {"state": state}

    def run_pure():
        loss, holder["state"] = pure(holder["state"], x)
        return loss

    mm_step, model, opt, x = _one_task_mm()
    jax.block_until_ready(mm_step(model, opt, x))
    bound = mm.cached_partial(mm_step, model, opt)
    times = per_call_samples(
        {
            "jax": run_pure,
            "nnx": lambda: nnx_step(nnx_model, nnx_opt, x),
            "mm": lambda: mm_step(model, opt, x),
            "bound": lambda: bound(x),
        },
        steps=200,
        rounds=rounds,
    )
    t_jax, t_nnx, t_mm, t_bound = times["jax"], times["nnx"], times["mm"], times["bound"]
    programs = mm_step.plan(model, opt, x).num_programs
    compile_s = interleaved({"first": lambda: first_call_in_fresh_process("one_task")}, rounds)
    return {
        "jax.jit(graphdef, state) us": spread(t_jax, 1e6, 1),
        "nnx.jit us": spread(t_nnx, 1e6, 1),
        "mm.jit us": spread(t_mm, 1e6, 1),
        "mm.cached_partial us": spread(t_bound, 1e6, 1),
        "mm.jit / jax.jit": ratio_spread(t_mm, t_jax),
        "mm.cached_partial / jax.jit": ratio_spread(t_bound, t_jax),
        "mm.jit / nnx.jit": ratio_spread(t_mm, t_nnx),
        "mm.jit compile s (first call, fresh process)": spread(compile_s["first"]),
        "mm.jit programs": programs,
    }


def _two_task_setup():
    """The 2-stage MLP: the hand-written loop's step, and the ``mm.jit`` step with its model,
    optimizer and batch."""
    width, batch = 256, 64
    mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    s0 = mm.Task("s0", mesh=mesh.task_mesh(stage=0))
    s1 = mm.Task("s1", mesh=mesh.task_mesh(stage=1))
    x = jnp.ones((batch, width))
    lr = 1e-3

    def stage(params, h):
        for w in params:
            h = jnp.tanh(h @ w)
        return h

    keys = jax.random.split(jax.random.key(0), 4)
    weights = [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]

    # hand-written floor: pre-compiled per-stage programs, device_put in between
    rep0, rep1 = s0.sharding(), s1.sharding()
    p0 = jax.device_put(weights[:2], rep0)
    p1 = jax.device_put(weights[2:], rep1)
    fwd0 = jax.jit(lambda p, x: jax.vjp(lambda p: stage(p, x), p))

    @jax.jit
    def fwd_bwd1(p, h):
        loss, vjp = jax.vjp(lambda p, h: jnp.mean(stage(p, h) ** 2), p, h)
        gp, gh = vjp(jnp.ones_like(loss))
        return loss, [w - lr * g for w, g in zip(p, gp, strict=True)], gh

    bwd0 = jax.jit(lambda vjp, p, ct: [w - lr * g for w, g in zip(p, vjp(ct)[0], strict=True)])
    xs = jax.device_put(x, rep0)
    state = {"p0": p0, "p1": p1}

    def manual():
        h, vjp = fwd0(state["p0"], xs)
        loss, state["p1"], gh = fwd_bwd1(state["p1"], jax.device_put(h, rep1))
        state["p0"] = bwd0(vjp, state["p0"], jax.device_put(gh, rep0))
        return loss

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.List([nnx.Param(w) for w in weights])

        def __call__(self, h):
            return stage([w[...] for w in self.w], h)

    model = mm.place(Model(), [("w/[01]", s0), ("w/[23]", s1)])
    opt = nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)
    return manual, mm.jit(step), model, opt, x


def _two_task_mm():
    return _two_task_setup()[1:]


def two_task(rounds: int):
    manual, mm_step, model, opt, x = _two_task_setup()
    times = per_call_samples(
        {"manual": manual, "mm": lambda: mm_step(model, opt, x)}, steps=50, rounds=rounds
    )
    plan = mm_step.plan(model, opt, x)
    compile_s = interleaved({"first": lambda: first_call_in_fresh_process("two_task")}, rounds)
    return {
        "hand-written loop us": spread(times["manual"], 1e6, 1),
        "mm.jit us": spread(times["mm"], 1e6, 1),
        "mm.jit / hand-written": ratio_spread(times["mm"], times["manual"]),
        "mm.jit compile s (first call, fresh process)": spread(compile_s["first"]),
        "mm.jit programs": plan.num_programs,
    }


FIRST_CALLS = {"one_task": _one_task_mm, "two_task": _two_task_mm}


def first_call(name: str) -> float:
    """Seconds of the first call of ``FIRST_CALLS[name]``'s ``mm.jit`` step (trace, plan, compile,
    run), in this (fresh) process."""
    mm_step, *args = FIRST_CALLS[name]()
    start = time.perf_counter()
    jax.block_until_ready(mm_step(*args))
    return time.perf_counter() - start


def first_call_in_fresh_process(name: str) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--first-call", name], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


CONFIG = {"vocab_size": 256, "dim": 64, "depth": 8, "num_heads": 4, "max_seq_len": 32}
BATCH = 32
# (stages, microbatches, devices per task, blocks, residuals packed (None: mm.jit's default),
# residuals recomputed, blocks stacked and scanned)
PIPELINES = [
    (2, 8, 1, 8, None, True, False),
    (4, 8, 1, 8, None, True, False),
    (4, 16, 1, 8, None, True, False),
    (4, 16, 1, 8, None, False, False),
    (4, 16, 1, 8, False, True, False),
    (4, 16, 2, 8, None, True, False),
    (4, 16, 1, 16, None, True, False),
    (4, 16, 1, 16, False, True, False),
    (4, 16, 1, 8, None, True, True),
    (4, 16, 1, 16, None, True, True),
    (4, 16, 1, 32, None, True, True),
    (4, 16, 1, 8, None, True, False, False),
    (4, 16, 1, 16, None, True, False, False),
    (4, 16, 2, 8, None, True, False, False),
    (4, 16, 1, 8, None, True, False, True, False),
    (4, 16, 1, 16, None, True, False, True, False),
]


def _gpt(depth=8, scan_layers=False):
    from mmnnx.models import GPT, GPTConfig  # noqa: PLC0415

    config = GPTConfig(**{**CONFIG, "depth": depth, "scan_layers": scan_layers})
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


def _tokens():
    return jax.random.randint(
        jax.random.key(0), (BATCH, CONFIG["max_seq_len"] + 1), 0, CONFIG["vocab_size"]
    )


def _host_and_wall(fn, steps=20):
    """Median host-thread CPU seconds and wall seconds of one ``fn()`` step."""
    jax.block_until_ready(fn())
    cpu, wall = [], []
    for _ in range(steps):
        c, t = time.thread_time(), time.perf_counter()
        jax.block_until_ready(fn())
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(cpu), statistics.median(wall)


def pipeline_case(
    stages, m, per_task, depth, packed, recompute, scanned, direct=True, weights=True
):
    """One pipelined configuration, measured in this (fresh) process. ``direct=False``: every
    program goes through JAX's checked call, as before ``DirectLaunch``; ``weights=False``:
    ``mm.jit(pack_weights=False)``, each weight passed alone."""
    from mmnnx.models import stage_rules  # noqa: PLC0415

    if not direct:
        from mmnnx._jax.launch import DirectLaunch  # noqa: PLC0415

        DirectLaunch.of = classmethod(lambda cls, compiled: None)

    tasks = [
        mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(i * per_task, (i + 1) * per_task)))
        for i in range(stages)
    ]
    model = _gpt(depth, scanned)
    model = mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    tokens = _tokens()

    packing = {} if packed is None else {"pack_residuals": packed}
    packing |= {} if weights else {"pack_weights": False}

    @functools.partial(mm.jit, recompute_residuals=recompute, **packing)
    def train(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda g, t: g.loss(t)), num=m, reduce="mean", schedule="1f1b"
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    cpu, wall = _host_and_wall(lambda: train(model, opt, tokens))
    bound = mm.cached_partial(train, model, opt)
    bound_cpu, _ = _host_and_wall(lambda: bound(tokens))
    program = train.plan(model, opt, tokens).program
    launches = sum(type(a).__name__ in ("Run", "Zeros") for a in program.actions)
    return {"launches": launches, "cpu": cpu, "bound_cpu": bound_cpu, "wall": wall}


def data_parallel_case():
    """The same GPT's data-parallel ``nnx.jit`` step over all 8 devices, in this process."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    model = _gpt()
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    sharded = jax.device_put(
        _tokens(), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )

    @nnx.jit
    def data_parallel(model, opt, tokens):
        loss, grads = nnx.value_and_grad(lambda g, t: g.loss(t))(model, tokens)
        opt.update(model, grads)
        return loss

    _, wall = _host_and_wall(lambda: data_parallel(model, opt, sharded))
    return {"wall": wall}


def in_fresh_process(
    case, batch: int = BATCH, xla_flags: str = "", config: dict | None = None
) -> dict:
    """Runs ``pipeline_case(*case)`` (or, for ``None``, the data-parallel step) on a batch of
    ``batch`` sequences in a new process (with ``xla_flags`` added to ``XLA_FLAGS``, and the
    GPT's ``CONFIG`` updated by ``config``): a process that has built and run other pipelines
    measured 5-10% more host time per launch (their buffers and programs still alive), so each
    configuration gets its own."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--case",
            json.dumps(case),
            "--batch",
            str(batch),
            "--config",
            json.dumps(config or {}),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pipeline_label(case) -> str:
    stages, m, per_task, depth, packed, recompute, scanned, *direct_weights = case
    direct = direct_weights[:1]
    weights = direct_weights[1:]
    key = f"S{stages} M{m} {per_task} device(s) per task" + (
        f", {depth} blocks" if depth != 8 or scanned else ""
    )
    key += " stacked (scan_layers)" if scanned else ""
    key += ", nothing packed" if packed is False else ""
    key += "" if recompute else ", every residual kept"
    key += ", every program through JAX's checked call" if direct == [False] else ""
    key += ", weights not packed" if weights == [False] else ""
    return key


ISSUE_54 = [c for c in PIPELINES if c[:2] == (4, 16) and c[3:] == (8, None, True, False)]


def _per_launch(runs: dict[str, list[dict]]) -> dict:
    """Each configuration's launches, host time per launch (``mm.jit``'s call and
    ``mm.cached_partial``'s) and step time, over its rounds in ``runs``."""
    out = {}
    for key, got in runs.items():
        out[f"{key}: launches"] = got[0]["launches"]
        out[f"{key}: host ms per launch"] = spread([r["cpu"] / r["launches"] for r in got], 1e3, 3)
        out[f"{key}: host ms per launch, mm.cached_partial"] = spread(
            [r["bound_cpu"] / r["launches"] for r in got], 1e3, 3
        )
        out[f"{key}: step ms"] = spread([r["wall"] for r in got], 1e3, 1)
    return out


TINY = {"vocab_size": 16, "dim": 8, "num_heads": 2, "max_seq_len": 4}
"""The GPT of ``CONFIG`` shrunk until its programs barely compute (on a batch of 16: one row a
microbatch at M = 16): the same blocks, stages, programs, launches and copies."""


def pipelined_floor(rounds: int) -> dict:
    """Issue 54's two cases (``pipelined_targets``) as measured there and with the GPT shrunk
    to :data:`TINY`, taking turns in fresh processes: the host's own time per launch once the
    devices' work is nearly gone from the 2 cores the host shares with them (as a host beside
    an accelerator, whose devices compute in their own memory, would see it)."""
    candidates = {}
    for case in ISSUE_54:
        label = _pipeline_label(case)
        candidates[label] = functools.partial(in_fresh_process, list(case))
        candidates[f"{label}, tiny GPT"] = functools.partial(
            in_fresh_process, list(case), batch=16, config=TINY
        )
    return _per_launch(interleaved(candidates, rounds))


def pipelined_host_time(rounds: int, cases: list[tuple] = PIPELINES):
    """Every configuration of ``cases`` and the data-parallel step, each in a fresh process,
    all of them once per round over ``rounds`` rounds."""
    candidates = {_pipeline_label(case): functools.partial(in_fresh_process, list(case))
                  for case in cases}  # fmt: skip
    candidates["data parallel"] = functools.partial(in_fresh_process, None)
    runs = interleaved(candidates, rounds)
    out = _per_launch({key: got for key, got in runs.items() if key != "data parallel"})
    dp_walls = [r["wall"] for r in runs["data parallel"]]
    out["data-parallel nnx.jit over 8 devices: step ms"] = spread(dp_walls, 1e3, 1)
    out["S4 M16 1 device per task / data parallel"] = ratio_spread(
        [r["wall"] for r in runs["S4 M16 1 device(s) per task"]], dp_walls
    )
    return out


def pipeline_vs_data_parallel(rounds: int) -> dict:
    """The pipelined GPT (1F1B, M = 16, one device per stage) on 4 and on 2 stages against the
    data-parallel ``nnx.jit`` step over all 8 devices, each in a fresh process, alternating
    over ``rounds`` rounds (DP, S4, S2, DP, ...), with XLA:CPU's defaults and with its Eigen
    thread pool off (``--xla_cpu_multi_thread_eigen=false``: each device's kernels on one
    thread). On 2 cores, with Eigen's threads a large kernel of one device takes every core,
    which the data-parallel step's 8 devices share anyway and a pipeline's idle stages leave
    free; without them each device computes on its own thread, as an accelerator would. What
    the ratio keeps without them is the pipeline's own cost (bubble, transfers, launches)."""
    out: dict = {}
    for label, flags in (
        ("defaults", ""),
        ("Eigen threads off", "--xla_cpu_multi_thread_eigen=false"),
    ):
        cases = {"dp": None, "s4": [4, 16, 1, 8, None, True, False],
                 "s2": [2, 16, 1, 8, None, True, False]}  # fmt: skip
        runs = interleaved(
            {k: functools.partial(in_fresh_process, c, xla_flags=flags) for k, c in cases.items()},
            rounds,
        )
        walls = {k: [r["wall"] for r in got] for k, got in runs.items()}
        out[f"{label}: data parallel step ms"] = spread(walls["dp"], 1e3)
        for stages in ("s4", "s2"):
            out[f"{label}: S{stages[1]} M16 step / data parallel"] = ratio_spread(
                walls[stages], walls["dp"]
            )
    return out


DEPTHS = (8, 16, 32)
MICROBATCHES = (4, 32)


def host_time_per_pipelined_launch(rounds: int):
    """The host time a pipelined launch (a microbatch's forward or backward) costs, apart from
    what a step costs once whatever its microbatches (the update programs, which return every
    parameter as an array of its own, handing the values back to the model): the slope of the
    host time per step (as ``mm.cached_partial``) between M = 4 and M = 32, S = 4, one device
    per task, at 8, 16 and 32 blocks, unrolled and stacked, each in a fresh process, over
    ``rounds`` alternating rounds: the slope taken per round, then its median [min-max]. On this
    machine the host thread's time per launch grows with
    the devices' load (stacked layers take the same arguments at every depth and still cost more
    per launch when deeper), so the measure of the parameter count alone is unrolled against
    stacked at the same depth; and the load alone, 8 blocks on four times the batch (the same
    parameters and arguments)."""
    cases = [(depth, scanned, BATCH) for scanned in (False, True) for depth in DEPTHS]
    cases.append((DEPTHS[0], False, 4 * BATCH))
    runs = interleaved(  # alternating, so a slow spell of this machine hits every case
        {
            (depth, scanned, batch, m): functools.partial(
                in_fresh_process, [4, m, 1, depth, None, True, scanned], batch
            )
            for depth, scanned, batch in cases
            for m in MICROBATCHES
        },
        rounds,
    )
    out, slopes = {}, {}
    for case in cases:
        few_runs, many_runs = (runs[(*case, m)] for m in MICROBATCHES)
        few, many = few_runs[0]["launches"], many_runs[0]["launches"]
        per_round = list(zip(few_runs, many_runs, strict=True))
        slope = slopes[case] = [(b["bound_cpu"] - a["bound_cpu"]) / (many - few)
                                for a, b in per_round]  # fmt: skip
        depth, scanned, batch = case
        label = f"{depth} blocks" + (" stacked (scan_layers)" if scanned else "")
        label += f", batch {batch}" if batch != BATCH else ""
        out[f"{label}: host ms per pipelined launch"] = spread(slope, 1e3, 3)
        out[f"{label}: host ms per step besides them"] = spread(
            [a["bound_cpu"] - s * few for (a, _), s in zip(per_round, slope, strict=True)], 1e3
        )
    for scanned in (False, True):
        kind = "stacked" if scanned else "unrolled"
        for depth in DEPTHS[1:]:
            out[f"{kind}: {depth} / {DEPTHS[0]} blocks, per pipelined launch"] = ratio_spread(
                slopes[depth, scanned, BATCH], slopes[DEPTHS[0], scanned, BATCH]
            )
    for depth in DEPTHS:  # the same compute, parameters held one array per layer or stacked
        out[f"{depth} blocks: unrolled / stacked, per pipelined launch"] = ratio_spread(
            slopes[depth, False, BATCH], slopes[depth, True, BATCH]
        )
    # the same parameters and arguments, four times the devices' work per launch
    out[f"{DEPTHS[0]} blocks: batch {4 * BATCH} / {BATCH}, per pipelined launch"] = ratio_spread(
        slopes[DEPTHS[0], False, 4 * BATCH], slopes[DEPTHS[0], False, BATCH]
    )
    return out


def call_cost(rounds: int, small=(10, 50), calls=200):
    """Host CPU time per call of a compiled program (a sum of one-device arrays of 64 floats)
    at two argument counts, with every device idle and while two other devices run long
    programs (as a pipeline's other stages do). The slope between the two counts is JAX's cost
    per argument; the second measure is that cost when dispatch shares this machine's cores
    with the stages' compute. Then the same for a program of one argument and 10 or 50
    results: JAX's cost per result."""
    devices = jax.devices()
    low, high = small
    x = jax.device_put(jnp.ones(64), devices[0])
    programs = {}
    for n in small:
        args = [jax.device_put(jnp.full((64,), float(i)), devices[0]) for i in range(n)]
        programs["arguments", n] = (jax.jit(lambda *xs: sum(xs)).lower(*args).compile(), args)
        many = jax.jit(lambda x, n=n: [x * i for i in range(n)]).lower(x).compile()
        programs["results", n] = (many, [x])  # each result is a new jax.Array
    weights = [jax.device_put(jnp.full((256, 256), 1e-3), d) for d in devices[1:3]]
    long_program = jax.jit(lambda w: functools.reduce(lambda h, _: jnp.tanh(h @ w), range(40), w))

    def host_us(key, busy):
        """One round: host microseconds per call of ``programs[key]``, mean of ``calls``."""
        compiled, args = programs[key]
        pending = [long_program(w) for _ in range(10) for w in weights] if busy else []
        start = time.thread_time()
        outs = [compiled(*args) for _ in range(calls)]
        seconds = (time.thread_time() - start) / calls
        jax.block_until_ready((outs, pending))
        return seconds * 1e6

    cases = [("idle", "arguments", n) for n in small]
    cases += [("two devices busy", "arguments", n) for n in small]
    cases += [("idle", "results", n) for n in small]
    for _, kind, n in cases:
        compiled, args = programs[kind, n]
        jax.block_until_ready(compiled(*args))
    jax.block_until_ready([long_program(w) for w in weights])
    us = interleaved(
        {case: functools.partial(host_us, case[1:], case[0] != "idle") for case in cases}, rounds
    )

    def slope(label, kind):
        per_round = zip(us[label, kind, high], us[label, kind, low], strict=True)
        return spread([(b - a) / (high - low) for b, a in per_round])

    out = {}
    for label in ("idle", "two devices busy"):
        for n in small:
            out[f"{label}: host us per call, {n} arguments"] = spread(us[label, "arguments", n])
        out[f"{label}: host us per argument"] = slope(label, "arguments")
    for n in small:
        out[f"idle: host us per call, 1 argument, {n} results"] = spread(us["idle", "results", n])
    out["idle: host us per result"] = slope("idle", "results")
    return out


SECTIONS = {
    "call_cost": call_cost,
    "one_task": one_task,
    "two_task": two_task,
    "pipelined": pipelined_host_time,
    # issue 54's two cases alone (S4 M16, 1 and 2 devices per task): minutes, not the half hour
    "pipelined_targets": functools.partial(pipelined_host_time, cases=ISSUE_54),
    "pipelined_floor": pipelined_floor,
    "per_pipelined_launch": host_time_per_pipelined_launch,
    "pipeline_vs_data_parallel": pipeline_vs_data_parallel,
}


def main(only: list[str] | None, rounds: int):
    """Runs every section, or those in ``only`` (their results replace theirs in the file)."""
    run_sections(SECTIONS, RESULTS, "dispatch", only, str(jax.devices()[0]), rounds)


if __name__ == "__main__":
    if "--first-call" in sys.argv:
        print(json.dumps(first_call(sys.argv[sys.argv.index("--first-call") + 1])))
    elif "--case" in sys.argv:
        case = json.loads(sys.argv[sys.argv.index("--case") + 1])
        BATCH = int(sys.argv[sys.argv.index("--batch") + 1])
        CONFIG.update(json.loads(sys.argv[sys.argv.index("--config") + 1]))
        print(json.dumps(data_parallel_case() if case is None else pipeline_case(*case)))
    else:
        main(only_sections(sys.argv), rounds_option(sys.argv))
