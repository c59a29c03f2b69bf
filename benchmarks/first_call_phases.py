"""Where a first call's time goes: the 16-block GPT (dim 64) on 4 one-device stages, 1F1B,
M = 8, AdamW (``first_call.py``'s issue-42 case), phase by phase, against the plain step under
``nnx.jit`` on one device.

Each case runs in a fresh process (nothing cached), the cases taking turns over ``--rounds N``
rounds (default 5); every number is the median [min-max] over the rounds. ``--before DIR``
adds the pipelined step of another checkout (mmnnx imported from ``DIR``) to the same rounds.

Pipelined phases (``mm.jit``, in the order a first call runs them): trace (``trace_step``), plan
(``plan_step``: colour, cut, pipeline, lower to the typed program, passes), build (``emit``:
every program traced and lowered to StableHLO on this thread, handed to the compile threads as
it is lowered), compile wait (what is left of the compiles once the last program is lowered),
run (the step itself, until its results are ready). Programs lowered and compiled are counted,
the small ones (zero-filled running sums, weight packing) apart; "lowering s" and "XLA compile
s" sum each program's own time (compiles run on threads, side by side, so their sum can exceed
the wall time they take). The ``nnx.jit`` step: its first call, and the XLA compile inside it.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/first_call_phases.py
[--rounds N] [--before DIR]
Writes benchmarks/results/first_call_phases.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import interleaved, publish, ratio_spread, results_path, rounds_option, spread  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = results_path("first_call_phases.json")
DEPTH = int(os.environ.get("FIRST_CALL_DEPTH", "16"))  # blocks (FIRST_CALL_DEPTH=32: 32)
CONFIG = GPTConfig(vocab_size=256, dim=64, depth=DEPTH, num_heads=4, max_seq_len=32)
STAGES, M, BATCH = 4, 8, 32
SMALL = ("zeros", "pack")  # the names of the small programs' functions (run/programs.py)


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


class _Tally:
    """Seconds and counts per kind, added from any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}
        self.count: dict[str, int] = {}

    def add(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds
            self.count[kind] = self.count.get(kind, 0) + 1


def _timed(tally: _Tally, kind, fn):
    """``fn`` adding its seconds to ``tally`` under ``kind`` (or ``kind(*args)``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            tally.add(kind(*args) if callable(kind) else kind, time.perf_counter() - start)

    return wrapper


def _count_xla_compiles(tally: _Tally) -> None:
    from jax._src import compiler
    from jax._src.interpreters import mlir

    def kind(backend, module, *rest):
        name = mlir.ir.StringAttr(module.operation.attributes["sym_name"]).value
        small = any(name == f"jit_{s}" for s in SMALL)
        return "compile small" if small else "compile"

    compiler.backend_compile_and_load = _timed(tally, kind, compiler.backend_compile_and_load)


def measure(case: str) -> dict:
    tally = _Tally()
    _count_xla_compiles(tally)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    with nnx.use_eager_sharding(False):
        model = GPT(CONFIG, rngs=nnx.Rngs(0))
    if case == "one_device":
        opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        tally.__init__()
        start = time.perf_counter()
        jax.block_until_ready(nnx.jit(plain_step)(model, opt, tokens))
        return {
            "first call s": time.perf_counter() - start,
            "XLA compile s": tally.seconds.get("compile", 0.0),
            "compiled": tally.count.get("compile", 0),
        }
    from mmnnx.mpmd import engine as engine_module
    from mmnnx.mpmd.run import emit as emit_module
    from mmnnx.mpmd.run import runner as runner_module

    engine_module.trace_step = _timed(tally, "trace", engine_module.trace_step)
    engine_module.plan_step = _timed(tally, "plan", engine_module.plan_step)
    runner_module.emit = _timed(tally, "build", runner_module.emit)
    from mmnnx.mpmd.run import programs as programs_module

    for name, kind in (
        ("lower_fragments", "lower"),
        ("lower_zeros", "lower small"),
        ("lower_packing", "lower small"),
    ):  # emit calls its own imported copies, or the compiler calls those of programs
        for module in (emit_module, programs_module):
            if hasattr(module, name):
                setattr(module, name, _timed(tally, kind, getattr(module, name)))
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(STAGES)]
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mm.jit(pipelined_step)
    tally.__init__()
    start = time.perf_counter()
    step.plan(model, opt, tokens)
    planned = time.perf_counter()
    plan = step.compile(model, opt, tokens)
    compiled = time.perf_counter()
    jax.block_until_ready(step(model, opt, tokens))
    ran = time.perf_counter()
    s, n = tally.seconds, tally.count
    return {
        "first call s": ran - start,
        "trace s": s["trace"],
        "plan s": s["plan"],
        "other s (trace and plan)": planned - start - s["trace"] - s["plan"],
        "build s": s["build"],
        "compile wait s": compiled - planned - s["build"],
        "run s": ran - compiled,
        "lowering s": s.get("lower", 0.0),
        "lowering s, small programs": s.get("lower small", 0.0),
        "XLA compile s": s.get("compile", 0.0),
        "XLA compile s, small programs": s.get("compile small", 0.0),
        "programs lowered": n.get("lower", 0),
        "small programs lowered": n.get("lower small", 0),
        "programs compiled": n.get("compile", 0),
        "small programs compiled": n.get("compile small", 0),
        "programs loaded from an equal one": plan.num_loaded,
        "programs": plan.num_programs,
    }


def in_fresh_process(case: str, source: str | None = None) -> dict:
    """``case`` measured in a fresh process, importing mmnnx from ``source`` (a checkout's
    root) when given."""
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = source
    out = subprocess.run(
        [sys.executable, __file__, "--case", case],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _pipelined_rows(runs: list[dict], one_s: list[float]) -> dict:
    out = {"ratio": ratio_spread([r["first call s"] for r in runs], one_s)}
    for key, value in runs[0].items():
        out[key] = spread([r[key] for r in runs]) if key.endswith(" s") else value
    return out


def main(rounds: int, before: str | None) -> None:
    """The cases in turn over ``rounds`` rounds; with ``before`` (another checkout's root), the
    pipelined step of that checkout too, in the same rounds."""
    cases = {"one_device": functools.partial(in_fresh_process, "one_device")}
    if before is not None:
        cases["pipelined, before"] = functools.partial(in_fresh_process, "pipelined", before)
    cases["pipelined"] = functools.partial(in_fresh_process, "pipelined")
    runs = interleaved(cases, rounds)
    one = runs["one_device"]
    one_s = [r["first call s"] for r in one]
    sections = {
        "nnx.jit": {
            "first call s": spread(one_s),
            "XLA compile s": spread([r["XLA compile s"] for r in one]),
            "programs compiled": one[0]["compiled"],
        }
    }
    for name in cases:
        if name != "one_device":
            sections[f"mm.jit, {name}"] = _pipelined_rows(runs[name], one_s)
    if before is not None:
        sections["mm.jit, after / before"] = {
            "first call": ratio_spread(
                [r["first call s"] for r in runs["pipelined"]],
                [r["first call s"] for r in runs["pipelined, before"]],
            ),
            "before": before,
        }
    results = {**sections, "blocks": DEPTH, "rounds": rounds, "device": str(jax.devices()[0])}
    publish(results, RESULTS, "first call phases", tuple(sections), rounds)


if __name__ == "__main__":
    if "--case" in sys.argv:
        print(json.dumps(measure(sys.argv[sys.argv.index("--case") + 1])))
    else:
        before = sys.argv[sys.argv.index("--before") + 1] if "--before" in sys.argv else None
        main(rounds_option(sys.argv), before)
