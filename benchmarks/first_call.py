"""First call of a pipelined train step (trace, plan, compile, run) against the same step
under ``jax.jit`` on one device, in the same run (ratios only).

A 32-block GPT (dim 64) pipelined over 4 stages of one device each with 1F1B, M = 16, AdamW,
against the plain full-batch step (no microbatching) of the same model under ``nnx.jit`` on
one device. A first call compiles, so each measurement runs in a fresh process (nothing cached);
the two alternate over three rounds, and the ratio of the medians is reported with each round's
own ratio (a single pair of first calls on this machine varied from 1.3x to 1.8x). The
compiled-program count of the pipeline is reported. Target (issue 16): <= 1.5x.

Equal stages compile once (a program equal to one compiled for other devices loads that one's
executable): the same pipeline with every program compiled, and the model on 8 stages both
ways, measure what that saves, in the same rounds.

A restarted run with JAX's persistent compilation cache on (``jax_compilation_cache_dir``, and
``jax_persistent_cache_min_compile_time_secs=0``: by default JAX caches only programs that took
a second or more to compile, and a pipeline's stage programs take less): the 8-stage pipeline
and the one-device step each run in three fresh processes sharing a new cache directory; the
first call of each process, and how many programs XLA compiled during it (programs loaded from
an equal one are written to the cache too, so a restarted process reads them).

Why stage programs compile slower per instruction than the whole step: XLA compiles each
distinct fused kernel once per program, so a program of 32 equal blocks costs little more to
compile than one of 8, and 4 programs of 8 blocks cost nearly 4 times one of 32. Measured on a
stand-alone block (norm, two matmuls, tanh; forward and backward in one program), compile
time and fusion count of one program of 1, 8 and 32 blocks, of 32 blocks whose hidden widths
all differ (as many fusions, none alike), and of 4 programs of 8.

Issue 42's measures (``--only issue42``, 5 interleaved rounds, median [min-max]): first call
of the 16- and 32-block GPT on 4 stages, M = 8, against ``nnx.jit`` on one device; and the plan
of an unrolled 128-block GPT (everything in the first call but compiling) against JAX alone
tracing the plain step (``jax.make_jaxpr``).

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/first_call.py
[--only issue42]
Writes benchmarks/results/first_call.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import publish  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "first_call.json"
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
        from mmnnx._jax.compile import SharedCompiles

        SharedCompiles.compile = lambda self, lowered: lowered.compile()
    if cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compiles = _count_compiles()
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    with nnx.use_eager_sharding(False):
        model = GPT(CONFIG, rngs=nnx.Rngs(0))
    if case == "jax_trace":  # JAX alone tracing the plain step (no compile)
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        graphdef, state = nnx.split((model, opt))

        def pure(state, tokens):
            return plain_step(*nnx.merge(graphdef, state), tokens)

        start = time.perf_counter()
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
    options = {"pack_residuals": False} if case == "pipelined_unpacked" else {}
    step = mm.jit(pipelined_step, **options)
    if case == "plan":  # everything of the first call but compiling and running
        start = time.perf_counter()
        step.plan(model, opt, tokens)
        return {"seconds": time.perf_counter() - start}
    compiles.clear()
    seconds = first_call(step, model, opt, tokens)
    compiled = len(compiles)
    plan = step.plan(model, opt, tokens)
    return {
        "seconds": seconds,
        "programs": plan.num_programs,
        "loaded": plan.num_loaded,
        "compiled": compiled,
    }


def kernel_reuse(width: int = 64, rounds: int = 3) -> dict:
    """Compile seconds (best of ``rounds``, JAX's caches off) and fused kernels of one
    ``value_and_grad`` program over 1, 8 and 32 equal blocks, over 32 blocks of distinct hidden
    widths (no two kernels alike), and of 4 programs of 8."""
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
        best, fusions = float("inf"), 0
        for _ in range(rounds):
            lowered = jax.jit(jax.value_and_grad(blocks, argnums=1)).lower(x, weights)
            start = time.perf_counter()
            compiled = lowered.compile()
            best = min(best, time.perf_counter() - start)
            fusions = compiled.as_text().count(" fusion(")
        return best, fusions

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        out = {}
        for k in (1, 8, 32):
            seconds, fusions = compile_seconds(k)
            out[f"one program of {k} blocks: compile s"] = seconds
            out[f"one program of {k} blocks: fused kernels"] = fusions
        seconds, fusions = compile_seconds(32, distinct=True)
        out["one program of 32 blocks of distinct widths: compile s"] = seconds
        out["one program of 32 blocks of distinct widths: fused kernels"] = fusions
        out["4 programs of 8 blocks: compile s"] = 4 * out["one program of 8 blocks: compile s"]
        out["4 programs of 8 / one program of 32"] = (
            out["4 programs of 8 blocks: compile s"] / out["one program of 32 blocks: compile s"]
        )
        return out
    finally:
        jax.config.update("jax_enable_compilation_cache", was)


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


def restarted_with_a_cache() -> dict:
    """First calls of three processes in turn sharing a new persistent cache directory, for the
    8-stage pipeline and for the one-device step."""
    out = {}
    for case in ("8_stages", "one_device"):
        with tempfile.TemporaryDirectory(prefix="mmnnx-first-call-cache-") as cache_dir:
            runs = [in_fresh_process(case, cache_dir) for _ in range(3)]
        out[f"{case}: first call s, processes 1 / 2 / 3"] = " / ".join(
            f"{r['seconds']:.2f}" for r in runs
        )
        out[f"{case}: programs compiled, processes 1 / 2 / 3"] = " / ".join(
            str(r["compiled"]) for r in runs
        )
    return out


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def interleaved(depth: int, microbatches: int, cases: tuple[str, str], rounds: int) -> dict:
    """``cases[1]`` against ``cases[0]``, each in a fresh process, alternating over ``rounds``
    rounds (A, B, A, B, ...): seconds of each and their ratio, median [min-max]."""
    base, measured = [], []
    for _ in range(rounds):
        base.append(in_fresh_process(cases[0], depth=depth, microbatches=microbatches)["seconds"])
        measured.append(
            in_fresh_process(cases[1], depth=depth, microbatches=microbatches)["seconds"]
        )
    return {
        f"{cases[0]} s": _spread(base),
        f"{cases[1]} s": _spread(measured),
        "ratio": _spread([b / a for a, b in zip(base, measured, strict=True)]),
        "rounds": rounds,
    }


def deep_and_first_calls(rounds: int = 5) -> dict:
    """Issue 42's measures, each in fresh processes over interleaved rounds: the first call of
    the 16- and 32-block GPT on 4 one-device stages, 1F1B, M = 8, against the plain step's under
    ``nnx.jit`` on one device (target <= 1.5x); and an unrolled 128-block GPT's plan (all of the
    first call but compiling and running) against JAX alone tracing the plain step (target
    <= 1.5x)."""
    out = {}
    for depth in (16, 32):
        out[f"first call, {depth} blocks, 4 stages, M = 8 / nnx.jit"] = interleaved(
            depth, 8, ("one_device", "pipelined"), rounds
        )
    out["plan, 128 blocks unrolled, 4 stages, M = 8 / JAX trace"] = interleaved(
        128, 8, ("jax_trace", "plan"), rounds
    )
    out["cores"] = os.cpu_count()
    out["load average before"] = os.getloadavg()[0]
    return out


def main_issue42():
    """Runs :func:`deep_and_first_calls` only, keeping the other sections of the results file."""
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["issue 42: first calls and planning"] = deep_and_first_calls()
    publish(results, RESULTS, "first call", ("issue 42: first calls and planning",))


def main():
    rounds = [{case: in_fresh_process(case) for case in CASES} for _ in range(3)]

    def median(case: str) -> float:
        return statistics.median(r[case]["seconds"] for r in rounds)

    one_s = median("one_device")

    def compiled_once(case: str) -> dict:
        """What loading equal programs saves: ``case`` against the same with every one compiled."""
        return {
            "programs": rounds[0][case]["programs"],
            "programs loaded from an equal one": rounds[0][case]["loaded"],
            "every program compiled: first call s": median(f"{case}_unshared"),
            "every program compiled: ratio": median(f"{case}_unshared") / one_s,
        }

    results = {
        "gpt32_4stages_m16": {
            "pipelined_first_call_s": median("pipelined"),
            "one_device_jit_first_call_s": one_s,
            "ratio": median("pipelined") / one_s,
            "ratio per round": ", ".join(
                f"{r['pipelined']['seconds'] / r['one_device']['seconds']:.2f}" for r in rounds
            ),
            "pipelined_nothing_packed_first_call_s": median("pipelined_unpacked"),
            "ratio with nothing packed": median("pipelined_unpacked") / one_s,
            **compiled_once("pipelined"),
            "target": "ratio <= 1.5",
        },
        "gpt32_8stages_m16": {
            "pipelined_first_call_s": median("8_stages"),
            "ratio": median("8_stages") / one_s,
            **compiled_once("8_stages"),
            "speed-up of loading equal programs": median("8_stages_unshared") / median("8_stages"),
        },
        "restarted with a persistent cache": restarted_with_a_cache(),
        "kernels compiled once per program": kernel_reuse(),
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
    publish(results, RESULTS, "first call", sections)


if __name__ == "__main__":
    if "--case" in sys.argv:
        cache_dir = None
        if "--cache-dir" in sys.argv:
            cache_dir = sys.argv[sys.argv.index("--cache-dir") + 1]
        print(json.dumps(measure(sys.argv[sys.argv.index("--case") + 1], cache_dir)))
    elif "--only" in sys.argv and "issue42" in sys.argv:
        main_issue42()
    else:
        main()
