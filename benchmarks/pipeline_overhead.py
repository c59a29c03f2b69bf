"""Where a pipelined step's time goes beyond its bubble (issue 54, item 5): the pipeline against
the data-parallel step of the same model, in a process of its own with XLA's Eigen thread pool
off (``pipeline.py``'s ``overhead`` section runs it; the flag is dispatch.py's).

The harness (its model is ``overhead_mlp.py``'s): an MLP of 8 parts (two ``nnx.Linear(256,
256)`` each, ``tanh`` after each), a batch of 8 x 64 rows, M = 8, pipelined over 2 one-device
stages (4 parts each) with GPipe, 1F1B, ZB-H1 and ZB-V (in a V: 4 virtual stages of 2 parts),
against the data-parallel ``jax.jit`` step of the same model on the same 2 devices (the batch
split over them, parameters replicated). Every step returns the loss and the gradients.

In ``--rounds`` rounds, every candidate once per round (a ratio taken per round, then median
[min-max]):

- each schedule's step / the data-parallel step;
- beyond the bubble: the step against (M + S - 1) x a stage's forward + backward timed one
  action at a time (``timeline``), GPipe and 1F1B;
- the step as it ran (``overlapped_timeline``), GPipe and 1F1B: per rank, its actions' time,
  and the gaps before them spent waiting for the other rank to make an input, for its transfer,
  or for the host to launch the program (``Event.launched``; ``overhead_mlp.waits``);
- what the step costs the machine: process CPU time per step and the cores it kept busy (CPU /
  wall), the host thread's CPU time, page faults per step;
- experiments: a hand-written loop of per-stage ``jax.vjp`` programs (``device_put`` between
  them, GPipe order); stage 0's 8 forwards and 8 backwards on one device alone, and on both
  devices at once with nothing between them (no pipeline at all); the data-parallel step at the
  pipeline's granularity (4 microbatches of 64 rows per device in one program).

Run: python benchmarks/pipeline_overhead.py [--rounds N] (prints one JSON line; ``python
benchmarks/pipeline.py --only overhead`` runs it and records its results).
"""

import os

FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_multi_thread_eigen=false"
os.environ["XLA_FLAGS"] = FLAGS  # before JAX starts: this harness's flags, whatever the caller's

import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import overhead_mlp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from overhead_mlp import MLP, ROWS, WAITS, M, S, batch, loss_fn, waits  # noqa: E402
from report import interleaved, ratio_spread, rounds_option, spread  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1", "zero-bubble-v")
CALLS = 5  # steps per timed sample


def pipelined(schedule: str):
    """The ``mm.jit`` step of ``schedule``, its placed model; compiled and run once."""
    return overhead_mlp.pipelined(schedule, BATCH)


def data_parallel(microbatches: int = 1):
    """The data-parallel step over devices 0 and 1 (parameters replicated, rows split), as a
    function of no arguments; with ``microbatches`` > 1, the batch in that many microbatches
    (each device's rows of one in turn) in the same program, their gradients summed."""
    mesh = Mesh(np.array(jax.devices()[:S]), ("data",))
    graphdef, state = nnx.split(MLP())
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    rows = len(BATCH) // microbatches
    parts = [
        jax.device_put(BATCH[k * rows : (k + 1) * rows], NamedSharding(mesh, PartitionSpec("data")))
        for k in range(microbatches)
    ]

    def loss(state, x):
        return loss_fn(nnx.merge(graphdef, state), x) / microbatches

    @jax.jit
    def step(state, parts):
        outs = [jax.value_and_grad(loss)(state, x) for x in parts]
        return sum(v for v, _ in outs), jax.tree.map(lambda *g: sum(g), *(g for _, g in outs))

    return lambda: step(state, parts)


class HandWritten:
    """The two stages as plain per-stage programs (``jax.vjp`` closures returned from the
    forward's ``jax.jit``, gradients added into donated sums), launched by a loop."""

    def __init__(self):
        model = MLP()
        self.graphdef = nnx.split(model.parts[0])[0]
        devices = jax.devices()[:S]
        states = [[nnx.split(p)[1] for p in model.parts[4 * s : 4 * s + 4]] for s in range(S)]
        self.devices = devices
        self.params = [jax.device_put(states[s], devices[s]) for s in range(S)]
        self.copy = jax.device_put(states[0], devices[1])  # stage 0's parameters on device 1
        self.rows = [
            [jax.device_put(BATCH[m * ROWS : (m + 1) * ROWS], d) for m in range(M)] for d in devices
        ]
        self.one = jax.device_put(jnp.float32(1.0), devices[1])

    def stage(self, params, h):
        for p in params:
            h = nnx.merge(self.graphdef, p)(h)
        return h

    @functools.cached_property
    def programs(self):
        forward = jax.jit(lambda p, h: jax.vjp(self.stage, p, h))
        last = jax.jit(lambda p, h: jax.vjp(lambda p, h: jnp.mean(self.stage(p, h) ** 2) / M, p, h))

        @functools.partial(jax.jit, donate_argnums=(2,))
        def backward(vjp, cotangent, total):
            grads, d_h = vjp(cotangent)
            return jax.tree.map(jnp.add, total, grads), d_h

        zeros = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p))
        return forward, last, backward, zeros

    def gpipe(self):
        forward, last, backward, zeros = self.programs
        (p0, p1), (d0, d1) = self.params, self.devices
        firsts, lasts, losses = [], [], []
        for m in range(M):
            h, vjp = forward(p0, self.rows[0][m])
            firsts.append(vjp)
            loss, vjp = last(p1, jax.device_put(h, d1))
            lasts.append(vjp)
            losses.append(loss)
        sums = [zeros(p0), zeros(p1)]
        for m in range(M):
            sums[1], d_h = backward(lasts[m], self.one, sums[1])
            sums[0], _ = backward(firsts[m], jax.device_put(d_h, d0), sums[0])
        return losses, sums

    def stage0(self, devices: int):
        """Stage 0's 8 forwards then 8 backwards (its own output as the cotangent), on device 0
        and, with ``devices`` = 2, the same on device 1 at once: nothing passes between them."""
        forward, _, backward, zeros = self.programs
        sums = []
        pairs = zip((self.params[0], self.copy), self.rows, strict=True)
        for params, rows in list(pairs)[:devices]:
            total = zeros(params)
            outs = [forward(params, rows[m]) for m in range(M)]
            for h, vjp in outs:
                total, _ = backward(vjp, h, total)
            sums.append(total)
        return sums


BATCH = batch()


def _faults() -> int:
    fields = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7]) + int(fields[9])  # minor + major faults


def measured(fn, calls: int = CALLS):
    """A candidate for ``interleaved``: per call of ``fn`` (``calls`` of them, the last one
    waited for), wall seconds, process CPU seconds, the host thread's CPU seconds and page
    faults."""

    def sample() -> dict:
        cpu, host, faults = time.process_time(), time.thread_time(), _faults()
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        wall = time.perf_counter() - start
        return {
            "wall": wall / calls,
            "cpu": (time.process_time() - cpu) / calls,
            "host": (time.thread_time() - host) / calls,
            "faults": (_faults() - faults) / calls,
        }

    return sample


def stage_time(step, model) -> float:
    """A stage's forward + backward timed one action at a time (``overhead_mlp.stage_time`` of
    one ``timeline``)."""
    return overhead_mlp.stage_time(step.timeline(model, BATCH))


def measure(rounds: int) -> dict:
    steps = {name: pipelined(name) for name in SCHEDULES}
    hand = HandWritten()
    candidates = {"data parallel": data_parallel()}
    for name, (step, model) in steps.items():
        candidates[name] = functools.partial(step, model, BATCH)
    candidates.update(
        {
            "data parallel, 4 microbatches of 64 rows per device": data_parallel(4),
            "hand-written loop, GPipe": hand.gpipe,
            "stage 0 alone, one device": lambda: hand.stage0(1),
            "stage 0 on both devices at once": lambda: hand.stage0(2),
        }
    )
    for fn in candidates.values():  # compiled and warmed up
        jax.block_until_ready(fn())
    for step, model in steps.values():
        step.timeline(model, BATCH)
        step.overlapped_timeline(model, BATCH)

    def analysed(name: str):
        step, model = steps[name]
        return lambda: (stage_time(step, model), waits(step.overlapped_timeline(model, BATCH)))

    timed = {name: measured(fn) for name, fn in candidates.items()}
    timed.update({f"{name} timelines": analysed(name) for name in ("gpipe", "1f1b")})
    runs = interleaved(timed, rounds)
    wall = {name: [r["wall"] for r in runs[name]] for name in candidates}
    dp = wall["data parallel"]
    out: dict = {"data parallel step ms": spread(dp, 1e3)}
    for name in candidates:
        if name != "data parallel":
            out[f"{name}: step / data parallel"] = ratio_spread(wall[name], dp, 3)
    for name in ("gpipe", "1f1b"):
        analyses = runs[f"{name} timelines"]
        t_stage = [t for t, _ in analyses]
        ideal = [(M + S - 1) * t for t in t_stage]
        out[f"{name}: stage F + B alone ms"] = spread(t_stage, 1e3)
        out[f"{name}: (M + S - 1) x stage / data parallel"] = ratio_spread(ideal, dp, 3)
        out[f"{name}: ms beyond (M + S - 1) x stage"] = spread(
            [w - i for w, i in zip(wall[name], ideal, strict=True)], 1e3
        )
        for rank in sorted(analyses[0][1]):
            for what, label in WAITS.items():
                out[f"{name}: {rank} {label} ms"] = spread(
                    [w[rank][what] for _, w in analyses], 1e3
                )
    for name in ("data parallel", "gpipe", "1f1b", "stage 0 alone, one device"):
        cpu = [r["cpu"] for r in runs[name]]
        out[f"{name}: CPU ms per step"] = spread(cpu, 1e3)
        out[f"{name}: cores busy (CPU / wall)"] = ratio_spread(cpu, wall[name])
        out[f"{name}: host thread CPU ms per step"] = spread([r["host"] for r in runs[name]], 1e3)
        out[f"{name}: page faults per step"] = spread([r["faults"] for r in runs[name]], 1, 0)
    out["stage 0 on both devices at once / alone"] = ratio_spread(
        wall["stage 0 on both devices at once"], wall["stage 0 alone, one device"]
    )
    out["gpipe / stage 0 on both devices at once (no pipeline)"] = ratio_spread(
        wall["gpipe"], wall["stage 0 on both devices at once"]
    )
    out["gpipe / hand-written loop"] = ratio_spread(wall["gpipe"], wall["hand-written loop, GPipe"])
    threads = [p.read_text().strip() for p in pathlib.Path("/proc/self/task").glob("*/comm")]
    out["threads: XLA:CPU's intra-op pool, all in the process"] = (
        f"{sum(t.startswith('tf_XLAEigen') for t in threads)}, {len(threads)}"
    )
    for name in ("gpipe", "1f1b"):
        out[f"target: {name} <= 1.18x data parallel (median)"] = (
            statistics.median(w / d for w, d in zip(wall[name], dp, strict=True)) <= 1.18
        )
    return out


if __name__ == "__main__":
    print(json.dumps(measure(rounds_option(sys.argv))))
