"""Absolute numbers on one GPU: the reference GPT's step under ``nnx.jit`` and ``mm.jit``, the
same model as virtual stages of the one GPU, the host time per pipelined launch, and first calls.

Run by ``benchmarks/gpu.sh`` on a lent GPU machine (``--small``: a tiny model, for a dry run on
any machine). bf16 compute, float32 parameters and AdamW state. Every timing is taken in
interleaved rounds (``--rounds N``, default 5), reported as median [min-max]; ratios per round.

- ``peak``: the card's bf16 matmul throughput, measured here (8192 x 8192 x 8192), which MFU
  divides by;
- ``reference``: the GPT (dim 1024, 16 blocks, 16 heads, sequence 2048, vocabulary 32768), with
  the largest batch of 2^k sequences whose step ``mm.predict_memory`` puts under 85% of the
  card's memory (the prediction, and the peak the card measured after the first variant's
  first call, are both written), under ``nnx.jit``, ``mm.jit`` on one task, and ``mm.jit``
  microbatched (M = 8) on one stage, on 2 and 4 virtual stages of the one GPU (interleaved 1F1B)
  and on 2 in a V (ZB-V). One GPU has no second device to overlap with: a pipelined row is what
  microbatching and cutting the model into stages cost there, not a pipeline's speed. MFU: the
  cost model's counted FLOPs (``model_flops_per_token``) over the step time and the peak;
- first calls (tracing, compiling and the first step) of each variant, one each, in the order
  ``mm.jit`` one task, ``nnx.jit``, then the pipelined ones, after ``host`` warmed the GPU;
- ``--first-calls SECONDS``: instead of the above, ``mm.jit`` on one task against ``nnx.jit``,
  each first call in a fresh process (the GPU, model and batch ready first), taking turns for
  ``--rounds`` rounds or until SECONDS have passed;
- ``host``: a small GPT (host-bound) on 4 virtual stages, interleaved 1F1B, M = 16: host CPU
  seconds per call of ``mm.jit`` and ``mm.cached_partial`` over the programs launched, against
  one ``nnx.jit`` call of the same model.

Writes ``--out`` (default benchmarks/results/gpu.json) after each section.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from importlib.metadata import version  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import interleaved, per_call, ratio_spread, results_path, spread  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402
from mmnnx.partition.cost import model_flops_per_token  # noqa: E402

REFERENCE = dict(vocab_size=32768, dim=1024, depth=16, num_heads=16, max_seq_len=2048)
HOST = dict(vocab_size=256, dim=128, depth=8, num_heads=4, max_seq_len=64)
SMALL = dict(vocab_size=256, dim=64, depth=4, num_heads=4, max_seq_len=32)
PRECISION = dict(dtype="bfloat16", param_dtype="float32")
MICROBATCHES = 8

VARIANTS = {
    # name: (microbatch schedule, virtual stages, stage order); None: not microbatched
    "mm.jit one task": None,
    "nnx.jit": None,
    "mm.jit 1 stage, 1F1B M=8": ("1f1b", 1, "loop"),
    "mm.jit 2 virtual stages, interleaved 1F1B M=8": ("interleaved-1f1b", 2, "loop"),
    "mm.jit 2 virtual stages in a V, ZB-V M=8": ("zero-bubble-v", 2, "v"),
    "mm.jit 4 virtual stages, interleaved 1F1B M=8": ("interleaved-1f1b", 4, "loop"),
}


def _config(sizes: dict) -> GPTConfig:
    return GPTConfig(**sizes, **PRECISION)


def _model(config: GPTConfig) -> GPT:
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


def _grad(model, tokens):
    return nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)


def _step(name: str, schedule, microbatches: int):
    """The train step of variant ``name``: ``nnx.jit`` or ``mm.jit`` of value_and_grad (through
    ``mm.microbatch`` when ``schedule`` is given) and an AdamW update."""

    def step(model, opt, tokens):
        if schedule is None:
            loss, grads = _grad(model, tokens)
        else:
            kind, stages, _ = schedule
            loss, grads = mm.microbatch(
                _grad, num=microbatches, reduce="mean", schedule=kind, virtual_stages=stages
            )(model, tokens)
        opt.update(model, grads)
        return loss

    return nnx.jit(step) if name == "nnx.jit" else mm.jit(step)


def _setup(name: str, schedule, config: GPTConfig, microbatches: int):
    """The model (placed on the one GPU's task, cut into stages where ``schedule`` says), its
    optimizer and step."""
    model = _model(config)
    if name != "nnx.jit":
        task = mm.Task("gpu", mesh=mm.TaskMesh(devices=[0]))
        _, stages, order = schedule or (None, 1, "loop")
        rules = (
            [(".*", task)]
            if schedule is None
            else stage_rules(model, [task], virtual_stages=stages, order=order, report=False)
        )
        model = mm.place(model, rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    return model, opt, _step(name, schedule, microbatches)


def _tokens(config: GPTConfig, batch: int) -> jax.Array:
    return jax.random.randint(
        jax.random.key(1), (batch, config.max_seq_len + 1), 0, config.vocab_size
    )


def _first_call(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def peak_matmul(rounds: int, n: int) -> dict:
    """The card's bf16 matmul FLOP/s on an ``n`` x ``n`` x ``n`` product."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, b))
    timed = per_call(lambda: matmul(a, b), calls=20, wait=jax.block_until_ready)
    flops = [2 * n**3 / s for s in interleaved({"matmul": timed}, rounds)["matmul"]]
    peak = statistics.median(flops)
    return {"shape": [n, n, n], "TFLOP/s": spread(flops, 1e-12, 1), "_flops": peak}


def _capacity() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def _measured_peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def choose_batch(
    config: GPTConfig, capacity: int | None, largest: int, given: int | None = None
) -> tuple[int, dict]:
    """The largest batch of 2^k sequences (at most ``largest``) whose predicted peak for the
    one-task step fits in 85% of ``capacity`` less the other variants' parameters and state."""
    batch = 1
    for b in (2**k for k in range(0, largest.bit_length())):
        got = mm.predict_memory(config, mm.MemoryLayout(), batch=b)
        held = got.worst.parameters + got.worst.optimizer
        if capacity is not None and got.peak + held * (len(VARIANTS) - 1) > 0.85 * capacity:
            break
        batch = b
    batch = given or max(batch, MICROBATCHES)
    predicted = mm.predict_memory(config, mm.MemoryLayout(), batch=batch)
    return batch, {"batch": batch, "predicted peak bytes (one task, M=1)": predicted.peak}


def reference(rounds: int, sizes: dict, peak_flops: float, largest_batch: int, write,
              batch: int | None = None) -> dict:  # fmt: skip
    """The reference GPT's variants: first calls, then step times in interleaved rounds;
    ``write(out)`` after each first call (a run cut short keeps what it measured)."""
    config = _config(sizes)
    batch, out = choose_batch(config, _capacity(), largest_batch, batch)
    tokens = _tokens(config, batch)
    out |= {"config": sizes | PRECISION, "capacity bytes": _capacity(), "first call s": {}}
    steps, failed = {}, {}
    for name, schedule in VARIANTS.items():
        try:
            model, opt, step = _setup(name, schedule, config, MICROBATCHES)
            call = functools.partial(step, model, opt)
            out["first call s"][name] = round(_first_call(functools.partial(call, tokens)), 2)
        except Exception as error:  # a variant that does not fit is reported, not fatal
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            continue
        if name == "mm.jit one task":
            out["measured peak bytes after its first call"] = _measured_peak()
        steps[name] = functools.partial(call, tokens)
        write(out)
    out["failed"] = failed
    samples = interleaved(
        {k: per_call(f, calls=3, wait=jax.block_until_ready) for k, f in steps.items()}, rounds
    )
    flops = model_flops_per_token(config, config.max_seq_len) * batch * config.max_seq_len
    base = samples.get("nnx.jit")
    out["step ms"] = {k: spread(s, 1e3, 1) for k, s in samples.items()}
    out["MFU %"] = {k: spread([flops / t / peak_flops for t in s], 100, 1)
                    for k, s in samples.items()}  # fmt: skip
    if base:
        out["step / nnx.jit"] = {k: ratio_spread(s, base) for k, s in samples.items()}
    out["model TFLOP per step"] = round(flops / 1e12, 3)
    return out


def host_time(rounds: int, sizes: dict) -> dict:
    """Host CPU seconds per launch of a pipelined step (4 virtual stages, interleaved 1F1B,
    M = 16) on the one GPU, against one ``nnx.jit`` call of the same model."""
    config, m = _config(sizes), 16
    tokens = _tokens(config, 32)
    model, opt, step = _setup("mm", ("interleaved-1f1b", 4, "loop"), config, m)
    base_model, base_opt, base = _setup("nnx.jit", None, config, m)
    jax.block_until_ready(step(model, opt, tokens))
    jax.block_until_ready(base(base_model, base_opt, tokens))
    bound = mm.cached_partial(step, model, opt)
    program = step.plan(model, opt, tokens).program
    launches = sum(type(a).__name__ in ("Run", "Zeros") for a in program.actions)

    def host(fn, calls=20):
        def timed():
            cpu = []
            for _ in range(calls):
                start = time.thread_time()
                out = fn()
                cpu.append(time.thread_time() - start)
                jax.block_until_ready(out)
            return statistics.median(cpu)

        return timed

    piped = functools.partial(step, model, opt)
    plain = functools.partial(base, base_model, base_opt)
    samples = interleaved(
        {"mm.jit": host(lambda: piped(tokens)), "cached_partial": host(lambda: bound(tokens)),
         "nnx.jit": host(lambda: plain(tokens)),
         "mm.jit wall": per_call(lambda: piped(tokens), calls=10, wait=jax.block_until_ready),
         "nnx.jit wall": per_call(lambda: plain(tokens), calls=10, wait=jax.block_until_ready)},
        rounds,
    )  # fmt: skip
    return {
        "config": sizes | PRECISION | {"batch": 32, "microbatches": m, "virtual stages": 4},
        "launches per step": launches,
        "mm.jit host us per launch": spread([s / launches for s in samples["mm.jit"]], 1e6, 1),
        "cached_partial host us per launch": spread(
            [s / launches for s in samples["cached_partial"]], 1e6, 1
        ),
        "nnx.jit host us per call": spread(samples["nnx.jit"], 1e6, 1),
        "mm.jit step ms": spread(samples["mm.jit wall"], 1e3, 2),
        "nnx.jit step ms": spread(samples["nnx.jit wall"], 1e3, 2),
        "pipelined step / nnx.jit": ratio_spread(samples["mm.jit wall"], samples["nnx.jit wall"]),
    }


def first_call_in_this_process(name: str, sizes: dict, batch: int) -> dict:
    """Seconds of the first call of variant ``name`` (``nnx.jit`` or ``mm.jit one task``) in
    this fresh process, once the GPU, the model, its optimizer and the batch are ready."""
    jax.block_until_ready(jnp.zeros(8) + 1)  # the device's start, not the step's
    config = _config(sizes)
    model, opt, step = _setup(name, VARIANTS[name], config, MICROBATCHES)
    tokens = jax.block_until_ready(_tokens(config, batch))
    jax.block_until_ready(nnx.state((model, opt)))
    return {"seconds": _first_call(functools.partial(step, model, opt, tokens))}


def first_calls(rounds: int, sizes: dict, batch: int, budget: float) -> dict:
    """``mm.jit`` on one task against ``nnx.jit``: first calls in fresh processes, taking turns,
    for ``rounds`` rounds or until ``budget`` seconds have passed (at least one round)."""
    names, samples, started = ("nnx.jit", "mm.jit one task"), {}, time.monotonic()
    args = ["--batch", str(batch)] + (["--small"] if sizes is SMALL else [])
    for i in range(rounds):
        if i and time.monotonic() - started > budget:
            break
        for name in names if i % 2 == 0 else reversed(names):
            done = subprocess.run(
                [sys.executable, __file__, "--first-call-of", name, *args],
                capture_output=True, text=True, timeout=300, check=True,
            )  # fmt: skip
            seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            samples.setdefault(name, []).append(seconds)
    return {
        "batch": batch,
        "rounds": len(samples["nnx.jit"]),
        "first call s": {k: spread(v, 1, 2) for k, v in samples.items()},
        "mm.jit / nnx.jit": ratio_spread(samples["mm.jit one task"], samples["nnx.jit"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="tiny models: a dry run")
    parser.add_argument("--out", default=str(results_path("gpu.json")))
    parser.add_argument("--batch", type=int, help="the reference's batch (default: predicted)")
    parser.add_argument(
        "--first-calls",
        type=float,
        metavar="SECONDS",
        help="only first calls in fresh processes, for about this long",
    )
    parser.add_argument("--first-call-of", help=argparse.SUPPRESS)  # one fresh process's
    args = parser.parse_args()
    sizes = SMALL if args.small else REFERENCE
    if args.first_call_of:
        print(json.dumps(first_call_in_this_process(args.first_call_of, sizes, args.batch)))
        return
    device = jax.devices()[0]
    results = {
        "device": getattr(device, "device_kind", str(device)),
        "platform": device.platform,
        "versions": {"jax": jax.__version__, "jaxlib": version("jaxlib"),
                     "flax": version("flax"), "optax": version("optax"),
                     "orbax-checkpoint": version("orbax-checkpoint")},
        "rounds": args.rounds,
    }  # fmt: skip

    def write(section: str, value: dict) -> None:
        results[section] = value
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(section, json.dumps(value), flush=True)

    if args.first_calls:
        batch = args.batch or MICROBATCHES
        write("first calls", first_calls(args.rounds, sizes, batch, args.first_calls))
        return
    peak = peak_matmul(args.rounds, 512 if args.small else 8192)
    write("peak", {k: v for k, v in peak.items() if not k.startswith("_")})
    write("host", host_time(args.rounds, SMALL if args.small else HOST))  # warms the GPU too
    largest = 8 if args.small else 256
    record = functools.partial(write, "reference")
    record(reference(args.rounds, sizes, peak["_flops"], largest, record, args.batch))


if __name__ == "__main__":
    main()
