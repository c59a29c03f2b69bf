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

Run: python benchmarks/packed_reads.py  (writes benchmarks/results/packed_reads.json)
"""

import math
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
from report import publish

RESULTS = pathlib.Path(__file__).parent / "results" / "packed_reads.json"
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


def measure(fn, make_args, calls=100, rounds=5):
    args = make_args()
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))
    device, host_ready, host_pending = [], [], []
    slow = jax.jit(lambda a: jnp.tanh(a @ a @ a @ a)).lower(jnp.ones((512, 512))).compile()
    busy = jnp.ones((512, 512))
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = compiled(*args)
        jax.block_until_ready(out)
        device.append((time.perf_counter() - start) / calls)
        cpu = time.thread_time()
        for _ in range(calls):
            out = compiled(*args)
        host_ready.append((time.thread_time() - cpu) / calls)
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
        host_pending.append(pending / calls)
    return {
        "compile s": compile_s,
        "device us per call": statistics.median(device) * 1e6,
        "host us per call, arguments ready": statistics.median(host_ready) * 1e6,
        "host us per call, arguments pending": statistics.median(host_pending) * 1e6,
        "arguments": len(args),
    }


def main():
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
    results = {name: measure(fn, make) for name, (fn, make) in cases.items()}
    base = results["separate"]
    results["ratios to separate"] = {
        f"{name}: {what}": results[name][what] / base[what]
        for name in cases
        if name not in ("separate", "blocks: separate", "blocks: one buffer per block")
        for what in ("compile s", "device us per call", "host us per call, arguments pending")
    }
    block_base = results["blocks: separate"]
    results["ratios to separate"].update(
        {
            f"blocks: one buffer per block: {what}": results["blocks: one buffer per block"][what]
            / block_base[what]
            for what in ("compile s", "device us per call", "host us per call, arguments pending")
        }
    )
    results["device"] = str(jax.devices()[0])
    publish(results, RESULTS, "packed reads", (*cases, "ratios to separate"))


if __name__ == "__main__":
    main()
