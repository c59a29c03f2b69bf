"""Why a stage's weights are not passed as one packed buffer (issue 16, ratios only).

A program applying 40 layers of 64x64 weights (``tanh(x @ w)``, 128 rows) is compiled and run
five ways, all in this run:
- ``separate``: each weight its own argument (what ``mm.jit`` does);
- ``offset arguments``: one flat buffer, each weight sliced out at an int32 offset passed as an
  argument (the way packed residuals are read);
- ``constant offsets``: one flat buffer sliced at offsets fixed in the program;
- ``offset vector``: one flat buffer and one int32 vector of the offsets;
- ``offset vector behind a barrier``: the same, each offset read out of the vector behind an
  ``optimization_barrier`` (so that the slices, all alike but for a scalar operand, might
  compile as one kernel).
Then 8 transformer-like blocks of 12 arrays each (two norms' scales and shifts, attention and
MLP weights and biases), applied in turn:
- ``blocks: separate``: each array its own argument (96 weights);
- ``blocks: one buffer per block``: each block's 12 arrays in one flat buffer, laid out alike in
  every block (8 weights): the slices sit at the same constant offsets in every block, so the
  blocks' kernels stay alike and XLA compiles each once per program.
Measured: compile time, device time per call, and the host thread's CPU time per call with the
arguments ready and with them still being computed (the state of a pipeline's weights while the
host runs ahead of the devices). Packing helps the host only if it cuts the argument count
without adding distinct kernels: on XLA:CPU each distinct slice is a kernel of its own.

Each case is measured once per round, the cases taking turns (A, B, C, ..., A, B, C, ...), and
each measure and each ratio to ``separate`` (taken per round) is reported as the median
[min-max] over the rounds (``--rounds N``, default 5). Compile times with JAX's compilation
caches off, so every round compiles anew.

Run: python benchmarks/packed_reads.py [--rounds N]  (writes benchmarks/results/packed_reads.json)
"""

import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
from report import interleaved, publish, ratio_spread, results_path, rounds_option, spread

RESULTS = results_path("packed_reads.json")
LAYERS, DIM, ROWS = 40, 64, 128
SIZE = DIM * DIM


def _apply(x, weights):
    for w in weights:
        x = jnp.tanh(x @ w)
    return x


def separate(x, *weights):
    return _apply(x, weights)


def offset_arguments(buf, x, *offsets):
    return _apply(x, [jax.lax.dynamic_slice(buf, (o,), (SIZE,)).reshape(DIM, DIM) for o in offsets])


def constant_offsets(buf, x):
    return _apply(x, [buf[j * SIZE : (j + 1) * SIZE].reshape(DIM, DIM) for j in range(LAYERS)])


def offset_vector(buf, x, offsets):
    return _apply(
        x,
        [
            jax.lax.dynamic_slice(buf, (offsets[j],), (SIZE,)).reshape(DIM, DIM)
            for j in range(LAYERS)
        ],
    )


def offset_vector_behind_barrier(buf, x, offsets):
    scalars = jax.lax.optimization_barrier([offsets[j] for j in range(LAYERS)])
    return _apply(x, [jax.lax.dynamic_slice(buf, (o,), (SIZE,)).reshape(DIM, DIM) for o in scalars])


BLOCKS = 8
BLOCK_SHAPES = [(DIM,), (DIM,), (DIM, 3 * DIM), (3 * DIM,), (DIM, DIM), (DIM,),
                (DIM,), (DIM,), (DIM, 4 * DIM), (4 * DIM,), (4 * DIM, DIM), (DIM,)]  # fmt: skip


def _block(x, arrays):
    g1, b1, wqkv, bqkv, wo, bo, g2, b2, w1, c1, w2, c2 = arrays
    h = (x - x.mean(-1, keepdims=True)) * g1 + b1
    x = x + jnp.tanh((h @ wqkv + bqkv)[:, :DIM]) @ wo + bo
    h = (x - x.mean(-1, keepdims=True)) * g2 + b2
    return x + jnp.tanh(h @ w1 + c1) @ w2 + c2


def blocks_separate(x, *arrays):
    n = len(BLOCK_SHAPES)
    for b in range(BLOCKS):
        x = _block(x, arrays[b * n : (b + 1) * n])
    return x


def blocks_buffered(x, *buffers):
    for buf in buffers:
        arrays, at = [], 0
        for shape in BLOCK_SHAPES:
            size = math.prod(shape)
            arrays.append(jax.lax.slice(buf, (at,), (at + size,)).reshape(shape))
            at += size
        x = _block(x, arrays)
    return x


def measure(fn, args, calls=100) -> dict:
    """One round of ``fn`` on ``args``: compile seconds (JAX's caches off), and device seconds
    and host CPU seconds per call, mean of ``calls`` calls, with the arguments ready and still
    being computed."""
    jax.clear_caches()  # JAX's in-memory cache of compiled programs too: every round compiles
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    slow = jax.jit(lambda a: jnp.tanh(a @ a @ a @ a)).lower(jnp.ones((512, 512))).compile()
    busy = jnp.ones((512, 512))
    start = time.perf_counter()
    for _ in range(calls):
        out = compiled(*args)
    jax.block_until_ready(out)
    device = (time.perf_counter() - start) / calls
    cpu = time.thread_time()
    for _ in range(calls):
        out = compiled(*args)
    host_ready = (time.thread_time() - cpu) / calls
    jax.block_until_ready(out)
    pending = 0.0
    for _ in range(calls // 10):
        gate = slow(busy)  # the arguments are made after a slow program: not ready yet
        later = jax.tree.map(lambda a, g=gate: a + 0 * g[0, 0].astype(a.dtype), args)
        cpu = time.thread_time()
        for _ in range(10):
            out = compiled(*later)
        pending += time.thread_time() - cpu
        jax.block_until_ready(out)
    return {
        "compile s": compile_s,
        "device us per call": device * 1e6,
        "host us per call, arguments ready": host_ready * 1e6,
        "host us per call, arguments pending": pending / calls * 1e6,
    }


MEASURES = (
    "compile s",
    "device us per call",
    "host us per call, arguments ready",
    "host us per call, arguments pending",
)
RATIOS = ("compile s", "device us per call", "host us per call, arguments pending")


def main(rounds: int):
    key = jax.random.key(0)
    weights = [0.1 * jax.random.normal(k, (DIM, DIM)) for k in jax.random.split(key, LAYERS)]
    buf = jnp.concatenate([w.ravel() for w in weights])
    x = jnp.ones((ROWS, DIM))
    offsets = [jnp.int32(j * SIZE) for j in range(LAYERS)]
    cases = {
        "separate": (separate, lambda: [x, *weights]),
        "offset arguments": (offset_arguments, lambda: [buf, x, *offsets]),
        "constant offsets": (constant_offsets, lambda: [buf, x]),
        "offset vector": (offset_vector, lambda: [buf, x, jnp.stack(offsets)]),
        "offset vector behind a barrier": (
            offset_vector_behind_barrier,
            lambda: [buf, x, jnp.stack(offsets)],
        ),
    }
    block_arrays = [
        0.01 * jax.random.normal(k, shape)
        for b in range(BLOCKS)
        for k, shape in zip(jax.random.split(jax.random.key(b), 12), BLOCK_SHAPES, strict=True)
    ]
    n = len(BLOCK_SHAPES)
    block_buffers = [
        jnp.concatenate([a.ravel() for a in block_arrays[b * n : (b + 1) * n]])
        for b in range(BLOCKS)
    ]
    cases["blocks: separate"] = (blocks_separate, lambda: [x, *block_arrays])
    cases["blocks: one buffer per block"] = (blocks_buffered, lambda: [x, *block_buffers])
    made = {name: make() for name, (_, make) in cases.items()}
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        samples = interleaved(
            {name: functools.partial(measure, fn, made[name]) for name, (fn, _) in cases.items()},
            rounds,
        )
    finally:
        jax.config.update("jax_enable_compilation_cache", was)

    def of(name: str, what: str) -> list[float]:
        return [s[what] for s in samples[name]]

    results = {
        name: {
            **{
                what: spread(of(name, what), digits=3 if what == "compile s" else 1)
                for what in MEASURES
            },
            "arguments": len(made[name]),
        }
        for name in cases
    }
    bases = {
        name: "blocks: separate" if name.startswith("blocks") else "separate" for name in cases
    }
    results["ratios to separate"] = {
        f"{name}: {what}": ratio_spread(of(name, what), of(bases[name], what))
        for name in cases
        if name not in bases.values()
        for what in RATIOS
    }
    results["device"] = str(jax.devices()[0])
    publish(results, RESULTS, "packed reads", (*cases, "ratios to separate"), rounds)


if __name__ == "__main__":
    main(rounds_option(sys.argv))
