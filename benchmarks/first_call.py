"""First call of a pipelined train step (trace, plan, compile, run) against the same step
under ``jax.jit`` on one device, in the same run (ratios only).

A 32-block GPT (dim 64) pipelined over 4 stages of one device each with 1F1B, M = 16, AdamW,
against the plain full-batch step (no microbatching) of the same model under ``nnx.jit`` on
one device. A first call compiles, so each measurement runs in a fresh process (nothing cached);
every case runs once per round, the cases taking turns, over ``--rounds N`` rounds (default 5),
and each time and each ratio (taken per round) is reported as the median [min-max] over the
rounds (a single pair of first calls on this machine varied from 1.3x to 1.8x). The
compiled-program count of the pipeline is reported. Target (issue 16): <= 1.5x.

Equal stages compile once (a program equal to one compiled for other devices loads that one's
executable): the same pipeline with every program compiled, and the model on 8 stages both
ways, measure what that saves, in the same rounds.

A restarted run with JAX's persistent compilation cache on (``jax_compilation_cache_dir``, and
``jax_persistent_cache_min_compile_time_secs=0``: by default JAX caches only programs that took
a second or more to compile, and a pipeline's stage programs take less): the 8-stage pipeline
and the one-device step each run in three fresh processes sharing a new cache directory, the two
taking turns, a new directory each round; the first call of each process (median [min-max] over
the rounds), and how many programs XLA compiled during it (programs loaded from an equal one are
written to the cache too, so a restarted process reads them).

Why stage programs compile slower per instruction than the whole step: XLA compiles each
distinct fused kernel once per program, so a program of 32 equal blocks costs little more to
compile than one of 8, and 4 programs of 8 blocks cost nearly 4 times one of 32. Measured on a
stand-alone block (norm, two matmuls, tanh; forward and backward in one program), compile
time and fusion count of one program of 1, 8 and 32 blocks, of 32 blocks whose hidden widths
all differ (as many fusions, none alike), and of 4 programs of 8 (JAX's caches off: each program
compiled once per round, the programs taking turns).

Issue 42's measures (``--only issue42``, fresh processes, interleaved rounds, median
[min-max]): first call of the 16- and 32-block GPT on 4 stages, M = 8, against ``nnx.jit`` on
one device; and the plan of an unrolled 128-block GPT (everything in the first call but
compiling) against JAX alone tracing the plain step (``jax.make_jaxpr``), as a user would run it
and with Python's garbage collector paused, as ``mm.jit`` pauses it while it plans.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/first_call.py
[--only issue42] [--rounds N]
Writes benchmarks/results/first_call.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import contextlib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    publish,
    ratio_spread,
    results_path,
    rounds_option,
    spread,
)

import mmnnx as mm  # noqa: E402
from mmnnx._gc import cyclic_gc_paused  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = results_path("first_call.json")
DEPTH = int(os.environ.get("FIRST_CALL_DEPTH", "32"))
CONFIG = GPTConfig(vocab_size=256, dim=64, depth=DEPTH, num_heads=4, max_seq_len=32)
STAGES, M, BATCH = 4, int(os.environ.get("FIRST_CALL_MICROBATCHES", "16")), 32


def pipelined_step(model, opt, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=M, reduce="mean", schedule="1f1b"
    )
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


def plain_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
    opt.update(model, grads)
    return loss


def first_call(step, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


CASES = ("one_device", "pipelined", "pipelined_unpacked", "pipelined_unshared",
         "8_stages", "8_stages_unshared")  # fmt: skip


def _count_compiles() -> list:
    """Counts XLA compiles from now on in this process (one entry each)."""
    from jax._src import compiler

    compiles, compile = [], compiler.backend_compile_and_load

    def counted(*args, **kwargs):
        compiles.append(1)
        return compile(*args, **kwargs)

    compiler.backend_compile_and_load = counted
    return compiles


def measure(case: str, cache_dir: str | None = None) -> dict:
    """One first call, in this (fresh) process: ``case`` is "pipelined" (``mm.jit``'s default:
    the residuals of at most ``mm.PACK_RESIDUAL_BYTES`` packed, here all of them),
    "pipelined_unpacked" (``mm.jit(pack_residuals=False)``), "pipelined_unshared" (every
    program compiled, none loaded from an equal one), "8_stages" and "8_stages_unshared" (the
    same on 8 stages), or "one_device"."""
    if case.endswith("unshared"):
        from mmnnx._jax import compile as shared_compiles

        shared_compiles._Program.of = classmethod(lambda cls, lowered: None)
    if cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compiles = _count_compiles()
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    with nnx.use_eager_sharding(False):
        model = GPT(CONFIG, rngs=nnx.Rngs(0))
    if case.startswith("jax_trace"):  # JAX alone tracing the plain step (no compile)
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))

        def pure(state, tokens):
            return plain_step(*nnx.merge(graphdef, state), tokens)

        paused = case == "jax_trace_gc_paused"  # as mm.jit pauses the collector while it plans
        start = time.perf_counter()
        with cyclic_gc_paused() if paused else contextlib.nullcontext():
            jax.make_jaxpr(pure)(state, tokens)
        return {"seconds": time.perf_counter() - start}
    if case == "one_device":
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        compiles.clear()
        seconds = first_call(nnx.jit(plain_step), model, opt, tokens)
        return {"seconds": seconds, "compiled": len(compiles)}
    stages = 8 if case.startswith("8_stages") else STAGES
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(stages)]
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    options = {
        "pipelined_unpacked": {"pack_residuals": False},
        "pipelined_no_cores": {"share_cores": False},
    }.get(case, {})
    step = mm.jit(pipelined_step, **options)
    if case == "plan":  # everything of the first call but compiling and running
        start = time.perf_counter()
        step.plan(model, opt, tokens)
        return {"seconds": time.perf_counter() - start}
    compiles.clear()
    seconds = first_call(step, model, opt, tokens)
    compiled = len(compiles)
    plan = step.compile(model, opt, tokens)
    return {
        "seconds": seconds,
        "programs": plan.num_programs,
        "loaded": plan.num_loaded,
        "lowered": plan.num_lowered,
        "compiled": compiled,
        "step s": steady_step(step, model, opt, tokens),
    }


def steady_step(step, *args, warmup: int = 3, steps: int = 15) -> float:
    """The median wall time of one step after ``warmup`` steps, each step waited for."""
    for _ in range(warmup):
        jax.block_until_ready(step(*args))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def kernel_reuse(rounds: int, width: int = 64) -> dict:
    """Compile seconds (JAX's caches off; every program compiled once per round, the programs
    taking turns; median [min-max] over ``rounds`` rounds) and fused kernels of one
    ``value_and_grad`` program over 1, 8 and 32 equal blocks, over 32 blocks of distinct hidden
    widths (no two kernels alike), and of 4 programs of 8 (4 times one of 8, per round)."""
    import jax.numpy as jnp  # noqa: PLC0415

    def block(x, w1, w2, g):
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * g
        return x + jnp.tanh(h @ w1) @ w2

    def blocks(x, weights):
        for w in weights:
            x = block(x, *w)
        return x.sum()

    def compile_seconds(k: int, distinct: bool = False) -> tuple[float, int]:
        x = jnp.ones((32, width))
        hidden = [4 * width + (8 * i if distinct else 0) for i in range(k)]
        weights = [
            (jnp.full((width, h), i + 1.0), jnp.ones((h, width)), jnp.ones(width))
            for i, h in enumerate(hidden)
        ]
        lowered = jax.jit(jax.value_and_grad(blocks, argnums=1)).lower(x, weights)
        start = time.perf_counter()
        compiled = lowered.compile()
        return time.perf_counter() - start, compiled.as_text().count(" fusion(")

    programs = {f"one program of {k} blocks": (k, False) for k in (1, 8, 32)}
    programs["one program of 32 blocks of distinct widths"] = (32, True)
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        runs = interleaved(
            {name: functools.partial(compile_seconds, *args) for name, args in programs.items()},
            rounds,
        )
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
    seconds = {name: [s for s, _ in got] for name, got in runs.items()}
    out = {}
    for name, got in runs.items():
        out[f"{name}: compile s"] = spread(seconds[name])
        out[f"{name}: fused kernels"] = got[0][1]
    four_of_8 = [4 * s for s in seconds["one program of 8 blocks"]]
    out["4 programs of 8 blocks: compile s"] = spread(four_of_8)
    out["4 programs of 8 / one program of 32"] = ratio_spread(
        four_of_8, seconds["one program of 32 blocks"]
    )
    return out


def in_fresh_process(
    case: str, cache_dir: str | None = None, depth: int = 32, microbatches: int = 16
) -> dict:
    cache = ["--cache-dir", cache_dir] if cache_dir is not None else []
    env = dict(os.environ, FIRST_CALL_DEPTH=str(depth), FIRST_CALL_MICROBATCHES=str(microbatches))
    out = subprocess.run(
        [sys.executable, __file__, "--case", case, *cache],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def three_processes_sharing_a_cache(case: str) -> list[dict]:
    """First calls of three processes in turn sharing a new persistent cache directory."""
    with tempfile.TemporaryDirectory(prefix="mmnnx-first-call-cache-") as cache_dir:
        return [in_fresh_process(case, cache_dir) for _ in range(3)]


def restarted_with_a_cache(rounds: int) -> dict:
    """First calls of three processes in turn sharing a new persistent cache directory, for the
    8-stage pipeline and for the one-device step, the two taking turns over ``rounds`` rounds
    (a new directory each): each process's first call, median [min-max]."""
    cases = ("8_stages", "one_device")
    runs = interleaved(
        {case: functools.partial(three_processes_sharing_a_cache, case) for case in cases}, rounds
    )
    out = {}
    for case in cases:
        for i in range(3):
            out[f"{case}: first call s, process {i + 1}"] = spread(
                [r[i]["seconds"] for r in runs[case]]
            )
        out[f"{case}: programs compiled, processes 1 / 2 / 3 (first round)"] = " / ".join(
            str(r["compiled"]) for r in runs[case][0]
        )
    return out


def first_calls_against(depth: int, microbatches: int, cases: tuple[str, ...], rounds: int) -> dict:
    """Each of ``cases[1:]`` against ``cases[0]``, each in a fresh process, taking turns over
    ``rounds`` rounds (A, B, C, A, B, C, ...): seconds of each and their ratios to the first,
    median [min-max]; with "pipelined_no_cores" (``mm.jit(share_cores=False)``) among them, the
    ratio of "pipelined" to it, first call and steady step time (median of 15 steps after 3)."""
    runs = interleaved(
        {
            case: functools.partial(in_fresh_process, case, depth=depth, microbatches=microbatches)
            for case in cases
        },
        rounds,
    )
    seconds = {case: [r["seconds"] for r in runs[case]] for case in cases}
    out = {f"{case} s": spread(seconds[case]) for case in cases}
    for case in cases[1:]:
        key = "ratio" if case == "pipelined" else f"ratio {case}"
        out[key] = ratio_spread(seconds[case], seconds[cases[0]])
    if {"pipelined", "pipelined_no_cores"} <= set(cases):
        on, off = runs["pipelined"], runs["pipelined_no_cores"]
        out["first call, share_cores on / off"] = ratio_spread(
            seconds["pipelined"], seconds["pipelined_no_cores"]
        )
        out["step s, share_cores on / off"] = ratio_spread(
            [r["step s"] for r in on], [r["step s"] for r in off]
        )
        out["step s, share_cores on"] = spread([r["step s"] for r in on])
        out["step s, share_cores off"] = spread([r["step s"] for r in off])
        for case in ("pipelined", "pipelined_no_cores"):
            first = runs[case][0]
            counts = (first[k] for k in ("programs", "lowered", "loaded", "compiled"))
            out[f"{case}: programs / lowered / loaded / compiled"] = " / ".join(map(str, counts))
    out["rounds"] = rounds
    return out


def deep_and_first_calls(rounds: int) -> dict:
    """Issue 42's measures, each in fresh processes over interleaved rounds: the first call of
    the 16- and 32-block GPT on 4 one-device stages, 1F1B, M = 8, against the plain step's under
    ``nnx.jit`` on one device (target <= 1.5x); and an unrolled 128-block GPT's plan (all of the
    first call but compiling and running) against JAX alone tracing the plain step (target
    <= 1.5x)."""
    out = {}
    for depth in (16, 32):
        out[f"first call, {depth} blocks, 4 stages, M = 8 / nnx.jit"] = first_calls_against(
            depth, 8, ("one_device", "pipelined", "pipelined_no_cores"), rounds
        )
    out["plan, 128 blocks unrolled, 4 stages, M = 8 / JAX trace"] = plan_against_jax(rounds)
    return out


def plan_against_jax(rounds: int) -> dict:
    """The 128-block plan against JAX alone tracing the plain step as a user would (Python's
    garbage collector on: the target's baseline), and against the same trace with the collector
    paused, as ``mm.jit`` pauses it while it plans (like for like); the three in fresh
    processes, taking turns over ``rounds`` rounds."""
    cases = ("jax_trace", "jax_trace_gc_paused", "plan")
    runs = interleaved(
        {c: functools.partial(in_fresh_process, c, depth=128, microbatches=8) for c in cases},
        rounds,
    )
    jax_s, paused_s, plan_s = ([r["seconds"] for r in runs[c]] for c in cases)
    return {
        "jax_trace s": spread(jax_s),
        "jax_trace with the collector paused s": spread(paused_s),
        "plan s": spread(plan_s),
        "ratio": ratio_spread(plan_s, jax_s),
        "ratio to JAX's trace with the collector paused": ratio_spread(plan_s, paused_s),
        "rounds": rounds,
    }


def main_issue42(rounds: int):
    """Runs :func:`deep_and_first_calls` only, keeping the other sections of the results file."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["issue 42: first calls and planning"] = deep_and_first_calls(rounds)
    publish(results, RESULTS, "first call", ("issue 42: first calls and planning",), rounds)


def main(rounds: int):
    runs = interleaved({case: functools.partial(in_fresh_process, case) for case in CASES}, rounds)

    def seconds(case: str) -> list[float]:
        return [r["seconds"] for r in runs[case]]

    one_s = seconds("one_device")

    def compiled_once(case: str) -> dict:
        """What loading equal programs saves: ``case`` against the same with every one compiled."""
        return {
            "programs": runs[case][0]["programs"],
            "programs loaded from an equal one": runs[case][0]["loaded"],
            "every program compiled: first call s": spread(seconds(f"{case}_unshared")),
            "every program compiled: ratio": ratio_spread(seconds(f"{case}_unshared"), one_s),
        }

    results = {
        "gpt32_4stages_m16": {
            "pipelined_first_call_s": spread(seconds("pipelined")),
            "one_device_jit_first_call_s": spread(one_s),
            "ratio": ratio_spread(seconds("pipelined"), one_s),
            "pipelined_nothing_packed_first_call_s": spread(seconds("pipelined_unpacked")),
            "ratio with nothing packed": ratio_spread(seconds("pipelined_unpacked"), one_s),
            **compiled_once("pipelined"),
            "target": "ratio <= 1.5",
        },
        "gpt32_8stages_m16": {
            "pipelined_first_call_s": spread(seconds("8_stages")),
            "ratio": ratio_spread(seconds("8_stages"), one_s),
            **compiled_once("8_stages"),
            "speed-up of loading equal programs": ratio_spread(
                seconds("8_stages_unshared"), seconds("8_stages")
            ),
        },
        "restarted with a persistent cache": restarted_with_a_cache(rounds),
        "kernels compiled once per program": kernel_reuse(rounds),
        "device": str(jax.devices()[0]),
    }
    kept = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if "issue 42: first calls and planning" in kept:  # measured by --only issue42
        results["issue 42: first calls and planning"] = kept["issue 42: first calls and planning"]
    sections = (
        "gpt32_4stages_m16",
        "gpt32_8stages_m16",
        "restarted with a persistent cache",
        "kernels compiled once per program",
    )
    kept_runs = kept.get("measured", {})
    if "issue 42: first calls and planning" in kept_runs:
        results["measured"] = {
            "issue 42: first calls and planning": kept_runs["issue 42: first calls and planning"]
        }
    publish(results, RESULTS, "first call", sections, rounds)


if __name__ == "__main__":
    if "--case" in sys.argv:
        cache_dir = None
        if "--cache-dir" in sys.argv:
            cache_dir = sys.argv[sys.argv.index("--cache-dir") + 1]
        print(json.dumps(measure(sys.argv[sys.argv.index("--case") + 1], cache_dir)))
    elif "--only" in sys.argv and "issue42" in sys.argv:
        main_issue42(rounds_option(sys.argv))
    else:
        main(rounds_option(sys.argv))
